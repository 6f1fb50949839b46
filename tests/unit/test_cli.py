"""What a user meets first: each command's --help, and what each module imports."""

import functools
import subprocess
import sys
import textwrap

import pytest

from harness.cluster import BUNDLE_ROOT
from pipeline.check.config import CheckConfig
from pipeline.core.config import describe_keys
from pipeline.data.config import PreprocessConfig
from pipeline.export.config import ExportConfig
from pipeline.infer.config import InferConfig
from pipeline.train.config import TrainConfig
from pipeline.tune.config import SweepConfig


def run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=BUNDLE_ROOT, capture_output=True, text=True, check=True
    )
    return proc.stdout


@pytest.mark.parametrize(
    ("job", "cls"),
    [
        ("preprocess", PreprocessConfig),
        ("train", TrainConfig),
        ("infer", InferConfig),
        ("export", ExportConfig),
        ("tune", SweepConfig),
        ("check", CheckConfig),
    ],
)
def test_job_help_lists_every_key(job, cls):
    text = run("-m", f"jobs.{job}", "--help")
    assert text.startswith("usage: ")
    assert f"python -m jobs.{job} --config configs/{job}.yaml" in text  # the submit line
    for key, kind, default, description in describe_keys(cls):
        assert f"  {key} ({kind}, default {default})" in text
        # One or two lines a key: the explanation lives on the job's docs page.
        assert len(textwrap.wrap(description, width=90)) <= 2, key
    assert text.rstrip().endswith(f"Each setting explained: docs/{job}.md")
    assert (BUNDLE_ROOT / "docs" / f"{job}.md").exists()


def test_chain_help_lists_steps_and_their_keys():
    text = run("-m", "jobs.submit", "--help")
    steps = (
        "steps, in this order: preprocess, train, infer (or all); export and tune only when named"
    )
    assert steps in text
    for step, cls in [
        ("preprocess", PreprocessConfig),
        ("train", TrainConfig),
        ("export", ExportConfig),
        ("tune", SweepConfig),
        ("check", CheckConfig),
    ]:
        assert f"--set {step}.KEY=VALUE" in text
        assert all(f"  {key} (" in text for key, *_ in describe_keys(cls))


@functools.cache
def imported_by(*modules: str) -> frozenset[str]:
    """The modules a fresh interpreter holds once it has imported `modules`: the union of what
    each loads alone, an import loading what is not loaded yet whatever came before it."""
    code = f"import sys, {', '.join(modules)}; print('\\n'.join(sys.modules))"
    return frozenset(run("-c", code).split())


def test_inference_imports_no_training_code():
    # Each inference actor imports pipeline.infer.batch: training code, torchmetrics and the
    # plotting library would only add seconds to its start-up.
    loaded = imported_by("pipeline.infer.batch")
    assert "pipeline.model.device" in loaded and "pipeline.model.runs" in loaded
    assert not {m for m in loaded if m.startswith(("pipeline.train", "torchmetrics", "matplotlib"))}


def test_serving_imports_neither_batch_inference_nor_training():
    # Wings import the core and model/, never each other: the replicas classify through
    # pipeline.model.classifier, as the batch path does.
    loaded = imported_by("pipeline.serve.app")
    assert "pipeline.model.classifier" in loaded and "pipeline.model.source" in loaded
    assert not {m for m in loaded if m.startswith(("pipeline.infer", "pipeline.train"))}


def test_inference_reads_and_writes_import_no_torch():
    # Their tasks take no CPU and run in worker processes of their own: torch would cost each
    # one seconds of start-up, taken from the CPUs the predictor actors hold.
    loaded = imported_by(
        "pipeline.infer.inputs", "pipeline.infer.predictions", "pipeline.infer.sink"
    )
    assert "ray.data" in loaded and not {m for m in loaded if m.startswith("torch")}


def test_training_driver_imports_neither_torchvision_nor_torchmetrics():
    # The workers need them; the driver only starts the workers.
    loaded = imported_by("pipeline.train.driver")
    assert not {m for m in loaded if m.startswith(("torchvision", "torchmetrics", "matplotlib"))}


def test_the_clients_import_no_onnx():
    # The chain and the job entrypoints run where the bundle's clients run; only the export
    # wing, on the cluster, loads the exporter and ONNX Runtime (and only when it exports).
    loaded = imported_by("jobs.submit") | imported_by("jobs.export", "pipeline.export.exporter")
    assert "pipeline.export.exporter" in loaded
    assert not {m for m in loaded if m.startswith(("onnx", "onnxruntime", "onnxscript"))}


def test_the_chain_imports_neither_pyarrow_nor_torch_nor_ray_data():
    # A scheduler's own environment (the Airflow example's venv) runs it with the bundle on
    # its path and only Ray's client installed beside.
    loaded = imported_by("jobs.submit")
    assert not {m for m in loaded if m.startswith(("pyarrow", "torch", "ray.data"))}


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("AWS Error NO_SUCH_BUCKET during ListObjectsV2 operation", 1),  # the user's to fix
        ("AWS Error NETWORK_CONNECTION during GetObject operation", 3),  # outlived the retries
    ],
)
def test_a_storage_error_ends_a_job_with_an_error_line_and_exit_code(error, code):
    body = f"def body(cfg):\n    raise OSError({error!r})"
    main = "job_main('', InferConfig, 'configs/infer.yaml', body, docs_page='docs/infer.md')"
    imports = "from jobs.cli import job_main\nfrom pipeline.infer.config import InferConfig"
    script = f"{imports}\n{body}\n{main}"
    args = [sys.executable, "-c", script, "model=/m", "input=/i"]
    proc = subprocess.run(args, cwd=BUNDLE_ROOT, capture_output=True, text=True)
    assert proc.returncode == code, proc.stderr
    assert f"error: storage: {error}" in proc.stderr.splitlines()


def test_a_recipe_given_as_a_second_config_file_is_read_over_the_first():
    # A value only the merged files reject: the recipe's batch split no 3 ways... named with both.
    files = ["--config", "configs/train.yaml", "--config", "configs/recipes/finetune.yaml"]
    args = [sys.executable, "-m", "jobs.train", *files, "dataset=/d", "storage_path=/s"]
    proc = subprocess.run(
        [*args, "micro_batch_size=3"], cwd=BUNDLE_ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    said = "invalid config (configs/train.yaml + configs/recipes/finetune.yaml): micro_batch_size=3"
    assert said in proc.stderr
