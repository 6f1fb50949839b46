"""What each Ray Train worker runs: restore, build the loaders, then per epoch train, evaluate
exactly over the whole val split, save and report.

The worker resumes from Ray's latest checkpoint if there is one (after a worker failure, or when
the same run is submitted again). The metrics history travels inside each checkpoint, so it is
exactly the epochs the model went through. Imported on the workers only: the driver does not
need torchvision or torchmetrics.
"""

from __future__ import annotations

import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from pipeline.core import faults
from pipeline.core.config import validate_config
from pipeline.core.logs import quiet_train_reports, setup_logging
from pipeline.core.storage import Location
from pipeline.core.tracking import EpochSink
from pipeline.data.dataset import Manifest, read_manifest
from pipeline.model.checkpoint import (
    EMA,
    CheckpointMeta,
    ModelInput,
    ModelSpec,
    load_train_state,
    load_weights,
    read_meta,
    save_checkpoint,
)
from pipeline.model.device import DevicePolicy, pick_precision
from pipeline.model.networks import batchnorm_layers, build_model, unwrap
from pipeline.model.runs import check_resumable, checkpoint_dir_name
from pipeline.train.augment import batch_mix
from pipeline.train.config import TrainConfig, is_hook
from pipeline.train.device_decode import pick_decode
from pipeline.train.ema import ModelEMA
from pipeline.train.hooks import build_loss, build_metrics
from pipeline.train.optim import build_optimizer, restore_optimizer
from pipeline.train.saving import Snapshot, publish_checkpoint
from pipeline.train.step import (
    Progress,
    StepRecipe,
    all_reduce,
    broadcast_buffers,
    evaluate,
    train_data,
    train_one_epoch,
    val_data,
)
from pipeline.train.steps import StepWriter, latest_step_checkpoint
from pipeline.train.torch_input import Augment

log = logging.getLogger(__name__)


# --- one worker's run --------------------------------------------------------------------------

NOTHING_CARRIED = {"loss_sum": 0.0, "images": 0, "seconds": 0.0}


@dataclass
class Worker:
    """What one worker holds for the whole run."""

    cfg: TrainConfig
    dataset: Location
    run_dir: Location
    manifest: Manifest
    inputs: ModelInput  # what the network takes: its size and normalisation (the driver's)
    rank: int
    world: int
    start_epoch: int = 0
    start_step: int = 0  # steps of start_epoch trained on: a resume inside the epoch
    # What those batches added up to over all ranks: loss_sum, images and seconds.
    carried: dict = field(default_factory=lambda: dict(NOTHING_CARRIED))
    history: list[dict] = field(default_factory=list)
    ema_weights: dict | None = None  # the resumed checkpoint's EMA weights, if it has them
    tracking: EpochSink | None = None  # where rank 0 logs each epoch, if the run is tracked


