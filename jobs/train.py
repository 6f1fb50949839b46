"""ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
    -- python -m jobs.train --config configs/train.yaml \
       dataset=s3://bucket/food101 storage_path=s3://bucket/runs name=resnet18-lite

Train an image classifier (model.name: ResNet-18 by default, any torchvision classifier,
timm/<name> or module:function; docs/models.md) on a preprocessed dataset with Ray Train,
fault-tolerant: failed workers are restarted from the latest checkpoint (max_failures), and
submitting the same run name again resumes it. Writes summary.json, history.csv and curves.png
into <storage_path>/<name> and prints the best checkpoint's path last; with a tracking URI,
tracks the run in MLflow (docs/tracking.md). Exit codes: 0 done, 1 unusable input (dataset,
checkpoint, weights file), 2 invalid config (the model's name, weights name and builder
arguments too), 3 training failed (workers could not be placed, or retries used up) or the
tracking server does not answer.
"""

import logging

import ray

from jobs.cli import job_main
from pipeline.core.storage import Location
from pipeline.train.config import TrainConfig

log = logging.getLogger("jobs.train")


def main(cfg: TrainConfig) -> str:
    # Here, not at the top: a bad config fails before torch is imported (seconds, on a node).
    from pipeline.tracking import training_tracker
    from pipeline.train.driver import input_verdict, train

    dataset, runs = Location.parse(cfg.dataset), Location.parse(cfg.storage_path)
    tracking = training_tracker(cfg)  # None when off; a server that does not answer: exit 3
    ray.init()
    summary = train(cfg, dataset=dataset, runs=runs, tracking=tracking)
    best = summary["best_metrics"]
    by = summary["checkpoint_metric"]
    log.info(
        "%d epochs, final val accuracy %.4f; best checkpoint (by %s, %s) epoch %d, val loss %.4f, "
        "val accuracy %.4f%s; %.1f images/s",
        summary["epochs"],
        summary["final_accuracy"],
        by,
        "the newest" if by == "last" else f"{summary['checkpoint_mode']} is best",
        best["epoch"],
        best["val_loss"],
        best["val_accuracy"],
        f", {by} {best[by]:.4f}" if by not in ("val_loss", "val_accuracy", "last") else "",
        summary["images_per_s"],
    )
    log.info(input_verdict(summary, cfg))
    return f"best checkpoint: {summary['best_checkpoint']}"


if __name__ == "__main__":
    job_main(__doc__, TrainConfig, "configs/train.yaml", main, docs_page="docs/train.md")
