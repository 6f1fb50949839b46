"""The registered model as an MLflow model of the `python_function` flavor, so that MLflow's own
tools take it: `mlflow.pyfunc.load_model`, `mlflow models serve`, `mlflow models build-docker`.

<model>/MLmodel                 the flavor, the signature (column `data`: encoded images; out:
                                the infer job's `pred`, `pred_name`, `top_k`, `top_k_prob`) and
                                the `top_k` param
<model>/artifacts/checkpoint/   the checkpoint less its optimizer state: load it as any other
<model>/code/pipeline/          this bundle's library (and a `module:function` model's package),
                                which loads and feeds the network
<model>/requirements.txt        the lock's pinned versions of what loading it imports, and all
                                they depend on; a network installed here: its distribution
<model>/input_example.json      one image, as the scoring server takes it (base64)

The model classifies as batch inference and serving do (pipeline.model.classifier): decode,
resize + center crop to the checkpoint's image size, the network on its device policy.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from PIL import Image

from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location
from pipeline.model.checkpoint import CheckpointMeta
from pipeline.model.trust import BUNDLE_PACKAGES, check_model_code

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"  # the artifact's name, and its directory's: MLflow keeps the latter
CHECKPOINT_PATH = f"artifacts/{CHECKPOINT}"  # where it lies in the model
IMAGES = "data"  # the input column of encoded image files, as the infer job's input rows name it
TOP_K = 5  # classes per image unless the `top_k` param says otherwise: the infer job's default
BATCH = 64  # images through the network at a time
PACKAGE = Path(__file__).resolve().parents[1]  # the `pipeline` package, shipped as code
LOCK = PACKAGE.parent / "requirements" / "cluster.lock"
# The distributions that loading the model imports; their dependencies come with them.
LOADS = ["mlflow-skinny", "torch", "torchvision", "numpy", "pillow", "pandas", "pyarrow"]
LOADS += ["pydantic", "pyyaml"]
# How the caller may load it: mlflow.pyfunc.load_model(uri, model_config={...}).
# use_gpu None: a GPU where torch has one. allow_modules: as the jobs' key (docs/models.md); a
# module:function model's module ships in the model's code/, which needs none.
# Saved with the model: MLflow passes a caller's model_config on only for keys the model has.
MODEL_CONFIG = {"use_gpu": None, "precision": "auto", "allow_modules": []}


class ImageClassifierModel(mlflow.pyfunc.PythonModel):
    """Encoded images (bytes) in, each one's most likely classes out, as the infer job writes
    them: `pred`, `pred_name`, `top_k` (class indices, most likely first), `top_k_prob`.
    `network_modules`: the installed module of a `module:function` network, which the model
    names in its requirements rather than ship; pickled with the model, it allows that module as
    the caller's `allow_modules` would (the train job that logged the model was set to it)."""

    def __init__(self, network_modules: Sequence[str] = ()):
        self.network_modules = tuple(network_modules)

    def load_context(self, context) -> None:
        from pipeline.model.classifier import Classifier

        config = MODEL_CONFIG | (context.model_config or {})
        if unknown := config.keys() - MODEL_CONFIG.keys():
            raise ValueError(
                f"model_config keys {sorted(unknown)} are not this model's: it takes "
                f"{sorted(MODEL_CONFIG)}"
            )
        use_gpu = torch.cuda.is_available() if config["use_gpu"] is None else config["use_gpu"]
        checkpoint = Location.parse(context.artifacts[CHECKPOINT])
        self.classifier = Classifier(
            checkpoint,
            use_gpu=use_gpu,
            precision=config["precision"],
            # A model pickled before network_modules was an attribute has none.
            allow_modules=(*config["allow_modules"], *getattr(self, "network_modules", ())),
            # <model>/artifacts/checkpoint -> <model>/code: what the model ships, and nothing
            # of the directory it is loaded from.
            code_root=Path(checkpoint.path).parents[1] / "code",
        )
        self.classes = self.classifier.meta.classes
        log.info(
            "classifying with %s on %s (%s)",
            checkpoint.uri,
            "GPU" if use_gpu else "CPU",
            self.classifier.precision,
        )

    def predict(
        self, context, model_input: pd.DataFrame, params: dict | None = None
    ) -> pd.DataFrame:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

        from pipeline.data.images import BadImageError
        from pipeline.model.classifier import prepare_image

        k = int((params or {}).get("top_k", TOP_K))
        if k < 1:
            raise MlflowException(
                f"params top_k={k}: give 1 or more", error_code=INVALID_PARAMETER_VALUE
            )
        size = self.classifier.meta.image_size
        pixels = np.zeros((len(model_input), 3, size, size), dtype=np.uint8)
        for i, data in enumerate(model_input[IMAGES]):
            try:
                pixels[i] = prepare_image(data, image_size=size)
            except BadImageError as e:
                raise MlflowException(
                    f"row {i} of column {IMAGES!r}: {e}; send each image file's bytes "
                    "(base64 in JSON)",
                    error_code=INVALID_PARAMETER_VALUE,
                ) from None
        probs = torch.zeros(0, len(self.classes))
        if len(pixels):
            batches = range(0, len(pixels), BATCH)
            probs = torch.cat(
                [self.classifier.probabilities(pixels[i : i + BATCH]) for i in batches]
            )
        values, indices = probs.topk(min(k, len(self.classes)), dim=1)
        pred = indices[:, 0].numpy()
        return pd.DataFrame(
            {
                "pred": pred,
                "pred_name": [self.classes[i] for i in pred],
                "top_k": list(indices.numpy()),
                "top_k_prob": list(values.numpy()),
            }
        )


