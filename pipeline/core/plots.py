"""Figures the jobs write beside their outputs, as PNG bytes (matplotlib, imported on use)."""

from __future__ import annotations

import io


def plot_curves(history: list[dict], *, best_epoch: int | None, chosen_by: str) -> bytes:
    """Loss and val accuracy (and the run's other val scores, `metrics`) per epoch, the best
    checkpoint's epoch (`chosen_by` what) marked (none in a run that diverged), as PNG bytes."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
    left.plot(epochs, [h["val_loss"] for h in history], marker="o", label="val")
    left.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    scores = [k for k in dict.fromkeys(k for h in history for k in h) if _a_val_score(k)]
    for key in scores:
        right.plot(epochs, [h.get(key, float("nan")) for h in history], marker="o", label=key)
    right.set(xlabel="epoch", ylabel="score", title="Val scores")
    for ax in (left, right):
        if best_epoch is not None:
            ax.axvline(best_epoch, color="gray", linestyle="--", label=f"best by {chosen_by}")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.legend()
    right.legend()
    return _png(fig)


def _a_val_score(key: str) -> bool:
    """val_accuracy and the run's `metrics` (val_<name>), not its loss, image count or the
    values per class (val_recall/<class>)."""
    return key.startswith("val_") and "/" not in key and key not in ("val_loss", "val_images")


def plot_trials(
    histories: dict[str, list[dict]], *, key: str, best: str | None, labels: dict[str, str]
) -> bytes:
    """Each trial's `key` per epoch, one line a trial named by `labels` (the `best` one drawn
    bold), as PNG bytes: a sweep's trials side by side, those stopped early where their lines
    end."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 5))
    for trial, history in sorted(histories.items()):
        is_best = trial == best
        ax.plot(
            [h["epoch"] for h in history],
            [h[key] for h in history],
            marker="o",
            linewidth=2.5 if is_best else 1,
            alpha=1 if is_best else 0.6,
            label=f"{labels[trial]} (best)" if is_best else labels[trial],
        )
    ax.set(xlabel="epoch", ylabel=key, title=f"Trials: {key} per epoch")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    return _png(fig)


def plot_confusion(cm: list[list[int]], classes: list[str]) -> bytes:
    """A confusion matrix (rows: true class, columns: predicted), as PNG bytes."""
    plt = _pyplot()
    size = max(4, 0.6 * len(classes) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(cm, cmap="Blues")
    ax.set(
        xticks=range(len(classes)),
        yticks=range(len(classes)),
        xlabel="predicted",
        ylabel="true",
        title="Confusion matrix",
    )
    ax.set_xticklabels(classes, rotation=45, ha="right")
    ax.set_yticklabels(classes)
    for i, row in enumerate(cm):
        for j, v in enumerate(row):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=8)
    return _png(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _pyplot().close(fig)
    return buf.getvalue()
