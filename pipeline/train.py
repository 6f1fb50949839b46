"""Fault-tolerant distributed training of ResNet-18 with Ray Train's TorchTrainer.

The driver (`run`) checks the config, the dataset and any run to resume before `fit()`: Ray
retries failed workers `max_failures` times, and a deterministic error would only fail again.
Each worker runs `train_loop_per_worker`: it resumes from Ray's latest checkpoint if there is
one (after a worker failure, or when the same run is submitted again), trains, evaluates exactly
over the whole val split, and reports every epoch; rank 0 attaches the checkpoint. The metrics
history travels inside each checkpoint, so it is exactly the epochs the model went through.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import posixpath
import tempfile
import time
from dataclasses import dataclass, field

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from pipeline import faults
from pipeline.cli import setup_logging
from pipeline.config import TrainConfig, validate_config
from pipeline.data import (
    BlockShuffleSampler,
    ParquetImages,
    ShardSampler,
    normalize,
    train_transform,
)
from pipeline.dataset import MANIFEST, Manifest, read_manifest
from pipeline.errors import ClusterError, InputError
from pipeline.model import (
    CheckpointMeta,
    build_model,
    load_train_state,
    load_weights,
    read_meta,
    save_checkpoint,
    unwrap,
)
from pipeline.plots import plot_curves
from pipeline.storage import Location

log = logging.getLogger(__name__)

SCORE = "val_accuracy"  # what "best checkpoint" means, for retention and for inference
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of a run's checkpoints
RUN_SUMMARY = "summary.json"  # written last: a run with it has finished
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --- one worker --------------------------------------------------------------------------------


def pick_precision(requested: str, device: torch.device) -> str:
    """fp32 on CPU; on GPU bf16 where the hardware has it, else fp16 (with a grad scaler)."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


@dataclass
class Step:
    """How a batch goes through the model on this worker: device, precision, normalisation."""

    device: torch.device
    precision: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scaler: torch.amp.GradScaler = field(init=False)

    def __post_init__(self):
        # A disabled scaler passes losses and steps through: one code path for every precision.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    @property
    def channels_last(self) -> bool:
        return self.device.type == "cuda"

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, 3, H, W) from the loader -> normalised float on the device."""
        x = normalize(images.to(self.device, non_blocking=True), mean=self.mean, std=self.std)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def autocast(self):
        dtype = AMP_DTYPES.get(self.precision, torch.float32)
        return torch.autocast(self.device.type, dtype=dtype, enabled=self.precision != "fp32")


def train_one_epoch(model, loader, optimizer, criterion, *, step: Step) -> dict:
    """One pass over this worker's shard; returns the summed loss, images and seconds."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=step.device)
    images = 0
    start = time.perf_counter()
    for batch, labels in loader:
        x, y = step.inputs(batch), labels.to(step.device, non_blocking=True)
        with step.autocast():
            loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        step.scaler.scale(loss).backward()
        step.scaler.step(optimizer)
        step.scaler.update()
        loss_sum += loss.detach().double() * len(y)
        images += len(y)
    return {"loss_sum": loss_sum.item(), "images": images, "seconds": time.perf_counter() - start}


@torch.no_grad()
def evaluate(model, loader, *, step: Step, num_classes: int) -> dict:
    """Loss and accuracy over the samples of every rank, each counted once.

    `model` must be the bare model: DDP's forward would sync buffers, and ranks may hold
    different numbers of val batches (no padding, so that the accuracy is exact)."""
    model.eval()
    accuracy = MulticlassAccuracy(num_classes, average="micro", sync_on_compute=True)
    accuracy = accuracy.to(step.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=step.device)
    count = 0
    for batch, labels in loader:
        y = labels.to(step.device, non_blocking=True)
        with step.autocast():
            logits = model(step.inputs(batch)).float()
        loss_sum += torch.nn.functional.cross_entropy(logits, y, reduction="sum").double()
        accuracy.update(logits.argmax(dim=1), y)
        count += len(y)
    total_loss, total = all_reduce([loss_sum.item(), count], device=step.device)
    return {"val_loss": total_loss / max(total, 1), SCORE: accuracy.compute().item(),
            "val_images": total}  # fmt: skip


