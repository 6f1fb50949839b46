"""The Anyscale files `make platforms` renders, the documented example's and a team's, load with
the `anyscale` package's own models (its own venv, about 320 MB, installed on first use)."""

from __future__ import annotations

from platform_values import TEAM, files, render

from pipeline.chain.plan import CONFIGS
from scripts.platforms.render import OUT


def test_anyscale_files_load_with_the_anyscale_packages_models(tmp_path):
    from harness.anyscale_venv import load as load_with_anyscale

    team = render(tmp_path, TEAM)
    models = {}
    for root in (OUT, team):
        for path in files(root / "anyscale"):
            model = (
                "JobConfig"
                if path.parent.name == "jobs"
                else "ComputeConfig"
                if path.name.startswith("compute")
                else "ServiceConfig"
                if path.name == "service.yaml"
                else "ScheduleConfig"
            )
            models[str(path)] = model
    # One wrong on purpose: the check must be able to fail.
    broken = tmp_path / "compute.yaml"
    broken.write_text(
        (OUT / "anyscale" / "compute-aws-spot.yaml").read_text().replace("PREFER_SPOT", "CHEAP")
    )
    results = load_with_anyscale({**models, str(broken): "ComputeConfig"})
    assert "CHEAP" in results.pop(str(broken))
    assert results == dict.fromkeys(models, "ok")
    # Jobs, four compute configs (AWS, GCP), a schedule and a service; the team's: GCP only.
    assert len(models) == (len(CONFIGS) + 4 + 2) + (len(CONFIGS) + 2 + 2)
