"""The MLflow connection the jobs share: short retries, the errors sorted into the bundle's exit
codes, the tags that link runs, the code version, and the one file a tracked run keeps on
storage."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.core.errors import ClusterError, ConfigError, first_line
from pipeline.core.storage import Location

log = logging.getLogger(__name__)

# MLflow reads these at each request. Its defaults retry a server that does not answer for
# minutes (7 retries, doubling from 2 s; 120 s timeouts): a job would stall at its start, and an
# epoch's logging during an outage. Here: 3 attempts over about 3 s. Set ones are kept.
HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
# What a tracking call raises when the server fails it or cannot be reached (requests'
# errors are OSErrors); every call made while the work runs is guarded by these.
TRACKING_ERRORS = (MlflowException, OSError)

# Tags on the runs and model versions (`ray_cv.` keeps them apart from MLflow's own).
JOB = "ray_cv.job"  # preprocess, train or infer
RUN_DIR = "ray_cv.run_dir"  # a training run's directory on storage
DATASET = "ray_cv.dataset"  # the dataset's URI
DATASET_VERSION = "ray_cv.dataset_version"
DATASET_FINGERPRINT = "ray_cv.dataset_fingerprint"
MODEL_SPEC = "ray_cv.model"  # the checkpoint's model spec, as JSON
CODE_VERSION = "ray_cv.code_version"  # git:<commit>, else sha256:<the shipped code's hash>
CHECKPOINT = "ray_cv.checkpoint"  # a checkpoint's URI on storage
PREPROCESS_RUN = "ray_cv.preprocess_run_id"  # links a training run to its dataset's run
TRAINING_RUN = "ray_cv.training_run_id"  # links inference to the training run it used
ERROR = "ray_cv.error"  # why a run ended FAILED
# A training run's file that names its MLflow run: written once, by the job that created it.
RUN_RECORD = "mlflow_run.json"
# MLflow's limits: params per log_batch call, characters per param value.
PARAMS_PER_CALL, PARAM_CHARS = 100, 6000


@dataclass
class Connection:
    """One job's MLflow client, on the experiment its runs go into."""

    uri: str
    client: MlflowClient
    experiment_id: str


def connect(uri: str, experiment: str) -> Connection:
    """The client of the server at `uri`, with `experiment` found or made: the job's first
    call, which fails it (exit 3 or 2) if the server cannot be used."""
    for name, value in HTTP_SETTINGS.items():
        os.environ.setdefault(name, value)
    try:
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            try:
                experiment_id = client.create_experiment(experiment)
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":  # made by a job beside this one
                    raise
                experiment_id = client.get_experiment_by_name(experiment).experiment_id
        elif found.lifecycle_stage == "deleted":
            raise ConfigError(
                f"MLflow experiment {experiment!r} at {uri} is deleted: restore it "
                "(mlflow experiments restore) or set tracking.experiment to another name"
            )
        else:
            experiment_id = found.experiment_id
    except TRACKING_ERRORS as e:
        raise start_error(uri, e) from None
    log.info("tracking in MLflow at %s, experiment %r (id %s)", uri, experiment, experiment_id)
    return Connection(uri, client, experiment_id)


def unreachable(error: BaseException) -> bool:
    """Whether `error` says the server did not answer (or kept failing), rather than refused."""
    if isinstance(error, OSError):
        return True
    text = str(error)
    # MLflow's wording for a request that raised (refused, timed out, no such host) or that
    # answered 5xx through every retry.
    return "failed with exception" in text or "Max retries exceeded" in text


def start_error(uri: str, error: BaseException) -> ClusterError | ConfigError:
    """The error that ends a job whose tracking server cannot be used at its start."""
    if unreachable(error):
        return ClusterError(
            f"the tracking server {uri} does not answer ({brief(error)}). Start it, or fix "
            "tracking.uri (or MLFLOW_TRACKING_URI); unset both to run without tracking"
        )
    return ConfigError(
        f"the tracking URI {uri} is not an MLflow tracking server this job can use: "
        f"{brief(error)}. Set tracking.uri (or MLFLOW_TRACKING_URI) to the server's address, "
        "e.g. http://mlflow.internal:5000"
    )