def all_reduce(values: list[float], *, device: torch.device, op=None) -> list[float]:
    """Sum (or `op`) of `values` over all ranks; the values themselves outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats).

    DDP broadcasts them at the start of each training forward, but each rank's last forward
    then updates its own copy: without this, the ranks would evaluate slightly different
    models, none of them exactly the one rank 0 checkpoints."""
    if dist.is_available() and dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """Optimizer and a per-epoch LR schedule (linear warm-up, then cosine or constant)."""
    o = cfg.optimizer
    if o.name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                              weight_decay=o.weight_decay, nesterov=o.momentum > 0)  # fmt: skip
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    warmup, rest = o.warmup_epochs, max(cfg.epochs - o.warmup_epochs, 1)

    def factor(epoch: int) -> float:
        if epoch < warmup:
            return (epoch + 1) / (warmup + 1)
        if o.schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (epoch - warmup) / rest))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def check_resumable(meta: CheckpointMeta, manifest: Manifest, *, checkpoint: str, dataset: str):
    """A checkpoint can only continue on data with the same classes, in the same order."""
    if meta.classes != manifest.classes:
        raise InputError(
            f"checkpoint {checkpoint} was trained on {len(meta.classes)} classes "
            f"({', '.join(meta.classes[:5])}...), but dataset {dataset} has "
            f"{len(manifest.classes)} ({', '.join(manifest.classes[:5])}...). A run resumes "
            "only on the classes it started with: pick a new name= for a new run, or point "
            "dataset= at the data this run was trained on"
        )


def loader_args(cfg: TrainConfig, device: torch.device) -> dict:
    return {
        "num_workers": cfg.scaling.loader_workers,
        "persistent_workers": cfg.scaling.loader_workers > 0,
        "pin_memory": device.type == "cuda",
    }


def train_data(cfg: TrainConfig, root: Location, manifest: Manifest, *, rank: int, world: int,
               device: torch.device) -> tuple[DataLoader, BlockShuffleSampler]:  # fmt: skip
    """This worker's training loader (decode + augment in `loader_workers` processes) and its
    sampler, whose `set_epoch` reshuffles. Without Ray Train's wrapping: the benchmark's plain
    loop uses it as it is."""
    tf = train_transform(cfg.augment, image_size=manifest.image_size)
    train_set = ParquetImages(root, manifest, "train", transform=tf)
    sampler = BlockShuffleSampler(train_set, num_replicas=world, rank=rank, seed=cfg.seed)
    batch = cfg.batch_size_per_worker
    loader = DataLoader(train_set, batch_size=batch, sampler=sampler,
                        drop_last=len(sampler) > batch, **loader_args(cfg, device))  # fmt: skip
    return loader, sampler


def train_loop_per_worker(config: dict) -> None:
    """What each Ray Train worker runs; `config` is a TrainConfig as a plain dict."""
    setup_logging()  # a no-op where Ray Train has set up the worker's logging already
    cfg = validate_config(TrainConfig, config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    root = Location.parse(cfg.dataset)
    manifest = read_manifest(root)
    assert manifest is not None, "the driver checked the dataset"
    device = ray.train.torch.get_device()
    step = Step(device, pick_precision(cfg.precision, device), manifest.mean, manifest.std)
    if rank == 0:
        log.info(
            "%d workers on %s, precision %s (precision=%s), %d images per worker batch",
            world, device.type, step.precision, cfg.precision, cfg.batch_size_per_worker,
        )  # fmt: skip

    torch.manual_seed(cfg.seed)
    model = build_model(len(manifest.classes), pretrained=cfg.pretrained)
    start_epoch, history, train_state = 0, [], None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            meta = read_meta(d)
            check_resumable(meta, manifest, checkpoint=checkpoint.path, dataset=root.uri)
            model.load_state_dict(load_weights(d))
            train_state = load_train_state(d)
        start_epoch, history = meta.epoch + 1, meta.history
        if rank == 0:
            log.info("resumed from checkpoint %s (epoch %d done): continuing at epoch %d of %d",
                     checkpoint.path, meta.epoch, start_epoch, cfg.epochs)  # fmt: skip
    if step.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = ray.train.torch.prepare_model(model)  # to the device, then DDP
    # After the move: load_state_dict puts optimizer state on the parameters' device.
    optimizer, scheduler = build_optimizer(model, cfg)
    if train_state:
        optimizer.load_state_dict(train_state["optimizer"])
        scheduler.load_state_dict(train_state["scheduler"])
        step.scaler.load_state_dict(train_state["scaler"])

    loader, sampler = train_data(cfg, root, manifest, rank=rank, world=world, device=device)
    train_set, train_loader = loader.dataset, ray.train.torch.prepare_data_loader(loader)
    val_set = ParquetImages(root, manifest, "val")
    val_loader = ray.train.torch.prepare_data_loader(
        DataLoader(val_set, batch_size=cfg.batch_size_per_worker, **loader_args(cfg, device),
                   sampler=ShardSampler(len(val_set), num_replicas=world, rank=rank)),
        add_dist_sampler=False,
    )  # fmt: skip
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.optimizer.label_smoothing)

    if rank == 0:
        log.info("training epochs %d to %d: %d train images, %d val", start_epoch,
                 cfg.epochs - 1, len(train_set), len(val_set))  # fmt: skip
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]
        t = train_one_epoch(model, train_loader, optimizer, criterion, step=step)
        broadcast_buffers(unwrap(model))
        v = evaluate(unwrap(model), val_loader, step=step, num_classes=len(manifest.classes))
        scheduler.step()
        loss_sum, images = all_reduce([t["loss_sum"], t["images"]], device=device)
        [slowest] = all_reduce([t["seconds"]], device=device, op=dist.ReduceOp.MAX)
        metrics = {
            "epoch": epoch,
            "train_loss": loss_sum / max(images, 1),
            "val_loss": v["val_loss"],
            SCORE: v[SCORE],
            "lr": lr,
            "images_per_s": images / slowest,  # all workers together
            "images_per_s_per_worker": t["images"] / t["seconds"],  # this rank's (rank 0's)
            "train_s": slowest,
        }
        history.append(metrics)
        if rank != 0:
            ray.train.report(metrics)
            continue
        log.info("epoch %d/%d: train_loss %.4f val_loss %.4f val_accuracy %.4f lr %.3g "
                 "%.1f images/s", epoch, cfg.epochs - 1, metrics["train_loss"], v["val_loss"],
                 v[SCORE], lr, metrics["images_per_s"])  # fmt: skip
        meta = CheckpointMeta(
            epoch=epoch,
            classes=manifest.classes,
            image_size=manifest.image_size,
            mean=manifest.mean,
            std=manifest.std,
            dataset_fingerprint=manifest.fingerprint,
            metrics=metrics,
            history=history,
            config=cfg.model_dump(mode="json"),
        )
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "scaler": step.scaler.state_dict()}  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(d, model, meta, state)
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(d),
                checkpoint_dir_name=f"epoch_{epoch:04d}",
                checkpoint_upload_fn=faults.checkpoint_upload_fn(),
            )
        faults.point(faults.CHECKPOINT_REPORTED)


