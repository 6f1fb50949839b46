import re

import pytest

from harness.cluster import BUNDLE_ROOT
from pipeline.core.config import describe_keys, dump_config, keys_help, load_config, validate_config
from pipeline.core.errors import ConfigError
from pipeline.data.config import FOOD101_LITE_CLASSES, PreprocessConfig
from pipeline.infer.config import InferConfig
from pipeline.train.config import TrainConfig


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_are_food101_lite():
    cfg = load_config(PreprocessConfig, overrides=["output=/tmp/x"])
    assert cfg.source.kind == "huggingface"
    assert cfg.source.huggingface.classes == FOOD101_LITE_CLASSES
    assert cfg.image_size == 224


def test_precedence_defaults_yaml_cli(tmp_path):
    path = write(tmp_path, "output: /a\nimage_size: 128\nsource: {kind: synthetic}\n")
    cfg = load_config(PreprocessConfig, path, ["image_size=64", "source.synthetic.seed=7"])
    assert (cfg.output, cfg.image_size, cfg.source.kind) == ("/a", 64, "synthetic")
    assert cfg.source.synthetic.seed == 7
    assert cfg.row_group_size == 128  # untouched default


def test_list_override_parses_as_yaml(tmp_path):
    cfg = load_config(
        PreprocessConfig, overrides=["output=/o", "source.huggingface.classes=[a, b]"]
    )
    assert cfg.source.huggingface.classes == ("a", "b")


def test_unknown_key_names_key_and_allowed(tmp_path):
    path = write(tmp_path, "output: /a\nsource:\n  synthetic: {colour: red}\n")
    with pytest.raises(ConfigError) as e:
        load_config(PreprocessConfig, path)
    msg = str(e.value)
    assert "source.synthetic.colour: unknown key" in msg
    assert "num_classes" in msg and str(path) in msg


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"image_size: .*integer.*got 'big'"):
        load_config(PreprocessConfig, overrides=["output=/o", "image_size=big"])
    with pytest.raises(ConfigError, match="overwrite"):
        load_config(PreprocessConfig, overrides=["output=/o", "overwrite=3"])


def test_choice_error_lists_choices():
    with pytest.raises(ConfigError, match=r"source.kind: .*'synthetic', 'folder' or 'huggingface'"):
        load_config(PreprocessConfig, overrides=["output=/o", "source.kind=s3"])


