"""What each Ray Train worker runs: build the model, its optimisation state and the loaders,
restore the run's state from its newest checkpoint if it has one, then per epoch train, evaluate
exactly over the whole val split, and save.

A run resumes from its newest checkpoint (after a worker failure, or when the same run is
submitted again): pipeline.train.checkpointer saves and restores the whole state, the metrics
history with it, so that it is exactly the epochs the model went through. Imported on the
workers only: the driver does not need torchvision or torchmetrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.core.config import validate_config
from pipeline.core.logs import quiet_train_reports, setup_logging
from pipeline.core.progress import duration_text
from pipeline.core.tracking import EpochSink
from pipeline.data.dataset import read_manifest
from pipeline.model.checkpoint import ModelInput
from pipeline.model.device import DevicePolicy, pick_precision
from pipeline.model.networks import batchnorm_layers, build_model, unwrap
from pipeline.train import stall
from pipeline.train.augment import Augment, batch_mix
from pipeline.train.checkpointer import Checkpointer
from pipeline.train.config import TrainConfig, is_hook
from pipeline.train.context import RayContext, RunContext
from pipeline.train.epoch import (
    StepRecipe,
    all_reduce,
    broadcast_buffers,
    evaluate,
    train_one_epoch,
)
from pipeline.train.hooks import build_loss, build_metrics
from pipeline.train.input.device_decode import pick_decode
from pipeline.train.input.loaders import EpochLoader, epoch_layout, train_data, val_data
from pipeline.train.optim import OptimState
from pipeline.train.progress import LoopState
from pipeline.train.run import TrainRun
from pipeline.train.state import State
from pipeline.train.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass
class Worker(TrainRun):
    """What one worker holds for the whole run: the run it trains, and its context (its rank,
    device and runner), its device policy, tracking and telemetry."""

    context: RunContext | None = None
    policy: DevicePolicy | None = None
    tracking: EpochSink | None = None  # where rank 0 logs each epoch, if the run is tracked
    telemetry: Telemetry | None = None  # what this rank tells while it runs

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world(self) -> int:
        return self.context.world

    @property
    def device(self) -> torch.device:
        return self.context.device

    @classmethod
    def start(cls, config: dict, context: RunContext) -> Worker:
        """This rank's, from the train loop's `config`: the TrainConfig as a plain dict, the
        dataset's and the run's Locations, parsed once on the driver, and the dataset version."""
        cfg = validate_config(TrainConfig, config["config"])
        # The version the driver pinned, whatever was committed since: through worker restarts
        # and resizes every rank reads the same data.
        manifest = read_manifest(config["dataset"], config["dataset_version"])
        inputs: ModelInput = config["model_input"]
        device, rank, world = context.device, context.rank, context.world
        w = cls(cfg, config["dataset"], config["run_dir"], manifest, inputs, context)
        w.policy = DevicePolicy.for_input(device, pick_precision(cfg.precision, device), inputs)
        w.tracking = config.get("tracking")
        w.telemetry = Telemetry(
            cfg,
            rank=rank,
            world=world,
            run_dir=w.run_dir,
            job_id=config.get("job_id") or "",
            gpus_per_worker=1 if cfg.scaling.use_gpu else 0,
            rows={split: manifest.splits[split].rows for split in ("train", "val")},
        )
        if rank == 0:
            log.info(
                "%d workers on %s, precision %s (precision=%s), %d images per worker batch",
                *(world, device.type, w.policy.precision, cfg.precision),
                cfg.batch_size_per_worker(world),
            )
        return w


def train_loop_per_worker(config: dict, context: RunContext | None = None) -> None:
    """What each Ray Train worker runs (`config`: see Worker.start), in Ray's run context; or
    in this process with `context` (pipeline.train.context.LocalContext)."""
    if context is None:
        setup_logging()
        quiet_train_reports()
        context = RayContext()
    w = Worker.start(config, context)
    checkpointer = Checkpointer(w, context, telemetry=w.telemetry, tracking=w.tracking)
    torch.manual_seed(w.cfg.seed)
    # A resumed run's weights come from its checkpoint: no need to fetch the initial ones.
    model = build(w, weights=None if checkpointer.resuming() else w.cfg.model.weights)
    optim = OptimState(model, w.cfg, precision=w.policy.precision, device=w.device)
    train_loader, val_loader = loaders(w)
    state = State(model, optim, LoopState(), train_loader)
    checkpointer.restore(state)
    log_start(w, state.loop.epoch)
    train_epochs(w, state, checkpointer, val_loader)
    checkpointer.close()
    w.telemetry.close("finished")


def train_epochs(w: Worker, state: State, checkpointer: Checkpointer, val_loader) -> None:
    """From the epoch `state` is at to the last: train, evaluate, save."""
    cfg, classes, telemetry, optim = w.cfg, w.manifest.classes, w.telemetry, state.optim
    criterion = build_loss(cfg, w.manifest, w.device)
    mix = batch_mix(
        mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha, num_classes=len(classes)
    )
    scores = (lambda: build_metrics(cfg, len(classes))) if cfg.metrics else None
    for epoch in range(state.loop.epoch, cfg.epochs):
        state.start_epoch(epoch)
        stall.at_epoch(epoch, state.loop.step)
        telemetry.start_epoch(state.loop)
        t = train_one_epoch(
            state.model,
            state.loader,
            optim.optimizer,
            criterion,
            policy=w.policy,
            scaler=optim.scaler,
            progress=stepped(state, telemetry),
            recipe=step_recipe(w, mix, optim, epoch),
            start=state.loop.step,
            after_step=noting_steps(checkpointer.after_step),
        )
        broadcast_buffers(unwrap(state.model))
        if optim.ema is not None:
            broadcast_buffers(optim.ema.module)  # each rank averaged its own BatchNorm statistics
        telemetry.evaluating()
        v = evaluate(
            unwrap(state.model),
            val_loader,
            policy=w.policy,
            num_classes=len(classes),
            ema=optim.ema.module if optim.ema is not None else None,
            metrics=scores,
            classes=classes,
            on_batch=telemetry.val_batch,
        )
        telemetry.evaluated()
        metrics = epoch_metrics(w, state, t, v)
        state.end_epoch(metrics)
        log_epoch(w, state, metrics)
        checkpointer.save_epoch(metrics)
        stall.progressed("checkpoint")
        stall.progressed("epoch")
        telemetry.ended_epoch(metrics)


def stepped(state: State, telemetry: Telemetry) -> Callable:
    """train_one_epoch's `progress`: the loop's position moves on, then the telemetry tells."""

    def progress(step: int, images: int, waited_s: float) -> None:
        state.loop.advance(step)
        telemetry.stepped(images, waited_s)

    return progress


def noting_steps(after_step: Callable) -> Callable:
    """`after_step`, then the step noted for the stall watch (pipeline.train.stall)."""

    def noted(step: int, totals: Callable) -> None:
        after_step(step, totals)
        stall.progressed("step")

    return noted


def build(w: Worker, *, weights: str | None) -> torch.nn.Module:
    """The network, on this rank's device in its memory layout, wrapped in DDP (and compiled
    where the config says)."""
    m = w.cfg.model
    model = build_model(
        len(w.manifest.classes),
        name=m.name,
        kwargs=m.kwargs,
        weights=weights,
        bn_momentum=m.bn_momentum,
        bn_eps=m.bn_eps,
    )
    model = w.context.prepare_model(w.policy.prepare(model))  # to the device, then DDP
    if w.cfg.compile:
        # Around DDP, as PyTorch advises; checkpoints hold the bare model's state_dict (unwrap).
        model = torch.compile(model)
    return model


def step_recipe(w: Worker, mix: Callable | None, optim: OptimState, epoch: int) -> StepRecipe:
    """What a step of `epoch` does beyond forward, backward and step."""
    cfg = w.cfg
    return StepRecipe(
        # Draws of their own per rank, epoch and step (as the loader's augmentation), repeated
        # for the same seed: the global generator is alike on every rank.
        mix=step_mix(mix, f"mix/{cfg.seed}/{epoch}/{w.rank}") if mix else None,
        micro_batch=cfg.micro_batch_size,
        clip_grad_norm=cfg.optimizer.clip_grad_norm,
        ema=optim.ema,
    )


def epoch_metrics(w: Worker, state: State, t: dict, v: dict) -> dict:
    """The epoch's metrics over all ranks (a collective: every rank calls it), with what the
    epoch's steps before this attempt added up to (a resume inside it)."""
    carried = state.loop.carried
    loss_sum, images = all_reduce([t["loss_sum"], t["images"]], device=w.device)
    loss_sum, images = loss_sum + carried["loss_sum"], images + carried["images"]
    # The slowest rank's time, and the largest share of its time a rank waited for input.
    slowest, waited = all_reduce(
        [t["seconds"], t["input_wait_s"] / max(t["seconds"], 1e-9)],
        device=w.device,
        op=dist.ReduceOp.MAX,
    )
    slowest += carried["seconds"]
    m = {
        "epoch": state.loop.epoch,
        "train_loss": loss_sum / max(images, 1),
        "val_loss": v["val_loss"],
        "val_accuracy": v["val_accuracy"],
        "val_images": v["val_images"],  # all of val, each once: the score is exact
        # The `metrics` (val_<name>), and the EMA's scores (ema_val_loss, ...).
        **{k: x for k, x in v.items() if k not in NOT_SCORES},
        "lr": state.optim.lr,
        "images_per_s": images / slowest,  # all workers together
        "images_per_s_per_worker": t["images"] / t["seconds"],  # this rank's (rank 0's)
        "train_s": slowest,
        # Of the epoch since this attempt started it (a resume inside it: its rest).
        "input_wait_share": waited,
        "workers": w.world,  # an elastic run's count can change from epoch to epoch
        "train_images": int(images),  # over all workers, each time a row was trained
        "dataset_version": w.manifest.version,  # changes only where the run was told to switch
    }
    # Its worker-hours, GPU-hours and cost: the workers' time on it, resumed parts included.
    return m | w.telemetry.end_epoch(m, carried_s=carried["seconds"])