def train_loop_per_worker(config: dict) -> None:
    """What each Ray Train worker runs. `config`: the TrainConfig as a plain dict, the
    dataset's and the run's Locations, parsed once on the driver, and the dataset version."""
    setup_logging()
    quiet_train_reports()
    cfg = validate_config(TrainConfig, config["config"])
    dataset: Location = config["dataset"]
    ctx = ray.train.get_context()
    # The version the driver pinned, whatever was committed since: through worker restarts and
    # resizes every rank reads the same data.
    manifest = read_manifest(dataset, config["dataset_version"])
    device = ray.train.torch.get_device()
    inputs: ModelInput = config["model_input"]
    policy = DevicePolicy.for_input(device, pick_precision(cfg.precision, device), inputs)
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    w = Worker(cfg, dataset, config["run_dir"], manifest, inputs, rank, world)
    w.tracking = config.get("tracking")
    if rank == 0:
        log.info(
            "%d workers on %s, precision %s (precision=%s), %d images per worker batch",
            *(
                world,
                device.type,
                policy.precision,
                cfg.precision,
                cfg.batch_size_per_worker(world),
            ),
        )

    torch.manual_seed(cfg.seed)
    # A resumed run's weights come from its checkpoint: no need to fetch the initial ones.
    weights = None if ray.train.get_checkpoint() else cfg.model.weights
    m = cfg.model
    model = build_model(
        len(manifest.classes),
        name=m.name,
        kwargs=m.kwargs,
        weights=weights,
        bn_momentum=m.bn_momentum,
        bn_eps=m.bn_eps,
    )
    train_state = restore(w, model)
    if cfg.checkpoint.every_steps is not None:
        train_state = restore_step(w, model) or train_state
    model = ray.train.torch.prepare_model(policy.prepare(model))  # to the device, then DDP
    ema = build_ema(w, unwrap(model), train_state)
    if cfg.compile:
        # Around DDP, as PyTorch advises; checkpoints hold the bare model's state_dict (unwrap).
        model = torch.compile(model)
    # After the move: load_state_dict puts optimizer state on the parameters' device.
    optimizer, scheduler = build_optimizer(model, cfg)
    if train_state:
        restore_optimizer(optimizer, scheduler, train_state, cfg)
        if not policy.load_scaler(train_state["scaler"]) and rank == 0:
            log.info(
                "the checkpoint trained without fp16 (precision=%s picked another on its "
                "hardware): fp16 here starts with a new grad scaler",
                cfg.precision,
            )

    train_loader, val_loader = loaders(w, device)
    criterion = build_loss(cfg, manifest, device)
    mix = batch_mix(
        mixup_alpha=cfg.mixup_alpha,
        cutmix_alpha=cfg.cutmix_alpha,
        num_classes=len(manifest.classes),
    )
    if rank == 0:
        log_recipe(cfg, world)
        rows = {split: manifest.splits[split].rows for split in ("train", "val")}
        log.info(
            "training epochs %d to %d: %d train images, %d val (ingest=%s)",
            *(w.start_epoch, cfg.epochs - 1, rows["train"], rows["val"], cfg.ingest),
        )
        if cfg.ingest == "torch":
            log.info(
                "decode=%s: %s",
                cfg.decode,
                decode_where(
                    pick_decode(cfg.decode_setting(), device, manifest.image_format), device
                ),
            )

    steps = StepCheckpoints(w, device) if cfg.checkpoint.every_steps is not None else None
    epochs = EpochCheckpoints(w, steps.writer if steps is not None else None)
    if w.start_step:
        set_rng_state(train_state["rng"], device)  # as it was after that step: dropout's draws
    for epoch in range(w.start_epoch, cfg.epochs):
        start = w.start_step if epoch == w.start_epoch else 0
        carried = w.carried if start else NOTHING_CARRIED
        train_loader.set_epoch(epoch, start)
        batches = len(train_loader)
        began = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        progress = Progress(epoch, cfg.epochs, batches, every_s=cfg.log_every_s)
        progress = progress if rank == 0 else None
        if ema is not None:
            ema.following = epoch < cfg.optimizer.warmup_epochs
        recipe = StepRecipe(
            # Draws of their own per rank, epoch and step (as the loader's augmentation),
            # repeated for the same seed: the global generator is alike on every rank.
            mix=step_mix(mix, f"mix/{cfg.seed}/{epoch}/{rank}") if mix else None,
            micro_batch=cfg.micro_batch_size,
            clip_grad_norm=cfg.optimizer.clip_grad_norm,
            ema=ema,
        )

        def after_step(
            step: int,
            totals,
            epoch=epoch,
            carried=carried,
            began=began,
            batches=batches,
        ) -> None:
            steps.after_step(
                epoch,
                step,
                batches,
                so_far=lambda: epoch_so_far(totals(), carried, began, device),
                state=lambda: (
                    unwrap(model).state_dict(),
                    train_state_of(optimizer, scheduler, policy, ema),
                    ema.module.state_dict() if ema is not None else None,
                ),
            )

        t = train_one_epoch(
            model,
            train_loader,
            optimizer,
            criterion,
            policy=policy,
            progress=progress,
            recipe=recipe,
            start=start,
            after_step=after_step if steps is not None else None,
        )
        broadcast_buffers(unwrap(model))
        if ema is not None:
            broadcast_buffers(ema.module)  # each rank averaged its own BatchNorm statistics
        v = evaluate(
            unwrap(model),
            val_loader,
            policy=policy,
            num_classes=len(manifest.classes),
            ema=ema.module if ema is not None else None,
            metrics=(lambda: build_metrics(cfg, len(manifest.classes))) if cfg.metrics else None,
            classes=manifest.classes,
        )
        scheduler.step()
        loss_sum, images = all_reduce([t["loss_sum"], t["images"]], device=device)
        loss_sum, images = loss_sum + carried["loss_sum"], images + carried["images"]
        # The slowest rank's time, and the largest share of its time a rank waited for input.
        slowest, waited = all_reduce(
            [t["seconds"], t["input_wait_s"] / max(t["seconds"], 1e-9)],
            device=device,
            op=dist.ReduceOp.MAX,
        )
        slowest += carried["seconds"]
        metrics = {
            "epoch": epoch,
            "train_loss": loss_sum / max(images, 1),
            "val_loss": v["val_loss"],
            "val_accuracy": v["val_accuracy"],
            "val_images": v["val_images"],  # all of val, each once: the score is exact
            # The `metrics` (val_<name>), and the EMA's scores (ema_val_loss, ...).
            **{k: x for k, x in v.items() if k not in NOT_SCORES},
            "lr": lr,
            "images_per_s": images / slowest,  # all workers together
            "images_per_s_per_worker": t["images"] / t["seconds"],  # this rank's (rank 0's)
            "train_s": slowest,
            # Of the epoch since this attempt started it (a resume inside it: its rest).
            "input_wait_share": waited,
            "workers": w.world,  # an elastic run's count can change from epoch to epoch
            "train_images": int(images),  # over all workers, each time a row was trained
            "dataset_version": manifest.version,  # changes only where the run was told to switch
        }
        w.history.append(metrics)
        if w.rank == 0:
            warn_if_at_chance(metrics, len(manifest.classes), unwrap(model))
        train_state = train_state_of(optimizer, scheduler, policy, ema)
        ema_weights = ema.module.state_dict() if ema is not None else None
        epochs.save_and_report(metrics, unwrap(model).state_dict(), train_state, ema_weights)
    if steps is not None and steps.writer is not None:
        steps.writer.wait()  # the last one on storage (Ray waits for the epochs' uploads)


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


