"""Run by the `anyscale` venv's python (harness/anyscale_venv.py): reads {path: model} as JSON on
stdin, loads each file with that model of the anyscale package, and writes {path: "ok" or the
error} as JSON. A job's `requirements` file is read as Anyscale reads it, line by line."""

import json
import sys

from anyscale.compute_config.models import ComputeConfig
from anyscale.job.models import JobConfig
from anyscale.schedule.models import ScheduleConfig
from anyscale.service.models import ServiceConfig
from anyscale.utils.runtime_env import parse_requirements_file
from packaging.requirements import Requirement

MODELS = {
    "JobConfig": JobConfig,
    "ComputeConfig": ComputeConfig,
    "ServiceConfig": ServiceConfig,
    "ScheduleConfig": ScheduleConfig,
}


def check(path: str, model: str) -> str:
    config = MODELS[model].from_yaml(path)
    job = config.job_config if model == "ScheduleConfig" else config
    requirements = getattr(job, "requirements", None)
    if isinstance(requirements, str):
        lines = parse_requirements_file(requirements)
        if not lines:
            return f"{requirements}: no requirements read"
        for line in lines:
            Requirement(line)  # raises on a line pip would not take
    return "ok"


results = {}
for path, model in json.load(sys.stdin).items():
    try:
        results[path] = check(path, model)
    except Exception as e:  # reported per file, for the test to name
        results[path] = f"{type(e).__name__}: {e}"
json.dump(results, sys.stdout)