def brief(error: BaseException) -> str:
    """An error's first line, at most 200 characters."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def log_steps(steps: list[tuple[str, Callable[[], object]]]) -> tuple[list[str], str | None]:
    """Run a job's logging `steps` at its end, each (what, call), every one whatever the others
    do. Returns what the server did not take (its failures: a later submission logs them), and
    why the run ends FAILED, if a step failed otherwise (the bundle's own error, logged with its
    traceback: the work it records is done and stays done)."""
    missing, failed = [], None
    for what, call in steps:
        try:
            call()
        except TRACKING_ERRORS as e:
            log.warning("MLflow: %s: %s", what, brief(e))
            missing.append(what)
        except Exception as e:  # the work is whole on storage: its record alone failed
            log.warning("MLflow: %s failed", what, exc_info=True)
            failed = failed or f"{what} failed: {type(e).__name__}: {first_line(e)}"
    return missing, failed


def end_run(conn: Connection, run_id: str, status: str, failed: str | None) -> list[str]:
    """End MLflow run `run_id` with `status`, or FAILED with the reason `failed` as its
    ERROR tag; returns what the server did not take."""
    status = "FAILED" if failed else status
    try:
        if failed:
            conn.client.set_tag(run_id, ERROR, failed[:5000])
        conn.client.set_terminated(run_id, status)
    except TRACKING_ERRORS as e:
        log.warning("MLflow: the run's end: %s", brief(e))
        return [f"the run's end (status {status})"]
    return []


def params(config: dict) -> dict[str, str]:
    """A flattened config (dotted keys) as MLflow params: strings, within MLflow's limit."""
    return {k: json.dumps(v) if not isinstance(v, str) else v for k, v in config.items()}


def log_params(conn: Connection, run_id: str, values: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v[:PARAM_CHARS]) for k, v in sorted(values.items())]
    for i in range(0, len(items), PARAMS_PER_CALL):
        conn.client.log_batch(run_id, params=items[i : i + PARAMS_PER_CALL])


def log_files(conn: Connection, run_id: str, files: list[Location], path: str | None = None):
    """Copy `files` (local or on storage) into the run's artifacts, below `path`; a file
    logged again replaces the earlier copy."""
    with tempfile.TemporaryDirectory(prefix="ray-cv-artifacts-") as d:
        for f in files:
            (Path(d) / os.path.basename(f.path)).write_bytes(f.read_bytes())
        conn.client.log_artifacts(run_id, d, path)


def run_of(directory: Location) -> dict | None:
    """The MLflow run recorded in a training run's directory ({"tracking_uri", "run_id",
    "experiment_id"}), if it is tracked."""
    record = directory.child(RUN_RECORD)
    return json.loads(record.read_bytes()) if record.exists() else None


def write_once(file: Location, data: bytes) -> bytes:
    """Write `file` unless it exists, and return what it holds: `data`, or what another writer
    put there first. Whole or absent for readers at every moment."""
    if file.exists():
        return file.read_bytes()
    if file.fs.type_name == "local":
        parent = file.create_parent()
        tmp = os.path.join(parent, f".{os.path.basename(file.path)}.tmp-{os.getpid()}")
        Path(tmp).write_bytes(data)
        try:
            os.link(tmp, file.path)  # fails if the name exists: exactly one writer wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    else:
        # An object store's PUT is atomic, not exclusive: two writers racing here both write,
        # and each reads back the one that stands.
        file.write_bytes(data)
    return file.read_bytes()


def code_version() -> str:
    """The bundle's code: git:<commit> (+dirty) where it runs from a git checkout, else
    sha256:<hash of the code and configs shipped with the job> (a job's copy has no .git)."""
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            git = ["git", "-C", str(root)]
            head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
            status = [*git, "status", "--porcelain", "--", "pipeline", "jobs", "configs"]
            dirty = subprocess.run(status, capture_output=True, text=True)
            if head.returncode == 0:
                return f"git:{head.stdout.strip()}{'+dirty' if dirty.stdout.strip() else ''}"
        except OSError:  # no git installed: the fingerprint says it as well
            pass
    digest = hashlib.sha256()
    for folder in ("pipeline", "jobs", "configs"):
        for f in sorted((root / folder).rglob("*")):
            if f.suffix in (".py", ".yaml") and "__pycache__" not in f.parts:
                digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return f"sha256:{digest.hexdigest()[:16]}"
