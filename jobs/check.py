"""ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
    -- python -m jobs.check --config configs/check.yaml \
       storage=s3://bucket/runs dataset=s3://bucket/food101 packages=[mynets]

Check that the bundle runs on this cluster, GPUs included, in a few minutes: every node answers
and has the driver's and requirements/cluster.lock's Ray, torch and torchvision, and your
packages; its GPUs run a matmul, decode=gpu and have memory free; the training workers of the
train config (`train`, default configs/train.yaml) all-reduce over their backend (NCCL or
gloo), timed; storage takes a scratch object and every node reads it back; the dataset, if
there, reads; /dev/shm and the object store hold what the loader needs. Prints a table of rows
(pass, fail: what is wrong and what to fix, skipped: why) and the JSON report as one line,
also written to `report` (default <storage>/checks/<id>.json). Exit codes: 0 every row passed
or was skipped, 1 only rows of the input failed (storage that refuses for good, a dataset that
is there but unreadable), 2 invalid config (this one or the train config), 3 a row of the
cluster's failed. docs/check.md.
"""

import logging

import ray

from jobs.cli import job_main
from pipeline.check.config import CheckConfig, train_config
from pipeline.check.report import one_line
from pipeline.core.errors import EXIT_CODES, ClusterError, InputError

log = logging.getLogger("jobs.check")


def main(cfg: CheckConfig) -> str:
    train = train_config(cfg)  # a bad train config: exit 2, before the cluster is asked
    from pipeline.check.run import check

    context = ray.init()
    data = check(cfg, train, dashboard=context.dashboard_url)
    line = one_line(data)
    if data["exit_code"] == 0:
        return line
    print(line, flush=True)
    where = f"; the report: {data['report']}" if data["report"] else ""
    error = ClusterError if data["exit_code"] == EXIT_CODES[ClusterError] else InputError
    raise error(f"{data['verdict']}{where}")


if __name__ == "__main__":
    job_main(__doc__, CheckConfig, "configs/check.yaml", main, docs_page="docs/check.md")
