from collections import Counter

import numpy as np
import pytest
from helpers import CLASSES, make_image_folder, png_bytes

from pipeline.core.errors import InputError
from pipeline.data.config import FolderSourceConfig, HuggingFaceSourceConfig, SyntheticSourceConfig
from pipeline.data.images import decode_image
from pipeline.data.sources import (
    FolderSource,
    HuggingFaceSource,
    Item,
    SyntheticSource,
    assign_split,
    render_synthetic,
)


def test_split_is_deterministic_and_order_free():
    items = [Item(f"c/{i}.jpg", 0) for i in range(2000)]
    first = [assign_split(i, 0.2) for i in items]
    assert first == [assign_split(i, 0.2) for i in items]
    assert dict(zip(items, first, strict=True)) == {
        i: assign_split(i, 0.2) for i in reversed(items)
    }
    assert 0.17 < first.count("val") / len(items) < 0.23
    assert {assign_split(i, 0.0) for i in items} == {"train"}


def test_split_grows_monotonically_with_fraction():
    items = [Item(f"c/{i}.jpg", 0) for i in range(500)]
    small = {i for i in items if assign_split(i, 0.1) == "val"}
    large = {i for i in items if assign_split(i, 0.3) == "val"}
    assert small < large


def test_source_split_wins():
    assert assign_split(Item("x", 0, split="train"), 0.99) == "train"


def test_synthetic_is_deterministic():
    src = SyntheticSource(SyntheticSourceConfig(num_classes=4, images_per_class=3, seed=5))
    items = src.list_items()
    assert len(items) == 12 and src.classes[:2] == ["red_circle", "red_square"]
    again = SyntheticSource(SyntheticSourceConfig(num_classes=4, images_per_class=3, seed=5))
    assert [src.read(i) for i in items] == [again.read(i) for i in again.list_items()]
    other = SyntheticSource(SyntheticSourceConfig(num_classes=4, images_per_class=3, seed=6))
    assert src.read(items[0]) != other.read(items[0])


def test_synthetic_classes_are_separable():
    # Shapes of one colour differ in area; colours differ in mean hue. Check a cheap feature
    # (mean colour of the most saturated pixels) separates colours: a CNN can do at least that.
    def signature(name):
        img = np.asarray(render_synthetic(name, size=64, seed=0, index=3)).astype(float)
        sat = img.max(-1) - img.min(-1)
        return img[sat >= np.percentile(sat, 90)].mean(0)

    red, green, blue = (signature(n) for n in ("red_circle", "green_circle", "blue_circle"))
    assert red.argmax() == 0 and green.argmax() == 1 and blue.argmax() == 2


def test_folder_lists_classes_and_files(tmp_path):
    bad = make_image_folder(tmp_path, per_class=4)
    (tmp_path / CLASSES[1] / "nested").mkdir()
    (tmp_path / CLASSES[1] / "nested" / "x.png").write_bytes(png_bytes(CLASSES[1], 0))
    (tmp_path / CLASSES[1] / ".DS_Store").write_bytes(b"junk")
    (tmp_path / "README.txt").write_text("top-level files are not images of any class")
    src = FolderSource(FolderSourceConfig(path=str(tmp_path)))
    items = src.list_items()
    assert src.classes == sorted(CLASSES)
    counts = Counter(src.classes[i.label] for i in items)
    assert counts == {CLASSES[0]: 4 + len(bad), CLASSES[1]: 5, CLASSES[2]: 4}
    assert f"{CLASSES[1]}/nested/x.png" in {i.source_id for i in items}
    item = next(i for i in items if i.source_id.endswith("001.jpg"))
    assert decode_image(src.read(item)).size == (48, 48)


def test_folder_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        FolderSource(FolderSourceConfig(path=str(tmp_path / "missing"))).list_items()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is not a directory"):
        FolderSource(FolderSourceConfig(path=str(tmp_path / "file"))).list_items()
    (tmp_path / "root").mkdir()
    with pytest.raises(InputError, match="no class folders"):
        FolderSource(FolderSourceConfig(path=str(tmp_path / "root"))).list_items()
    (tmp_path / "root" / "cats").mkdir()
    (tmp_path / "root" / "dogs").mkdir()
    (tmp_path / "root" / "cats" / "a.png").write_bytes(png_bytes(CLASSES[0], 0))
    with pytest.raises(InputError, match=r"class folder .*dogs is empty"):
        FolderSource(FolderSourceConfig(path=str(tmp_path / "root"))).list_items()


def test_huggingface_picks_classes_by_name(hf_dataset):
    cfg = HuggingFaceSourceConfig(dataset=hf_dataset, classes=("sushi", "pizza"), fraction=0.5)
    src = HuggingFaceSource(cfg)
    items = src.list_items()
    assert src.classes == ["sushi", "pizza"]
    # 0.5 of 10 train and of 4 validation rows per class, remapped: sushi -> 0, pizza -> 1.
    assert Counter((i.split, i.label) for i in items) == {
        ("train", 0): 5,
        ("train", 1): 5,
        ("val", 0): 2,
        ("val", 1): 2,
    }
    # The stored rows of `sushi` (label 2 in the source) are rows 2, 7, 12, ... of each split.
    assert all(int(i.source_id.split("/")[1]) % 5 == (2 if i.label == 0 else 1) for i in items)
    reader = src.reader(items[:3])
    assert all(decode_image(reader.read(i)).size == (40, 40) for i in items[:3])
    # Same subset on every run; a larger fraction keeps it.
    assert HuggingFaceSource(cfg).list_items() == items
    more = HuggingFaceSource(cfg.model_copy(update={"fraction": 0.8})).list_items()
    assert set(items) < set(more)


def test_huggingface_unknown_class_lists_valid_names(hf_dataset):
    cfg = HuggingFaceSourceConfig(dataset=hf_dataset, classes=("pizza", "hamburger"))
    with pytest.raises(InputError, match=r"\['hamburger'\].*Valid names: apple_pie, pizza"):
        HuggingFaceSource(cfg).list_items()