def log_epoch(w: Worker, state: State, m: dict) -> None:
    """Rank 0's line on the epoch `m` just ended (`State.end_epoch`), with the run's ETA."""
    if w.rank != 0:
        return
    left = w.telemetry.eta_s() if m["epoch"] + 1 < w.cfg.epochs else None
    log.info(
        "epoch %d/%d: train_loss %.4f val_loss %.4f val_accuracy %.4f%s lr %.3g %.1f "
        "images/s, %.0f%% of the time waiting for input, %.3g worker-hours%s",
        *(m["epoch"], w.cfg.epochs - 1, m["train_loss"], m["val_loss"], m["val_accuracy"]),
        scores_text(m),
        *(m["lr"], m["images_per_s"], 100 * m["input_wait_share"], m["worker_hours"]),
        f", ETA {duration_text(left)}" if left is not None else "",
    )
    warn_if_at_chance(m, len(w.manifest.classes), unwrap(state.model))


# The epoch's numbers that are not scores of the val split, and those the log line shows first.
NOT_SCORES = ("val_images", "val_loss", "val_accuracy")


def scores_text(metrics: dict) -> str:
    """The epoch's other val scores for its log line: the `metrics` (val_<name>; those per
    class are in history.csv), then the EMA's."""
    scores = {
        k: v for k, v in metrics.items() if "val_" in k and "/" not in k and k not in NOT_SCORES
    }
    ordered = sorted(scores, key=lambda k: k.startswith("ema_"))
    return "".join(f" {k} {scores[k]:.4f}" for k in ordered)