def test_missing_required_and_bad_override():
    with pytest.raises(ConfigError, match="output: required"):
        load_config(PreprocessConfig)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(PreprocessConfig, overrides=["image_size"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(PreprocessConfig, overrides=["output=/o", "output.x=1"])


def test_range_and_cross_field_checks():
    with pytest.raises(ConfigError, match="val_fraction"):
        load_config(PreprocessConfig, overrides=["output=/o", "val_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"source\.folder\.path is not set"):
        load_config(PreprocessConfig, overrides=["output=/o", "source.kind=folder"])
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(PreprocessConfig, overrides=["output=/o", "source.huggingface.classes=[a, a]"])


def test_values_that_would_crash_in_a_worker_are_refused_up_front():
    train = ["dataset=/d", "storage_path=/s"]
    # Ray Data's shuffle takes seeds of 0 or more: a negative one crashed every worker.
    with pytest.raises(ConfigError, match=r"seed: .*greater than or equal to 0"):
        load_config(TrainConfig, overrides=[*train, "seed=-1", "ingest=ray_data"])
    # BatchNorm fails on one image per worker ("Expected more than 1 value per channel").
    with pytest.raises(ConfigError, match=r"fewer than 2 images per step with 2 workers"):
        load_config(TrainConfig, overrides=[*train, "global_batch_size=2"])
    with pytest.raises(ConfigError, match=r"with 4 workers: use at least 8"):
        load_config(TrainConfig, overrides=[*train, "scaling.num_workers=4", "global_batch_size=4"])
    load_config(TrainConfig, overrides=[*train, "global_batch_size=4"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PreprocessConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(PreprocessConfig, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(PreprocessConfig, write(tmp_path, "a: [\n"))


def test_dump_round_trip_and_plain_dict(tmp_path):
    cfg = load_config(PreprocessConfig, overrides=["output=/o", "source.kind=synthetic"])
    again = load_config(PreprocessConfig, write(tmp_path, dump_config(cfg)))
    assert again == cfg
    # What workers receive: a plain dict, rebuilt into the same config.
    assert validate_config(PreprocessConfig, cfg.model_dump(mode="json")) == cfg


def test_fingerprint_ignores_overwrite_only():
    a = load_config(PreprocessConfig, overrides=["output=/o"])
    assert (
        a.fingerprint()
        == load_config(PreprocessConfig, overrides=["output=/o", "overwrite=true"]).fingerprint()
    )
    assert (
        a.fingerprint()
        != load_config(PreprocessConfig, overrides=["output=/o", "image_size=64"]).fingerprint()
    )


def test_shipped_configs_load():
    load_config(PreprocessConfig, BUNDLE_ROOT / "configs/preprocess.yaml")
    demo = load_config(
        PreprocessConfig, BUNDLE_ROOT / "configs/demo-preprocess.yaml", ["output=/o"]
    )
    assert demo.source.kind == "synthetic"


@pytest.mark.parametrize("key", ["output", "source.folder.path"])
def test_relative_paths_are_refused(key):
    with pytest.raises(ConfigError, match=rf"{key}: .*'data/x' is relative; use an absolute path"):
        load_config(
            PreprocessConfig,
            overrides=[
                "output=/o",
                "source.kind=folder",
                "source.folder.path=/in",
                f"{key}=data/x",
            ],
        )
    cfg = load_config(PreprocessConfig, overrides=["output=s3://b/x?endpoint_override=h:1"])
    assert cfg.output.startswith("s3://")


def test_numbers_as_people_write_them(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-3 and 1.0e3 as strings; in overrides and files they are floats.
    overrides = ["dataset=/d", "storage_path=/s"]
    cfg = load_config(TrainConfig, None, [*overrides, "optimizer.lr=1e-3", "log_every_s=1.5E1"])
    assert (cfg.optimizer.lr, cfg.log_every_s) == (0.001, 15.0)
    path = write(tmp_path, "optimizer: {lr: 2e-4, weight_decay: 1.0e-5}\nepochs: 3\n")
    cfg = load_config(TrainConfig, path, overrides)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.epochs) == (2e-4, 1e-5, 3)
    assert load_config(TrainConfig, None, [*overrides, "optimizer.lr=1"]).optimizer.lr == 1.0
    # What only looks like a number stays a string, and a string where a number goes fails.
    assert load_config(TrainConfig, None, [*overrides, "name=e5"]).name == "e5"
    with pytest.raises(ConfigError, match=r"optimizer.lr: .*got 'e-3'"):
        load_config(TrainConfig, None, [*overrides, "optimizer.lr=e-3"])


@pytest.mark.parametrize("cls", [PreprocessConfig, TrainConfig, InferConfig])
def test_every_key_is_described(cls):
    keys = describe_keys(cls)
    assert all(description for *_, description in keys), "every field needs a description"
    text = keys_help(cls)
    for key, kind, default, _ in keys:
        assert f"  {key} ({kind}, default {default})" in text


def test_keys_are_flattened_with_types_and_defaults():
    keys = {key: (kind, default) for key, kind, default, _ in describe_keys(TrainConfig)}
    assert keys["dataset"] == ("str", "required")
    assert keys["optimizer.lr"] == ("float", "0.1")
    assert keys["scaling.num_workers"] == ("int or list of int", "2")
    assert keys["precision"] == ("auto|fp32|bf16|fp16", "auto")
    assert keys["model.name"] == ("str", "resnet18")
    assert keys["model.weights"] == ("str or null", "null")
    assert keys["model.kwargs"] == ("dict", "{}")
    assert keys["model.input.image_size"] == ("int or null", "null")
    assert keys["model.input.interpolation"] == ("bilinear|bicubic or null", "null")
    assert keys["model.input.mean"] == ("list of float or null", "null")


def test_a_later_config_file_overrides_an_earlier_one_key_by_key(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(
        "dataset: /d\nstorage_path: /s\nepochs: 5\noptimizer: {lr: 0.1, momentum: 0.8}\n"
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("optimizer: {lr: 0.01}\nema: {enabled: true}\nmixup_alpha: 0.2\n")
    cfg = load_config(TrainConfig, [base, recipe], ["epochs=7"])
    assert (cfg.optimizer.lr, cfg.optimizer.momentum) == (0.01, 0.8)  # merged, not replaced
    assert (cfg.ema.enabled, cfg.mixup_alpha, cfg.epochs) == (True, 0.2, 7)
    assert load_config(TrainConfig, [recipe, base]).optimizer.lr == 0.1  # the later one wins
    with pytest.raises(ConfigError, match=rf"invalid config \({base} \+ {recipe}\): mixup_alpha"):
        load_config(TrainConfig, [base, recipe], ["mixup_alpha=-1"])


@pytest.mark.parametrize("recipe", ["finetune", "scratch"])
def test_shipped_recipes_load_over_the_shipped_train_configs(recipe):
    path = BUNDLE_ROOT / "configs" / "recipes" / f"{recipe}.yaml"
    assert path.read_text().startswith("# ")  # what it is and where it comes from
    for base in ("train.yaml", "demo-train.yaml"):
        files = [BUNDLE_ROOT / "configs" / base, path]
        cfg = load_config(TrainConfig, files, ["dataset=/d", "storage_path=/s"])
        assert cfg.ema.enabled and cfg.auto_augment == "trivial_augment_wide"
        assert (
            cfg.name == load_config(TrainConfig, files[:1], ["dataset=/d", "storage_path=/s"]).name
        )


def test_recipe_keys_default_to_plain_training():
    cfg = load_config(TrainConfig, None, ["dataset=/d", "storage_path=/s"])
    assert (cfg.auto_augment, cfg.mixup_alpha, cfg.cutmix_alpha) == ("none", 0, 0)
    assert (cfg.ema.enabled, cfg.micro_batch_size, cfg.compile) == (False, None, False)
    assert (cfg.optimizer.label_smoothing, cfg.optimizer.clip_grad_norm) == (0, None)
    for bad, said in [
        (
            "auto_augment=autoaugment",
            "auto_augment: Input should be 'none', 'trivial_augment_wide'",
        ),
        ("ema.decay=1", "ema.decay: Input should be less than 1"),
        ("ema.every_steps=0", "ema.every_steps: Input should be greater than or equal to 1"),
        ("optimizer.clip_grad_norm=0", "optimizer.clip_grad_norm: Input should be greater than 0"),
        ("cutmix_alpha=-1", "cutmix_alpha: Input should be greater than or equal to 0"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_config(TrainConfig, None, ["dataset=/d", "storage_path=/s", bad])


def test_every_checkpoint_metric_has_its_ranking():
    # The config's choices and the rankings the train, infer, serve and export jobs apply.
    from pipeline.model.checkpoint import SCORES
    from pipeline.train.config import FIXED_SCORES

    assert set(FIXED_SCORES) == set(SCORES)  # beside them, val_<name> of a `metrics` entry
    cfg = load_config(
        TrainConfig, overrides=["dataset=/d", "storage_path=/r", "checkpoint.metric=last"]
    )
    assert (cfg.checkpoint.metric, cfg.checkpoint.num_to_keep) == ("last", 2)
    assert (
        load_config(TrainConfig, BUNDLE_ROOT / "configs/train.yaml").checkpoint.metric == "val_loss"
    )
