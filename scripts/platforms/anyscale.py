"""The Anyscale files: a job config per job, compute configs for AWS and GCP (on demand, and
spot for the jobs that resume), the chain on a schedule, and the service."""

from __future__ import annotations

from scripts.platforms.common import (
    MAX_RETRIES,
    SERVE,
    chain,
    dump,
    entrypoints,
    image,
    runtime_env,
    serve_config,
    timeout_s,
)
from scripts.platforms.values import ARTIFACTS, Values

# plan() wants a URI; the entrypoint gets the variable, which the job's shell expands. Unset,
# the shell stops the job at its first use (exit 2, this message) before anything runs, rather
# than the jobs writing to a node's disk.
_STAND_IN = "s3://ANYSCALE-ARTIFACT-STORAGE"
GUARD = "${ANYSCALE_ARTIFACT_STORAGE:?is not set: set anyscale.storage in the values}"
# Spot workers where a retry resumes: train and tune from their checkpoints, infer from the
# parts it committed, the chain from its last step. The check, preprocessing and export are
# short and start over, and the service must stay up: on demand.
SPOT_STEPS = ("train", "infer", "tune", "chain")
PROVIDERS = ("aws", "gcp")


def compute_config(values: Values, provider: str, market: str) -> dict:
    head = {"instance_type": getattr(values.head.instance_types, provider)}
    config = {"cloud": values.anyscale.cloud} if values.anyscale.cloud else {}
    return config | {
        # CPU 0: no task runs on the head; it runs the drivers.
        "head_node": head | {"resources": {"CPU": 0}},
        "worker_nodes": [
            {
                "name": g.name,
                "instance_type": getattr(g.instance_types, provider),
                "min_nodes": g.min_nodes,
                "max_nodes": g.max_nodes,
                "market_type": market,
            }
            for g in values.worker_groups
        ],
    }


def files(values: Values, lock: str) -> dict[str, str]:
    found = {}
    for provider in PROVIDERS:
        nodes = [values.head, *values.worker_groups]
        if not all(getattr(n.instance_types, provider) for n in nodes):
            continue  # the values give this cloud's machine types for every node, or none
        for suffix, market in (("", "ON_DEMAND"), ("-spot", "PREFER_SPOT")):
            found[f"anyscale/compute-{provider}{suffix}.yaml"] = dump(
                compute_config(values, provider, market)
            )
    env = runtime_env(values)
    common = {
        "image_uri": image(values, lock, "anyscale"),
        **(
            {"registry_login_secret": values.image.pull_secrets[0]}
            if values.image.pull_secrets
            else {}
        ),
        **({"cloud": values.anyscale.cloud} if values.anyscale.cloud else {}),
        "working_dir": env["working_dir"],
        "excludes": env["excludes"],
        "env_vars": env["env_vars"],
        **({"py_modules": env["py_modules"]} if "py_modules" in env else {}),
    }

    def job(step: str, entrypoint: str) -> dict:
        compute = values.name + ("-spot" if step in SPOT_STEPS else "")
        return {
            "name": f"{values.name}-{step}",
            "entrypoint": entrypoint,
            **common,
            "compute_config": compute,
            "max_retries": MAX_RETRIES,
            "timeout_s": timeout_s(values, step),
        }

    root = values.anyscale.storage.replace(ARTIFACTS, _STAND_IN)
    commands = {
        step: command.replace(_STAND_IN, GUARD, 1).replace(_STAND_IN, ARTIFACTS)
        for step, command in entrypoints(values, root).items()
    }
    for step, command in commands.items():
        found[f"anyscale/jobs/{step}.yaml"] = dump(job(step, command))
    found["anyscale/schedule.yaml"] = dump(
        {
            "cron_expression": values.jobs.schedule,
            "timezone": values.jobs.timezone,
            "job_config": job("chain", chain(commands, values)),
        }
    )
    # Serve reads the model path itself, expanding the variable (pipeline/serve/config.py).
    serve = serve_config(values.anyscale.storage, values)
    found["anyscale/service.yaml"] = dump(
        {"name": f"{values.name}-{SERVE}", **common, "compute_config": values.name, **serve}
    )
    return found