# --- the driver --------------------------------------------------------------------------------


def check_dataset(cfg: TrainConfig) -> Manifest:
    """The dataset's manifest, if the dataset is complete and usable for this config."""
    root = Location.parse(cfg.dataset)
    manifest = read_manifest(root)
    if manifest is None:
        raise InputError(
            f"no {MANIFEST} at dataset={root.uri}: it is not a complete preprocessed dataset. "
            "Run the preprocess job with output= this path first (or fix dataset=)"
        )
    train, val = manifest.splits["train"].rows, manifest.splits["val"].rows
    workers = cfg.scaling.num_workers
    if train < 2 * workers:
        raise InputError(
            f"dataset {root.uri} has {train} train images: too few for {workers} workers "
            "(each needs at least 2); preprocess more images or lower scaling.num_workers"
        )
    if val == 0:
        raise InputError(
            f"dataset {root.uri} has no val images, and checkpoints are scored on val "
            "accuracy: preprocess with val_fraction > 0"
        )
    return manifest


def in_run(run_dir: Location, checkpoint: ray.train.Checkpoint) -> Location:
    """A checkpoint of Ray's record, as a Location under the run's own URI."""
    return run_dir.child(posixpath.basename(checkpoint.path))


def best_checkpoint(run_dir: Location, result: ray.train.Result) -> tuple[Location, dict]:
    """The retained checkpoint with the best score and its metrics (Result.checkpoint is the
    latest, not the best)."""
    best, metrics = max(result.best_checkpoints, key=lambda cm: cm[1][SCORE])
    return in_run(run_dir, best), metrics


def latest_checkpoint(run_dir: Location) -> Location | None:
    """The run's latest checkpoint, if the run exists and has one."""
    if not run_dir.child(SNAPSHOT).exists():
        return None
    result = load_result(run_dir)
    return in_run(run_dir, result.checkpoint) if result.checkpoint else None


def run(cfg: TrainConfig) -> dict:
    """Train (or resume) the run `<storage_path>/<name>`; return its summary (Ray initialised)."""
    started = time.monotonic()
    manifest = check_dataset(cfg)
    run_dir = Location.parse(cfg.storage_path).child(cfg.name)
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        meta = read_meta(latest)
        check_resumable(meta, manifest, checkpoint=latest.uri, dataset=cfg.dataset)
        if meta.epoch + 1 >= cfg.epochs:
            log.info("run %s is complete (%d epochs, epochs=%d): nothing to train. Raise "
                     "epochs= to train on, or pick a new name= for a new run",
                     run_dir.uri, meta.epoch + 1, cfg.epochs)  # fmt: skip
            return write_reports(run_dir, wall_time_s=time.monotonic() - started)
        log.info("run %s has %d of %d epochs: resuming from %s",
                 run_dir.uri, meta.epoch + 1, cfg.epochs, latest.uri)  # fmt: skip
    else:
        log.info("new run %s", run_dir.uri)

    fit(cfg)
    return write_reports(run_dir, wall_time_s=time.monotonic() - started)