def train_state_of(optimizer, scheduler, policy: DevicePolicy, ema: ModelEMA | None) -> dict:
    """What a resume needs beside the weights: the optimizer's, schedule's, grad scaler's and
    EMA's state."""
    state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": policy.scaler.state_dict(),
    }
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def step_mix(mix: Callable, key: str) -> Callable:
    """`mix` as StepRecipe takes it: each step draws from a generator of its own."""
    return lambda images, labels, step: Augment(mix, f"{key}/{step}").draw(images, labels)


def epoch_so_far(totals: tuple[float, int], carried: dict, began: float, device) -> dict:
    """The epoch's loss and images so far over all ranks (a collective: every rank calls it),
    and its seconds, with what a resume carried over."""
    loss_sum, images = all_reduce(list(totals), device=device)
    return {
        "loss_sum": carried["loss_sum"] + loss_sum,
        "images": carried["images"] + int(images),
        "seconds": carried["seconds"] + time.perf_counter() - began,
    }


def rng_state(device: torch.device) -> dict:
    """The global generators' states: what dropout draws from."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class StepCheckpoints:
    """Checkpoints inside an epoch (pipeline.train.steps): every `checkpoint.every_steps` steps
    and at the first preemption notice. Rank 0 writes them; every rank takes part in summing
    the epoch so far for them, and in asking Ray for a notice."""

    def __init__(self, w: Worker, device: torch.device):
        self.w, self.device = w, device
        self.every = w.cfg.checkpoint.every_steps
        self.writer = StepWriter(w.run_dir) if w.rank == 0 else None
        self.noticed = False

    def after_step(self, epoch: int, step: int, batches: int, *, so_far, state) -> None:
        # Every rank asks after every step, the same number of times: Ray's call is a barrier.
        notice = ray.train.get_preemption_info()
        first_notice = notice is not None and not self.noticed
        self.noticed = self.noticed or notice is not None
        # At the epoch's last step its own checkpoint follows.
        if not first_notice and (step % self.every or step == batches):
            return
        totals = so_far()
        if self.writer is None:
            return
        weights, train_state, ema_weights = state()
        train_state |= {"epoch_so_far": totals, "rng": rng_state(self.device)}
        metrics = {"epoch": epoch, "step": step, "workers": self.w.world}
        meta = checkpoint_meta(self.w, metrics, step=step)
        self.writer.save(
            epoch,
            step,
            (weights, train_state, ema_weights),
            lambda d, copied: save_checkpoint(d, copied[0], meta, copied[1], ema=copied[2]),
        )
        if first_notice:
            self.writer.wait()  # on storage before the deadline
            log.warning(
                "preemption notice for ranks %s, deadline %s: saved a checkpoint at epoch %d "
                "step %d, training on until Ray stops the workers",
                *(notice.preempted_ranks, notice.deadline_ms, epoch, step),
            )
            faults.point(faults.PREEMPTION_CHECKPOINTED)
        elif faults.armed_at(faults.STEP_CHECKPOINTED):
            self.writer.wait()  # on storage before the fault test's kill
            faults.point(faults.STEP_CHECKPOINTED)


def restore_step(w: Worker, model: torch.nn.Module) -> dict | None:
    """Load the run's newest checkpoint inside an epoch into `model` and `w`, if it is newer
    than the checkpoint `restore` loaded; return its train state. Taken in another layout (an
    elastic resize; a resubmit with other loader_workers), the next step is the same: the
    epoch's order is the data's (pipeline.train.order). With another seed or global batch the
    epoch starts over from that checkpoint: its order is another."""
    # Of start_epoch only: older ones are from before the epoch checkpoint already loaded;
    # newer ones (the next epoch's, taken while this epoch's checkpoint was being uploaded,
    # which did not get into Ray's record) continue from an epoch that has no checkpoint.
    found = latest_step_checkpoint(w.run_dir, epoch=w.start_epoch)
    if found is None:
        return None
    meta = read_meta(found)
    for key in ("seed", "global_batch_size"):
        if meta.config[key] != getattr(w.cfg, key):
            if w.rank == 0:
                log.warning(
                    "the checkpoint of epoch %d step %d was taken with %s=%s, this attempt has "
                    "%s=%s: epoch %d starts over from its start (the %s orders its rows)",
                    *(meta.epoch, meta.step, key, meta.config[key], key),
                    getattr(w.cfg, key),
                    *(meta.epoch, key),
                )
            return None
    if meta.dataset_version != w.manifest.version:
        if w.rank == 0:
            log.warning(
                "the checkpoint of epoch %d step %d was taken on dataset version %s, this "
                "attempt trains on version %s (switch_dataset=true): epoch %d starts over from "
                "its start (its rows are another version's)",
                *(meta.epoch, meta.step, meta.dataset_version, w.manifest.version, meta.epoch),
            )
        return None
    check_resumable(meta, w.manifest, checkpoint=found.uri, dataset=w.dataset.uri)
    model.load_state_dict(load_weights(found))
    train_state = load_train_state(found)
    w.ema_weights = load_weights(found, meta, EMA) if meta.ema_weights else None
    w.start_step, w.carried, w.history = meta.step, train_state["epoch_so_far"], meta.history
    was = epoch_layout(meta.config, meta.metrics["workers"])
    now = epoch_layout(w.cfg.model_dump(mode="json"), w.world)
    if w.rank == 0:
        log.info(
            "resumed from checkpoint %s: epoch %d, continuing after its step %d%s",
            *(found.uri, meta.epoch, meta.step),
            f" (taken with {layout_text(was)}; now {layout_text(now)})" if was != now else "",
        )
    return train_state


def epoch_layout(config: dict, workers: int) -> dict:
    """The layout of an epoch's steps from a train config as a checkpoint records it, with
    `workers` workers: it reads and decodes them, and changes none of them."""
    return {
        "workers": workers,
        "batch": config["global_batch_size"] // workers,
        "processes": max(1, config["scaling"]["loader_workers"]),  # 0: decoding in-process
    }


def layout_text(layout: dict) -> str:
    workers, batch, processes = layout["workers"], layout["batch"], layout["processes"]
    return f"{workers} workers of {batch} images, {processes} loader processes each"


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


def build_ema(w: Worker, model: torch.nn.Module, train_state: dict | None) -> ModelEMA | None:
    """The EMA of `model` (bare, on its device) if the config keeps one: the resumed
    checkpoint's, or a new one (a fresh run, or a run that turns it on at a resume)."""
    e = w.cfg.ema
    if not e.enabled:
        return None
    ema = ModelEMA(model, decay=e.decay, every_steps=e.every_steps)
    if w.ema_weights is not None and train_state and "ema" in train_state:
        ema.load(w.ema_weights, train_state["ema"])
        if w.rank == 0:
            log.info("resumed the EMA of the weights (%d updates)", ema.updates)
    elif train_state and w.rank == 0:
        log.info("the checkpoint has no EMA of the weights: a new one starts from this epoch")
    return ema


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


