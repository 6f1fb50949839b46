"""ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
    -- python -m jobs.preprocess --config configs/preprocess.yaml output=s3://bucket/food101

Preprocess images into Parquet shards plus a manifest; with a tracking URI, logs the dataset
version to MLflow (docs/tracking.md). Exit codes: 0 done, 1 unusable input data, 2 invalid
config, 3 no CPU for it, or the tracking server does not answer.
"""

import logging

import ray

from jobs.cli import job_main
from pipeline.core.logs import CURRENT_DATASET_LINE
from pipeline.core.storage import Location
from pipeline.data.config import PreprocessConfig

log = logging.getLogger("jobs.preprocess")


def main(cfg: PreprocessConfig) -> None:
    # Here, not at the top: a bad config fails before torch is imported (seconds, on a node).
    from pipeline.data.preprocess import preprocess
    from pipeline.tracking import dataset_tracker

    output = Location.parse(cfg.output)
    tracking = dataset_tracker(cfg)  # None when off; a server that does not answer: exit 3
    ray.init()
    manifest = preprocess(cfg, output=output)
    if tracking is not None:
        tracking.log_dataset(cfg, output, manifest.model_dump(mode="json"))
    train, val = manifest.splits["train"], manifest.splits["val"]
    log.info(
        "dataset at %s: %d classes, train %d, val %d, skipped %d",
        *(output.uri, len(manifest.classes), train.rows, val.rows, len(manifest.skipped)),
    )
    log.info("%s%s", CURRENT_DATASET_LINE, manifest.version)


if __name__ == "__main__":
    job_main(
        __doc__, PreprocessConfig, "configs/preprocess.yaml", main, docs_page="docs/preprocess.md"
    )
