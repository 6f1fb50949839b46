"""The Grafana dashboard of the jobs' metrics (docs/metrics.md), built with Grafana Labs'
grafana-foundation-sdk: it sits beside the dashboards Ray writes for its own metrics, on a
Prometheus picked by the same `datasource` variable, filtered by run, output and job."""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from pipeline.core import metrics
from pipeline.core.metrics import exported

PATH = "grafana/ray-cv.json"  # under platforms/
UID = "rayCvDashboard"  # beside Ray's own: rayDefaultDashboard, rayTrainDashboard, ...
# The metrics the jobs publish through Ray's metrics agent, as Prometheus names them (all
# gauges), with their labels: pipeline/core/metrics.py's.
METRICS = {
    exported(m): (*labels, *m.labels)
    for group, labels in (
        (metrics.TRAIN, metrics.TRAIN_LABELS),
        (metrics.INFER, metrics.INFER_LABELS),
    )
    for m in group
}
DATASOURCE = common.DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run=~"$run", job_id=~"$job_id"'
OUTPUT = 'output=~"$output", job_id=~"$job_id"'


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend)


def train(name: str, by: str = "run") -> str:
    """`name`'s value per `by` of the runs and jobs picked."""
    assert name in METRICS, name
    return f"max by ({by}) ({name}{{{RUN}}})"


def infer(name: str) -> str:
    assert name in METRICS, name
    return f"max by (output) ({name}{{{OUTPUT}}})"


def targets(panel, queries: tuple[prometheus.Dataquery, ...]):
    for i, q in enumerate(queries):
        panel = panel.with_target(q.ref_id(chr(ord("A") + i)))
    return panel


def graph(title: str, about: str, unit: str, *queries: prometheus.Dataquery, w: int = 12):
    panel = (
        timeseries.Panel()
        .title(title)
        .description(about)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .height(8)
        .span(w)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    return targets(panel, queries)


def number(title: str, about: str, unit: str, *queries: prometheus.Dataquery, w: int = 6):
    panel = (
        stat.Panel()
        .title(title)
        .description(about)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(5)
        .span(w)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
    )
    return targets(panel, queries)


def variable(name: str, label: str, definition: str) -> dashboard.QueryVariable:
    """A label's values, any number of them, all by default (as Ray's dashboards filter)."""
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(definition)
        .definition(definition)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def training_panels() -> list:
    return [
        number(
            "Progress",
            "Share of the run's steps done, of all its epochs",
            "percentunit",
            query(train("ray_cv_train_progress"), "{{run}}"),
        ),
        number(
            "Time left",
            "Seconds the run has left, at its recent pace",
            "s",
            query(train("ray_cv_train_eta_seconds"), "{{run}}"),
        ),
        number(
            "Epoch",
            "The epoch in progress (counted from 1) of the run's epochs",
            "none",
            query(f"{train('ray_cv_train_epoch')} + 1", "{{run}} epoch"),
            query(train("ray_cv_train_epochs"), "{{run}} of"),
        ),
        number(
            "Step",
            "Steps done of the epoch in progress, of its steps",
            "none",
            query(train("ray_cv_train_step"), "{{run}} step"),
            query(train("ray_cv_train_steps"), "{{run}} of"),
        ),
        graph(
            "Images/s",
            "The run's images per second: its ranks' together, over their recent steps",
            "none",
            query(
                f"sum by (run) (ray_cv_train_images_per_second{{{RUN}}})",
                "{{run}}",
            ),
        ),
        graph(
            "Input wait",
            "Share of the step loop's time spent waiting for input, its slowest rank: "
            "near 1, the loader starves the GPUs",
            "percentunit",
            query(train("ray_cv_train_input_wait_share"), "{{run}}"),
        ),
        graph(
            "Step time",
            "Median step time of each rank, its recent steps: one rank above the rest "
            "holds the others up",
            "s",
            query(train("ray_cv_train_step_seconds", "run, rank"), "{{run}} rank {{rank}}"),
        ),
        graph(
            "Checkpoints",
            "The last checkpoint's time: holding the training loop, and writing to storage",
            "s",
            query(
                train("ray_cv_train_checkpoint_hold_seconds", "run, kind"),
                "{{run}} {{kind}} hold",
            ),
            query(
                train("ray_cv_train_checkpoint_upload_seconds", "run, kind"),
                "{{run}} {{kind}} upload",
            ),
        ),
        graph(
            "Validation, per epoch",
            "The last finished epoch's val scores: val_loss, val_accuracy and each "
            "configured metric",
            "none",
            query(train("ray_cv_train_val", "run, metric"), "{{run}} {{metric}}"),
        ).line_interpolation(common.LineInterpolation.STEP_AFTER),
        graph(
            "Spend",
            "The run's worker-hours, GPU-hours and cost so far",
            "none",
            query(train("ray_cv_train_worker_hours"), "{{run}} worker-hours"),
            query(train("ray_cv_train_gpu_hours"), "{{run}} GPU-hours"),
            query(train("ray_cv_train_cost"), "{{run}} cost"),
        ),
    ]


def inference_panels() -> list:
    return [
        number(
            "Progress",
            "Share of the input's images classified",
            "percentunit",
            query(infer("ray_cv_infer_progress"), "{{output}}"),
        ),
        number(
            "Images",
            "Images classified, of the input's",
            "none",
            query(infer("ray_cv_infer_images_done"), "{{output}} done"),
            query(infer("ray_cv_infer_images"), "{{output}} of"),
        ),
        number(
            "Time left",
            "Seconds the output has left, at its recent pace",
            "s",
            query(infer("ray_cv_infer_eta_seconds"), "{{output}}"),
            w=12,
        ),
        graph(
            "Images/s",
            "Images classified per second, the last minute",
            "none",
            query(infer("ray_cv_infer_images_per_second"), "{{output}}"),
            w=24,
        ),
    ]


def build() -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard("ray-cv: training and inference")
        .uid(UID)
        .description("The jobs' own metrics (docs/metrics.md), beside Ray's dashboards")
        .tags(["ray-cv"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("30s")
        .with_variable(
            # Ray's dashboards pick their Prometheus by this variable: the same one here.
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(variable("run", "Run", "label_values(ray_cv_train_progress, run)"))
        .with_variable(variable("output", "Output", "label_values(ray_cv_infer_progress, output)"))
        .with_variable(
            variable(
                "job_id",
                "Job",
                'label_values({__name__=~"ray_cv_train_progress|ray_cv_infer_progress"}, job_id)',
            )
        )
        .with_row(dashboard.Row("Training"))
    )
    for panel in training_panels():
        board = board.with_panel(panel)
    board = board.with_row(dashboard.Row("Inference"))
    for panel in inference_panels():
        board = board.with_panel(panel)
    return board


def text() -> str:
    """The dashboard's JSON, for Grafana's import (or its provisioning's folder)."""
    built = build().build()
    for i, panel in enumerate(built.panels, start=1):
        panel.id_val = i  # stable ids: the same file from the same code
    return json.dumps(built, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def files() -> dict[str, str]:
    return {PATH: text()}