def loaders(w: Worker, device: torch.device):
    """This worker's train batches (with `set_epoch`) and val batches, by `ingest`."""
    cfg, batch = w.cfg, w.cfg.batch_size_per_worker(w.world)
    if cfg.ingest == "ray_data":
        from pipeline.train.ray_data_input import ShardBatches

        rows = w.manifest.splits["train"].rows
        train = ShardBatches(
            "train", batch_size=batch, rows=rows, world=w.world, shuffle_seed=cfg.seed
        )
        return train, ShardBatches("val", batch_size=batch, rows=0, world=w.world)
    # Not through ray.train.torch.prepare_data_loader: the streams already split the data by
    # rank (it would add no sampler to an IterableDataset anyway), and train_one_epoch and
    # evaluate move each batch to the device themselves.
    shard = {"rank": w.rank, "world": w.world, "device": device}
    train = train_data(cfg, w.dataset, w.manifest, **shard)
    return train, val_data(cfg, w.dataset, w.manifest, **shard)


def restore(w: Worker, model: torch.nn.Module) -> dict | None:
    """Load Ray's latest checkpoint of this run, if any, into `model` and `w`; return the
    optimizer, schedule and scaler state to load once the model is on its device."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return None
    with checkpoint.as_directory() as d:
        local = Location.parse(d)
        meta = read_meta(local)
        check_resumable(meta, w.manifest, checkpoint=checkpoint.path, dataset=w.dataset.uri)
        model.load_state_dict(load_weights(local))
        train_state = load_train_state(local)
        if meta.ema_weights:
            w.ema_weights = load_weights(local, meta, EMA)
    w.start_epoch, w.history = meta.epoch + 1, meta.history
    if w.rank == 0:
        log.info(
            "resumed from checkpoint %s (epoch %d done): continuing at epoch %d of %d",
            *(checkpoint.path, meta.epoch, w.start_epoch, w.cfg.epochs),
        )
        before = meta.metrics.get("workers")
        if before is not None and before != w.world:
            log.info(
                "resumed with %s workers: %d, was %d; the global batch stays %d (%d per worker), "
                "so the learning rate is unchanged",
                *("fewer" if w.world < before else "more", w.world, before),
                *(w.cfg.global_batch_size, w.cfg.batch_size_per_worker(w.world)),
            )
    return train_state


def checkpoint_meta(w: Worker, metrics: dict, *, step: int | None = None) -> CheckpointMeta:
    """metadata.json of a checkpoint at the end of epoch `metrics["epoch"]`, or inside it at
    `step`."""
    return CheckpointMeta(
        model=ModelSpec(
            name=w.cfg.model.name,
            kwargs=w.cfg.model.kwargs,
            bn_momentum=w.cfg.model.bn_momentum,
            bn_eps=w.cfg.model.bn_eps,
        ),
        epoch=metrics["epoch"],
        step=step,
        classes=w.manifest.classes,
        image_size=w.manifest.image_size,
        input_size=w.inputs.image_size,
        interpolation=w.inputs.interpolation,
        mean=w.inputs.mean,
        std=w.inputs.std,
        dataset_fingerprint=w.manifest.fingerprint,
        dataset_version=w.manifest.version,
        metrics=metrics,
        history=w.history,
        config=w.cfg.model_dump(mode="json"),
    )


class EpochCheckpoints:
    """The epoch's checkpoint: every rank reports the epoch's metrics; rank 0 logs them and
    attaches the checkpoint, reported with Ray's `checkpoint_upload_mode=ASYNC`.

    The step loop only copies the state (pipeline.train.saving.Snapshot); Ray's upload thread
    runs `upload`, which serializes that copy and writes it to the run directory (whole or
    without metadata.json), and queues the checkpoint for the controller only once it returns:
    a worker killed mid-upload leaves nothing Ray records, and the next attempt resumes from
    Ray's latest checkpoint as before. Ray uploads one checkpoint at a time, in report order;
    the copy is reused, so the next epoch's waits for the upload before it (one in flight)."""

    def __init__(self, w: Worker, steps: StepWriter | None):
        self.w, self.steps = w, steps
        self.snapshot = Snapshot()
        self.uploaded = threading.Event()
        self.uploaded.set()

    def save_and_report(
        self, metrics: dict, weights: dict, train_state: dict, ema: dict | None = None
    ) -> None:
        """With `ema`, the EMA's weights, beside the raw ones."""
        w = self.w
        if w.rank != 0:
            ray.train.report(metrics)
            return
        epoch, m = metrics["epoch"], metrics
        log.info(
            "epoch %d/%d: train_loss %.4f val_loss %.4f val_accuracy %.4f%s lr %.3g %.1f "
            "images/s, %.0f%% of the time waiting for input",
            *(epoch, w.cfg.epochs - 1, m["train_loss"], m["val_loss"], m["val_accuracy"]),
            scores_text(m),
            *(m["lr"], m["images_per_s"], 100 * m["input_wait_share"]),
        )
        meta = checkpoint_meta(w, metrics)
        self.uploaded.wait()
        self.uploaded.clear()
        copied = self.snapshot.take((weights, train_state, ema))
        history = list(w.history)
        storage = ray.train.get_context().get_storage()

        def upload(_: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
            target = w.run_dir.child(name)
            publish_checkpoint(
                target, lambda d: save_checkpoint(d, copied[0], meta, copied[1], ema=copied[2])
            )
            log.info("checkpoint saved: %s", target.uri)
            faults.point(faults.CHECKPOINT_UPLOADED)
            if self.steps is not None:
                self.steps.epoch_done(epoch)
            if w.tracking is not None:
                # Once the checkpoint is on storage: with it, every epoch up to this one (those
                # an outage or a restart left out too), never one twice.
                w.tracking.log_epochs(history)
            # Only now may the copy be reused: Ray retries a failed upload (on the same copy),
            # then fails the worker, and the worker group is stopped with the loop waiting.
            self.uploaded.set()
            path = storage.build_checkpoint_path_from_name(name)
            return ray.train.Checkpoint(path, filesystem=storage.storage_filesystem)

        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp(prefix="epoch-")),
            checkpoint_dir_name=checkpoint_dir_name(epoch),
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=upload,
            delete_local_checkpoint_after_upload=True,  # the (empty) directory given here
        )
        faults.point(faults.CHECKPOINT_REPORTED)
