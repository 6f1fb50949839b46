"""The sweep's config, checked on the driver before any trial: no cluster needed."""

from __future__ import annotations

import pytest
import ray
from ray import tune

from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.storage import Location
from pipeline.tune.config import SweepConfig
from pipeline.tune.trials import _param_space, ranking, trials_at_once

BASE = ["dataset=/data/d", "storage_path=/data/runs", "name=s"]


def sweep_config(*overrides: str) -> SweepConfig:
    return load_config(SweepConfig, "configs/demo-tune.yaml", [*BASE, *overrides])


def test_the_space_becomes_tunes_domains_at_its_keys():
    cfg = sweep_config(
        "space.optimizer.weight_decay={choice: [0.0, 1.0e-4]}",
        "space.mixup_alpha={grid: [0.0, 0.2]}",
    )
    space = _param_space(cfg, "v1", Location.parse("/data/runs/s"))
    assert isinstance(space["optimizer"]["lr"], tune.search.sample.Float)  # the file's loguniform
    assert space["optimizer"]["name"] == "adamw"  # the train section's own keys stay
    assert isinstance(space["optimizer"]["weight_decay"], tune.search.sample.Categorical)
    assert space["mixup_alpha"] == {"grid_search": [0.0, 0.2]}
    assert space["dataset_version"] == "v1" and space["storage_path"] == "/data/runs/s"
    # Ranked as the train job ranks checkpoints; `last` by its weights' val loss.
    assert ranking(cfg.score) == ("val_loss", "min")
    assert ranking(sweep_config("train.checkpoint.metric=last").score) == ("val_loss", "min")
    assert ranking(sweep_config("train.checkpoint.metric=val_accuracy").score) == (
        "val_accuracy",
        "max",
    )


def test_values_refused_only_together_are_found_before_any_trial():
    # Each value alone fits the demo's train config; 3 images do not split over 2 workers.
    with pytest.raises(ConfigError) as e:
        sweep_config(
            "space.scaling.num_workers={choice: [1, 2]}",
            "space.global_batch_size={choice: [32, 3]}",
        )
    assert "space values scaling.num_workers=2, global_batch_size=3, " in str(e.value)
    assert "together: a trial's train config is refused: global_batch_size=3" in str(e.value)


def test_a_range_over_an_int_key_is_refused_with_what_to_use():
    with pytest.raises(ConfigError) as e:
        sweep_config("space.train.epochs={uniform: [1, 4]}")
    assert "space.train.epochs: unknown key" in str(e.value)
    with pytest.raises(ConfigError) as e:
        sweep_config("space.epochs={uniform: [1, 4]}")
    assert (
        "space.epochs=1.0: a trial's train config is refused: epochs: Input should be a valid "
        "integer" in str(e.value)
    )
    assert "for an int, choice or grid" in str(e.value)


def test_trials_at_once_divides_the_cluster_by_the_largest_trial(monkeypatch, caplog):
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    cfg = sweep_config("space.scaling.cpus_per_worker={grid: [1, 3]}")
    assert trials_at_once(cfg, cfg.trial_configs()) == 2  # 8 CPUs // 3
    gpus = sweep_config("train.scaling.use_gpu=true")
    assert trials_at_once(gpus, gpus.trial_configs()) == 2  # 2 GPUs // 1
    assert trials_at_once(sweep_config("max_concurrent_trials=5"), []) == 5  # asked: as asked
    # A trial larger than the cluster: one at a time, each waiting for room, and said so.
    big = sweep_config("space.scaling.cpus_per_worker={grid: [1, 9]}")
    assert trials_at_once(big, big.trial_configs()) == 1
    assert "a trial asks 9 CPUs, more than the cluster has: trials run one at a time" in caplog.text
