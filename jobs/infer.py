"""ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
    -- python -m jobs.infer --config configs/infer.yaml \
       model=s3://bucket/runs/resnet18-lite input=s3://bucket/food101 output=s3://bucket/preds

Classify a preprocessed dataset split (of the run's own dataset, the version it was trained on,
unless dataset_version= says) or an image folder with the best checkpoint of a training
run (or a given checkpoint), on Ray Data; writes the predictions as a new version below output
and commits it with output/summary.json (accuracy, per-class precision and recall, confusion
matrix when labels are known, the files that hold the predictions); submitted again after it
failed or was stopped midway, it infers only the images it had not written. With a tracking
URI, logs them to MLflow, linked to the training run (docs/tracking.md). Given one image file as
input, prints its top-k classes as JSON instead. Exit codes: 0 done, 1 unusable input (run,
checkpoint, images), 2 invalid config, 3 the cluster cannot run it (no GPU for use_gpu=true,
fewer CPUs than cpus_per_actor) or the tracking server does not answer.
"""

import json
import logging

import ray

from jobs.cli import job_main
from pipeline.core.errors import InputError
from pipeline.core.storage import Location
from pipeline.infer.config import InferConfig

log = logging.getLogger("jobs.infer")


def main(cfg: InferConfig) -> str:
    # Here, not at the top: a bad config fails before torch is imported (seconds, on a node).
    from pipeline.infer import batch, predictions
    from pipeline.tracking import predictions_tracker

    model, source = Location.parse(cfg.model), Location.parse(cfg.input)
    if not source.exists():
        raise InputError(f"input={source.uri} does not exist")
    if not source.is_dir():
        ray.init()
        return json.dumps(batch.classify_image(cfg, model=model, image=source), indent=2)
    if cfg.output is None:
        raise InputError("output= is required for a dataset or a folder (where to write)")
    output = Location.parse(cfg.output)
    tracking = predictions_tracker(cfg)  # None when off; a server that does not answer: exit 3
    ray.init()
    summary = batch.infer(cfg, model=model, source=source, output=output)
    if tracking is not None:
        tracking.log_predictions(cfg, output, summary)
    accuracy = summary.get("accuracy")
    log.info(
        "%d images, %.1f images/s, %d skipped%s",
        summary["images"],
        summary["images_per_s"],
        len(summary["skipped"]),
        "" if accuracy is None else f", accuracy {accuracy:.4f}",
    )
    placed = output.child(summary["predictions"]).uri
    return f"predictions: {placed} (committed by {output.child(predictions.SUMMARY).uri})"


if __name__ == "__main__":
    job_main(__doc__, InferConfig, "configs/infer.yaml", main, docs_page="docs/infer.md")
