"""ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
    -- python -m jobs.export --config configs/export.yaml model=s3://bucket/runs/resnet18-lite

Export the best checkpoint of a training run (or a given checkpoint), with the weights inference
would classify with, to ONNX (model.onnx) and torch.export (model.pt2), beside
preprocessing.json (how to feed them as training fed the network: sizes, resize and crop,
mean and std, classes) into <run>/export/<checkpoint name> or output=. Before anything is
written, ONNX Runtime and the exported program classify the val split of the dataset (by
default the checkpoint's own, at the version it was trained on) against PyTorch (parity.json):
an export that disagrees is not written. Prints the summary as JSON.
Exit codes: 0 done (or this export was there already), 1 unusable input (run, checkpoint,
dataset, an output that holds something else, a model that does not export or fails the parity
check), 2 invalid config, 3 no node with `cpus` CPUs within capacity_timeout_s.
"""

import json
import logging

import ray

from jobs.cli import job_main
from pipeline.export.config import ExportConfig

log = logging.getLogger("jobs.export")


def main(cfg: ExportConfig) -> str:
    # Here, not at the top: a bad config fails before torch is imported (seconds, on a node).
    from pipeline.export.exporter import export

    ray.init()
    summary = export(cfg)
    log.info("export: %s", summary["output"])
    return json.dumps(summary, indent=2)


if __name__ == "__main__":
    job_main(__doc__, ExportConfig, "configs/export.yaml", main, docs_page="docs/export.md")
