"""The registered model as an MLflow model of the `python_function` flavor, so that MLflow's own
tools take it: `mlflow.pyfunc.load_model`, `mlflow models serve`, `mlflow models build-docker`.

<model>/MLmodel                 the flavor, the signature (column `data`: encoded images; out:
                                the infer job's `pred`, `pred_name`, `top_k`, `top_k_prob`) and
                                the `top_k` param
<model>/artifacts/checkpoint/   the checkpoint less its optimizer state: load it as any other
<model>/code/pipeline/          this bundle's library (and a `module:function` model's package),
                                which loads and feeds the network
<model>/requirements.txt        the lock's pinned versions of what loading it imports, and all
                                they depend on
<model>/input_example.json      one image, as the scoring server takes it (base64)

The model classifies as batch inference and serving do (pipeline.model.classifier): decode,
resize + center crop to the checkpoint's image size, the network on its device policy.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from PIL import Image

from pipeline.core.storage import Location
from pipeline.model.checkpoint import CheckpointMeta
from pipeline.model.networks import check_model_code

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
    them: `pred`, `pred_name`, `top_k` (class indices, most likely first), `top_k_prob`."""

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
            allow_modules=tuple(config["allow_modules"]),
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
    mlflow.pyfunc.save_model(
        str(path),
        python_model=ImageClassifierModel(),
        artifacts={CHECKPOINT: str(checkpoint)},
        code_paths=code_paths(meta),
        model_config=MODEL_CONFIG,
        signature=signature,
        input_example=(example, {"top_k": TOP_K}),
        pip_requirements=requirements(meta),
    )


def code_paths(meta: CheckpointMeta) -> list[str]:
    """The `pipeline` package, and the top-level package (or module) of a `module:function`
    model, whatever the depth of its module: `mynets:build` with mynets/__init__.py ships
    mynets/, `pkg.sub.mod:build` ships pkg/."""
    paths = [str(PACKAGE)]
    module = meta.model.name.partition(":")[0] if ":" in meta.model.name else None
    if module and module.split(".")[0] != PACKAGE.name:
        # What the model ships is the user's own code, wherever the trainer found it (a Tune
        # trial runs in a directory of its own): never an installed package, nor the bundle.
        check_model_code(meta.model, code_root=Path("/"))
        spec = importlib.util.find_spec(module)
        # A package's spec is its __init__.py, one level below the package's own folder.
        path = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
        depth = module.count(".")
        paths.append(str(path.parents[depth - 1] if depth else path))
    return paths


def requirements(meta: CheckpointMeta) -> list[str]:
    """The lock's pins (`name==version ; marker`) of LOADS (and timm for a timm model), and of
    every package they depend on, by the lock's `# via` notes."""
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
    while more := {n for n, by in needed_by.items() if n not in needed and by & needed}:
        needed |= more
    return [line for n in sorted(needed) for line in pins[n]]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