def save(checkpoint: Path, path: Path, meta: CheckpointMeta) -> None:
    """Save the checkpoint in the local directory `checkpoint` (named CHECKPOINT) as an MLflow
    model at `path`."""
    assert checkpoint.name == CHECKPOINT, checkpoint
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, DataType, ParamSchema, ParamSpec, Schema

    from pipeline.data.images import encode_image

    signature = ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, IMAGES)]),
        outputs=Schema(
            [
                ColSpec(DataType.long, "pred"),
                ColSpec(DataType.string, "pred_name"),
                ColSpec(Array(DataType.long), "top_k"),
                ColSpec(Array(DataType.float), "top_k_prob"),
            ]
        ),
        params=ParamSchema([ParamSpec("top_k", DataType.long, TOP_K)]),
    )
    gray = Image.new("RGB", (meta.image_size, meta.image_size), (128, 128, 128))
    example = pd.DataFrame({IMAGES: [encode_image(gray, image_format="png")]})
    network = network_code(meta)
    mlflow.pyfunc.save_model(
        str(path),
        python_model=ImageClassifierModel(network.modules),
        artifacts={CHECKPOINT: str(checkpoint)},
        code_paths=[str(PACKAGE), *network.paths],
        model_config=MODEL_CONFIG,
        signature=signature,
        input_example=(example, {"top_k": TOP_K}),
        pip_requirements=requirements(meta, network.distributions),
    )


@dataclass(frozen=True)
class NetworkCode:
    """How the model carries a `module:function` network: its top-level package in code/ (the
    user's own files), or, for a module installed in this environment, the distribution that
    holds it as a requirement and the module allowed (`network_modules`)."""

    paths: tuple[str, ...] = ()
    distributions: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()


def network_code(meta: CheckpointMeta) -> NetworkCode:
    """What the model needs of its network's module beside the bundle's `pipeline`: none for
    torchvision, timm or the bundle's library; the top-level package of the user's own module,
    whatever its depth (`mynets:build` with mynets/__init__.py ships mynets/, `pkg.sub.mod:build`
    ships pkg/); the distribution of an installed one (a package in the nodes' image)."""
    module = meta.model.name.partition(":")[0] if ":" in meta.model.name else None
    if module is None or module.split(".")[0] == PACKAGE.name:
        return NetworkCode()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"model.name={meta.model.name!r}: module {module} does not import here, so the MLflow "
            "model cannot carry it: submit the run again with its package (--py-module, or "
            "installed on the nodes) to log and register the model"
        )
    try:
        # The user's own code, wherever the trainer found it (a Tune trial runs in a directory
        # of its own): shipped as it is.
        check_model_code(meta.model, code_root=Path("/"))
        installed = False
    except ConfigError:
        installed = module.split(".")[0] not in BUNDLE_PACKAGES
    if installed:
        top = module.split(".")[0]
        found = tuple(importlib.metadata.packages_distributions().get(top, ()))
        if not found:
            log.warning(
                "module %s of model %s belongs to no installed distribution: the MLflow model "
                "loads where it is importable",
                *(module, meta.model.name),
            )
        return NetworkCode(distributions=found, modules=(module,))
    # A package's spec is its __init__.py, one level below the package's own folder.
    path = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
    depth = module.count(".")
    shipped = str(path.parents[depth - 1] if depth else path)
    # The bundle's jobs/ or scripts/: shipped, and allowed, which loading requires of them.
    modules = (module,) if module.split(".")[0] in BUNDLE_PACKAGES else ()
    return NetworkCode(paths=(shipped,), modules=modules)


def requirements(meta: CheckpointMeta, distributions: Sequence[str] = ()) -> list[str]:
    """The lock's pins (`name==version ; marker`) of LOADS (and timm for a timm model, and the
    installed `distributions` of a network's module), and of every package they depend on, by
    the lock's `# via` notes; a distribution the lock lacks, at its installed version."""
    pins: dict[str, list[str]] = {}
    needed_by: dict[str, set[str]] = {}
    name = None
    for line in LOCK.read_text().splitlines():
        if pin := re.match(r"([A-Za-z0-9][\w.-]*)==[^\\]+", line):
            name = canonical(pin[1])
            pins.setdefault(name, []).append(pin[0].strip())
        elif name and (via := re.match(r"\s+#\s+(?:via\s+)?(?!via$)([A-Za-z0-9][\w.-]*)$", line)):
            needed_by.setdefault(name, set()).add(canonical(via[1]))
    needed = {canonical(n) for n in LOADS}
    if meta.model.name.startswith("timm/"):
        needed.add("timm")
    extra = sorted({canonical(d) for d in distributions} - pins.keys())
    needed |= {canonical(d) for d in distributions} & pins.keys()
    while more := {n for n, by in needed_by.items() if n not in needed and by & needed}:
        needed |= more
    lines = [line for n in sorted(needed) for line in pins[n]]
    return lines + [f"{n}=={importlib.metadata.version(n)}" for n in extra]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
