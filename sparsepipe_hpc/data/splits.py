"""Splits that must agree: training and validation data read by one model and one metric.

    train, val = SceneDataset(d, "train"), SceneDataset(d, "val")
    check_splits(train, val)      # DataFormatError naming both files and the difference

One model is built from the training split (its input channels and class count) and evaluated on
the other split; the confusion matrix indexes both splits' labels by the training split's classes.
So the splits must have the same layout (both scenes or both ModelNet objects), the same class
names in the same order (swapped names would swap the per-class IoUs silently), the same feature
layout (``in_channels``: colour or none) and, when both files record one, the same ``voxel_size``.
"""

from __future__ import annotations

from typing import Any

from sparsepipe_hpc.data.checks import DataFormatError

__all__ = ["check_splits", "where"]


def where(dataset: Any) -> str:
    """The file(s) of a data set, for messages."""
    path = getattr(dataset, "path", None)
    if path is not None:
        return str(path)
    files = list(getattr(dataset, "files", []))
    if len(files) == 1:
        return str(files[0])
    if files:
        return f"{files[0]} (+{len(files) - 1} more file(s))"
    return repr(dataset)


def _class_difference(a: list[str], b: list[str], name_a: str, name_b: str) -> str:
    only_a = [n for n in a if n not in b]
    only_b = [n for n in b if n not in a]
    if only_a or only_b:
        parts = [f"{len(a)} classes in {name_a}, {len(b)} in {name_b}"]
        if only_a:
            parts.append(f"only in {name_a}: {only_a[:8]}")
        if only_b:
            parts.append(f"only in {name_b}: {only_b[:8]}")
        return "; ".join(parts)
    i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    return (f"the same {len(a)} classes in another order: class {i} is {a[i]!r} in {name_a} but "
            f"{b[i]!r} in {name_b}")


def check_splits(train: Any, other: Any, train_name: str = "train",
                 other_name: str = "val") -> None:
    """Raise DataFormatError unless ``other`` can be evaluated by a model built for ``train``
    (see the module docstring for what must agree)."""
    wa, wb = where(train), where(other)
    head = f"the {train_name} split ({wa}) and the {other_name} split ({wb}) disagree"
    if type(train) is not type(other):
        raise DataFormatError(f"{head} on the layout: {type(train).__name__} vs "
                              f"{type(other).__name__}")
    a, b = list(train.class_names), list(other.class_names)
    if a != b:
        source = ""
        src_a = getattr(train, "class_names_from", None)
        src_b = getattr(other, "class_names_from", None)
        if src_a and src_b:
            source = f" (names from {src_a}, and from {src_b})"
        diff = _class_difference(a, b, train_name, other_name)
        raise DataFormatError(f"{head} on 'class_names': {diff}{source}; every split must list "
                              "the same classes in the same "
                              "order (labels are indices into that list)")
    if train.in_channels != other.in_channels:
        def features(ds: Any) -> str:
            rgb = getattr(ds, "has_rgb", None)
            kind = "rgb" if rgb else "no rgb: a constant feature" if rgb is not None else "features"
            return f"{ds.in_channels} channel(s), {kind}"
        raise DataFormatError(f"{head} on the point features: {features(train)} in {train_name}, "
                              f"{features(other)} in {other_name}; the model's first layer takes "
                              "one layout: store 'rgb' in every split's scenes or in none")
    va, vb = getattr(train, "voxel_size", None), getattr(other, "voxel_size", None)
    if va is not None and vb is not None and va != vb:
        raise DataFormatError(f"{head} on attribute 'voxel_size': {va:g} m in {train_name}, "
                              f"{vb:g} m in {other_name}; the points were thinned differently: "
                              "prepare both splits at one voxel size")
