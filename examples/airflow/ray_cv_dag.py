"""Airflow DAG: preprocess -> train -> infer on a Ray cluster, one task per job.

Each task runs `python -m jobs.submit ... <step>`: it submits the job with the bundle's
runtime_env.yaml, streams the job's log into the task's log, and fails the task unless the job
SUCCEEDED (a job stopped with `ray job stop` fails it too, where a bare `ray job submit` would
exit 0). Killing the task stops the job. Retrying a task is safe: preprocessing is a no-op when
its dataset is up to date, training resumes its run, inference replaces its output.
Each task is a process of its own: training reads the dataset version that is newest when it
starts, and inference the version training read (the run's checkpoint records it), whatever
was committed since; nothing passes between the tasks.

Set-up on the Airflow workers (Airflow 3; BashOperator is in the standard provider it ships):
  - the bundle checked out at RAY_CV_BUNDLE with its client installed (`pip install -e .` there)
    for the `python` first on the tasks' PATH: Airflow's own environment or one beside it (to
    parse this file Airflow needs only pyyaml and pydantic, which it ships with);
  - RAY_CV_ADDRESS (the Ray dashboard, e.g. http://ray-head:8265) and RAY_CV_ROOT (s3://...);
    optionally RAY_CV_PROFILE and RAY_CV_SET (see `python -m jobs.submit --help`),
    RAY_CV_PY_MODULES (your own packages for every job, space-separated: folders or .whl files
    on the Airflow workers, or URIs; each a `--py-module`), and RAY_CV_RETRIES (default 2: a
    task that fails is retried that many times, 5 minutes apart);
  - the cluster's token in the Airflow Variable `ray_auth_token` (Ray 2.60 clusters require
    token authentication). Nothing secret lives in this file.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, chain

BUNDLE = os.environ.get("RAY_CV_BUNDLE", "/opt/ray-cv-bundle")
ADDRESS = os.environ.get("RAY_CV_ADDRESS", "http://127.0.0.1:8265")
ROOT = os.environ.get("RAY_CV_ROOT", "s3://my-bucket/ray-cv")
PROFILE = os.environ.get("RAY_CV_PROFILE", "")  # "demo" for the small generated-data configs
SETTINGS = shlex.split(os.environ.get("RAY_CV_SET", ""))  # e.g. "train.epochs=20 infer.top_k=3"
PY_MODULES = shlex.split(os.environ.get("RAY_CV_PY_MODULES", ""))  # e.g. "/opt/src/mynet"
RETRIES = int(os.environ.get("RAY_CV_RETRIES", "2"))

sys.path.insert(0, BUNDLE)
from pipeline.chain.plan import STEPS, step_command  # noqa: E402  (the bundle: on the path above)

with DAG(
    dag_id="ray_cv",
    schedule="@weekly",
    start_date=datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc),
    catchup=False,
    max_active_runs=1,  # two runs would train the same run name at once
    default_args={"retries": RETRIES, "retry_delay": datetime.timedelta(minutes=5)},
    tags=["ray"],
) as dag:
    chain(
        *[
            BashOperator(
                task_id=step,
                bash_command=shlex.join(
                    step_command(
                        ADDRESS, ROOT, step, profile=PROFILE, sets=SETTINGS, py_modules=PY_MODULES
                    )
                ),
                cwd=BUNDLE,
                env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "{{ var.value.ray_auth_token }}"},
                append_env=True,
            )
            for step in STEPS
        ]
    )