def step_mix(mix: Callable, key: str) -> Callable:
    """`mix` as StepRecipe takes it: each step draws from a generator of its own."""
    return lambda images, labels, step: Augment(mix, f"{key}/{step}").draw(images, labels)


def warn_if_at_chance(metrics: dict, num_classes: int, model: torch.nn.Module) -> None:
    """A warning when val loss sits at ln(classes), a uniform guess, while train loss falls:
    how BatchNorm looks when its running statistics, which evaluation uses, have barely moved."""
    chance = math.log(num_classes)
    at_chance = abs(metrics["val_loss"] - chance) <= 0.02 * chance
    if not at_chance or metrics["train_loss"] >= 0.9 * chance:
        return
    layers = batchnorm_layers(model)  # walked only when it may be their fault
    if not layers:
        return
    slowest = min((layer.momentum for layer in layers if layer.momentum is not None), default=0)
    fix = (
        "for a short run from scratch set model.bn_momentum=0.1, PyTorch's default"
        if slowest < 0.1
        else "they follow weights that change fast early in a run: see whether the next epochs "
        "catch up"
    )
    log.warning(
        "epoch %d: val_loss %.4f is ln(%d classes), a uniform guess, while train_loss fell to "
        "%.4f: the BatchNorm layers' running statistics, which evaluation uses, may still hold "
        "their initial values (this network updates them with momentum %.3g); %s "
        "(docs/models.md)",
        *(metrics["epoch"], metrics["val_loss"], num_classes, metrics["train_loss"], slowest, fix),
    )


