"""ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
    -- python -m jobs.infer --config configs/infer.yaml \
       model=s3://bucket/runs/resnet18-lite input=s3://bucket/food101 output=s3://bucket/preds

Classify a preprocessed dataset split or an image folder with the best checkpoint of a training
run (or a given checkpoint), on Ray Data; writes predictions.parquet and summary.json (accuracy,
per-class precision and recall, confusion matrix when labels are known) to output. Given one
image file as input, prints its top-k classes as JSON instead. Any config key can be overridden
as key=value (see pipeline/config.py: InferConfig). Exit codes: 0 done, 1 unusable input (run,
checkpoint, images), 2 invalid config, 3 no GPU for use_gpu=true.
"""

import json
import logging

import ray

from pipeline.cli import job_main
from pipeline.config import InferConfig

log = logging.getLogger("jobs.infer")


def main(cfg: InferConfig) -> None:
    # Here, not at the top: a bad config fails before torch is imported (seconds, on a node).
    from pipeline.infer import classify_image, is_single_image, run

    ray.init()
    if is_single_image(cfg):
        print(json.dumps(classify_image(cfg), indent=2), flush=True)
        return
    summary = run(cfg)
    accuracy = summary.get("accuracy")
    log.info(
        "%d images, %.1f images/s, %d skipped%s", summary["images"], summary["images_per_s"],
        len(summary["skipped"]), "" if accuracy is None else f", accuracy {accuracy:.4f}",
    )  # fmt: skip
    print(f"predictions: {cfg.output.rstrip('/')}/predictions.parquet", flush=True)


if __name__ == "__main__":
    job_main(__doc__, InferConfig, "configs/infer.yaml", main)