def fit(cfg: TrainConfig) -> None:
    from ray.train.v2._internal.constants import WORKER_GROUP_START_TIMEOUT_S_ENV_VAR
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2.api.exceptions import ControllerError

    s = cfg.scaling
    per_worker = {"CPU": s.cpus_per_worker} | ({"GPU": 1} if s.use_gpu else {})
    # Ray Train waits this long for the workers' placement group, then retries forever unless
    # controller failures are capped. Capped at max_failures: a worker group that cannot be
    # placed, or that fails to start (a node lost while its workers import torch), is retried
    # like a worker failure, and a cluster without room ends the job after max_failures + 1
    # attempts of startup_timeout_s each.
    os.environ[WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] = str(s.startup_timeout_s)
    trainer = ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg.model_dump(mode="json"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=s.num_workers, use_gpu=s.use_gpu, resources_per_worker=per_worker
        ),
        run_config=ray.train.RunConfig(
            name=cfg.name,
            storage_path=cfg.storage_path,
            failure_config=ray.train.FailureConfig(
                max_failures=cfg.max_failures, controller_failure_limit=cfg.max_failures
            ),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=cfg.num_to_keep,
                checkpoint_score_attribute=SCORE,
                checkpoint_score_order="max",
            ),
        ),
    )
    log.info("starting %d workers with %s each; waiting up to %.0f s for them (startup_timeout_s)",
             s.num_workers, per_worker, s.startup_timeout_s)  # fmt: skip
    try:
        trainer.fit()
    except ControllerError as e:
        if isinstance(e.controller_failure, WorkerGroupStartupTimeoutError):
            have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            raise ClusterError(
                f"the cluster could not place {s.num_workers} training workers with "
                f"{per_worker} each within {s.startup_timeout_s:.0f} s (startup_timeout_s), "
                f"{cfg.max_failures + 1} times (max_failures={cfg.max_failures}); it has {have} "
                "in total. Lower scaling.num_workers or "
                "scaling.cpus_per_worker, add nodes (or GPUs), or raise "
                "scaling.startup_timeout_s if the cluster is autoscaling"
            ) from None
        raise ClusterError(f"training failed: {e}") from None
    except ray.train.TrainingFailedError as e:
        raise ClusterError(
            f"training failed and max_failures={cfg.max_failures} retries are used up; "
            f"the last error: {e}"
        ) from None


# --- reports -----------------------------------------------------------------------------------


def load_result(run_dir: Location) -> ray.train.Result:
    """Ray's record of a run's checkpoints and their metrics, read from storage."""
    # Quiet: reading the record makes Ray log a notice meant for runs about to resume.
    quiet = logging.getLogger("ray.train.v2._internal.execution.checkpoint.checkpoint_manager")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        return ray.train.Result.from_path(run_dir.path, storage_filesystem=run_dir.fs)
    finally:
        quiet.setLevel(level)


def write_reports(run_dir: Location, *, wall_time_s: float) -> dict:
    """summary.json, history.csv and curves.png in the run directory; returns the summary."""
    result = load_result(run_dir)
    best, best_metrics = best_checkpoint(run_dir, result)
    latest = in_run(run_dir, result.checkpoint)
    history = read_meta(latest).history
    final = history[-1]
    summary = {
        "run": run_dir.uri,
        "best_checkpoint": best.uri,
        "best_metrics": best_metrics,
        "latest_checkpoint": latest.uri,
        "final_accuracy": final[SCORE],
        "epochs": len(history),
        "wall_time_s": wall_time_s,
        "train_time_s": sum(h["train_s"] for h in history),
        "images_per_s": sum(h["images_per_s"] for h in history) / len(history),
        "images_per_s_per_worker": sum(h["images_per_s_per_worker"] for h in history)
        / len(history),
    }
    run_dir.child(RUN_SUMMARY).write_bytes(json.dumps(summary, indent=2).encode())
    run_dir.child("history.csv").write_bytes(history_csv(history).encode())
    run_dir.child("curves.png").write_bytes(plot_curves(history, score=SCORE))
    return summary


def history_csv(history: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(history[0]))
    writer.writeheader()
    writer.writerows(history)
    return out.getvalue()
