"""Your own `train_loop_per_worker`, as Ray's tutorial writes it, writing a run of the bundle's
format (pipeline.train.api, docs/own-loop.md): the chain's infer and export steps, Serve and the
registry take it as one of the train job's.

    ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml \
        -- python -m examples.own_loop.train --dataset /mnt/cluster_storage/ray-cv/dataset \
           --storage-path /mnt/cluster_storage/ray-cv/runs --name own-loop --epochs 5
    python -m jobs.submit --address ... --root /mnt/cluster_storage/ray-cv \
        --set train.name=own-loop infer
"""

import argparse
import io

import pyarrow as pa
import pyarrow.parquet as pq
import ray.train
import torch
from PIL import Image
from ray.train.torch import TorchTrainer, get_device, prepare_data_loader, prepare_model
from torch.utils.data import DataLoader, Dataset, Subset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from torchvision.models import get_model
from torchvision.transforms import v2

from pipeline.train import api


class ParquetImages(Dataset):
    """The bundle's preprocessed split: encoded images and their labels, decoded on access."""

    def __init__(self, files: list[str], transform):
        table = pa.concat_tables([pq.read_table(f, columns=["image", "label"]) for f in files])
        self.images, self.labels = table["image"].to_pylist(), table["label"].to_pylist()
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = Image.open(io.BytesIO(self.images[i])).convert("RGB")
        return self.transform(image), self.labels[i]


def build_dataloader(card: api.ModelCard, split: str, batch_size: int, *, train: bool):
    flip = [v2.RandomHorizontalFlip()] if train else []
    to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    transform = v2.Compose([*flip, *to_tensor, v2.Normalize(card.mean, card.std)])
    data = ParquetImages(card.split_files(split), transform)
    if train:  # Ray's DistributedSampler: a shuffled share per rank, padded to equal shares
        return prepare_data_loader(DataLoader(data, batch_size=batch_size, shuffle=True))
    # Val: each rank its own rows and each row once, so that the metrics count every row once.
    context = ray.train.get_context()
    share = Subset(data, range(context.get_world_rank(), len(data), context.get_world_size()))
    return prepare_data_loader(DataLoader(share, batch_size=batch_size), add_dist_sampler=False)


def train_one_epoch(model, loader, optimizer, criterion) -> float:
    model.train()
    total, batches = 0.0, 0
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = criterion(model(xb), yb)
        loss.backward()
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)


@torch.no_grad()
def evaluate(model, loader, criterion, metrics: dict) -> dict:
    """The val loss and accuracy over every rank's val images: torchmetrics sums each rank's
    state when it computes."""
    model.eval()
    for xb, yb in loader:
        logits = model(xb)
        metrics["val_loss"].update(criterion(logits, yb), weight=len(yb))  # the batch's mean
        metrics["val_accuracy"].update(logits.argmax(dim=1), yb)
    values = {name: metric.compute().item() for name, metric in metrics.items()}
    for metric in metrics.values():
        metric.reset()
    return values


def train_loop_per_worker(config):
    card = api.ModelCard.from_dict(config["card"])
    net = get_model(card.model, num_classes=len(card.classes), **card.kwargs)
    start_epoch, history = 0, []
    resumed = api.resume()
    if resumed:  # the run submitted again, or its workers restarted after a failure
        net.load_state_dict(resumed.weights)
        start_epoch, history = resumed.epoch + 1, resumed.history
    model = prepare_model(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    if resumed:
        optimizer.load_state_dict(resumed.train_state["optimizer"])
    criterion = torch.nn.CrossEntropyLoss()

    train_loader = build_dataloader(card, "train", config["batch_size"], train=True)
    val_loader = build_dataloader(card, "val", config["batch_size"], train=False)
    device = get_device()
    val_metrics = {
        "val_loss": MeanMetric().to(device),
        "val_accuracy": MulticlassAccuracy(len(card.classes), average="micro").to(device),
    }

    for epoch in range(start_epoch, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        train_loss = train_one_epoch(model, train_loader, optimizer, criterion)
        metrics = {
            "epoch": epoch,
            "train_loss": train_loss,
            **evaluate(model, val_loader, criterion, val_metrics),
        }
        history = [*history, metrics]
        if ray.train.get_context().get_world_rank() == 0:
            print(metrics)
        train_state = {"optimizer": optimizer.state_dict()}
        api.report(metrics, model=model, card=card, history=history, train_state=train_state)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, help="the preprocess job's output")
    parser.add_argument("--storage-path", required=True, help="where runs go")
    parser.add_argument("--name", default="own-loop")
    parser.add_argument("--model", default="resnet18", help="a torchvision classifier")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--tracking-uri", help="an MLflow server: register the best checkpoint")
    args = parser.parse_args()

    card = api.ModelCard.for_dataset(args.dataset, model=args.model, config=vars(args))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"card": card.to_dict(), **vars(args)},
        scaling_config=ray.train.ScalingConfig(num_workers=args.num_workers),
        run_config=api.run_config(args.storage_path, args.name, metric=card.metric, mode=card.mode),
    )
    trainer.fit()
    summary = api.finish_run(args.storage_path, args.name)
    print(f"best checkpoint: {summary['best_checkpoint']}")
    if args.tracking_uri:
        api.register_run(args.storage_path, args.name, tracking_uri=args.tracking_uri)


if __name__ == "__main__":
    main()