def log_start(w: Worker, epoch: int) -> None:
    """Rank 0's lines on what the run trains from `epoch` on, and how."""
    if w.rank != 0:
        return
    cfg, manifest = w.cfg, w.manifest
    log_recipe(cfg, w.world)
    rows = {split: manifest.splits[split].rows for split in ("train", "val")}
    log.info(
        "training epochs %d to %d: %d train images, %d val (ingest=%s)",
        *(epoch, cfg.epochs - 1, rows["train"], rows["val"], cfg.ingest),
    )
    if cfg.ingest == "torch":
        picked = pick_decode(cfg.decode_setting(), w.device, manifest.image_format)
        log.info("decode=%s: %s", cfg.decode, decode_where(picked, w.device))


def log_recipe(cfg: TrainConfig, world: int) -> None:
    """One line of what the recipe turns on, beyond the plain steps."""
    on = []
    if cfg.loss is not None:
        on.append(f"loss={cfg.loss}")
    if cfg.class_weights is not None:
        on.append(f"class_weights={cfg.class_weights}")
    if is_hook(cfg.augment):
        on.append(f"augment={cfg.augment}")
    if cfg.auto_augment != "none":
        on.append(f"auto_augment={cfg.auto_augment}")
    if cfg.mixup_alpha or cfg.cutmix_alpha:
        on.append(f"mixup_alpha={cfg.mixup_alpha} cutmix_alpha={cfg.cutmix_alpha}")
    if cfg.optimizer.label_smoothing:
        on.append(f"label_smoothing={cfg.optimizer.label_smoothing}")
    if cfg.optimizer.clip_grad_norm is not None:
        on.append(f"clip_grad_norm={cfg.optimizer.clip_grad_norm}")
    if cfg.ema.enabled:
        on.append(f"EMA decay {cfg.ema.decay} every {cfg.ema.every_steps} steps")
    if cfg.micro_batch_size is not None:
        share = cfg.batch_size_per_worker(world)
        on.append(
            f"{share // cfg.micro_batch_size} micro-batches of {cfg.micro_batch_size} per step"
        )
    if cfg.compile:
        on.append("torch.compile")
    if on:
        log.info("recipe: %s", ", ".join(on))


def decode_where(picked: str, device: torch.device) -> str:
    """Where the images are decoded and augmented, in words, for the log."""
    if picked == "cpu":
        return "images decoded and augmented in the DataLoader processes"
    return f"JPEGs decoded and augmented on {device}, the DataLoader processes only read rows"


def loaders(w: Worker) -> tuple[EpochLoader, object]:
    """This worker's train batches (with `set_epoch` and a position) and val batches, by
    `ingest`."""
    cfg, batch = w.cfg, w.cfg.batch_size_per_worker(w.world)
    if cfg.ingest == "ray_data":
        from pipeline.train.input.ray_data import ShardBatches

        rows = w.manifest.splits["train"].rows
        train = ShardBatches(
            "train", batch_size=batch, rows=rows, world=w.world, shuffle_seed=cfg.seed
        )
        val = ShardBatches("val", batch_size=batch, rows=0, world=w.world)
        return EpochLoader(train, train, layout=epoch_layout(cfg, w.world)), val
    # Not through ray.train.torch.prepare_data_loader: the streams already split the data by
    # rank (it would add no sampler to an IterableDataset anyway), and train_one_epoch and
    # evaluate move each batch to the device themselves.
    shard = {"rank": w.rank, "world": w.world, "device": w.device}
    train = train_data(cfg, w.dataset, w.manifest, **shard)
    return train, val_data(cfg, w.dataset, w.manifest, **shard)
