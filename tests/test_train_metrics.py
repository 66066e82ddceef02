"""Confusion matrix / IoU arithmetic and the metrics.jsonl log."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparsepipe_hpc.train.metrics import ConfusionMatrix, MetricsLog, format_summary, read_metrics


def test_confusion_matrix_iou():
    cm = ConfusionMatrix(4)
    target = torch.tensor([0, 0, 0, 1, 1, 2])
    pred = torch.tensor([0, 0, 1, 1, 2, 2])
    cm.update(pred, target)
    assert cm.matrix.tolist() == [[2, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert cm.overall_accuracy() == 4 / 6
    # class 0: tp 2, fp 0, fn 1 -> 2/3; class 1: tp 1, fp 1, fn 1 -> 1/3; class 2: 1/2;
    # class 3: absent from both -> None
    assert cm.iou() == [2 / 3, 1 / 3, 1 / 2, None]
    assert math.isclose(cm.mean_iou(), (2 / 3 + 1 / 3 + 1 / 2) / 3)
    # per class right: 2/3, 1/2, 1; class 3 has no samples and is left out, not counted as 0
    assert math.isclose(cm.mean_class_accuracy(), (2 / 3 + 1 / 2 + 1) / 3)
    cm.update(pred, target)  # counts accumulate
    assert cm.total == 12 and cm.overall_accuracy() == 4 / 6


def test_classes_out_of_range_are_refused_not_counted_elsewhere():
    cm = ConfusionMatrix(3)
    with pytest.raises(ValueError, match=r"pred holds classes 0\.\.3; the confusion matrix counts "
                                         r"classes 0\.\.2 \(num_classes=3\)"):
        cm.update(torch.tensor([3, 0]), torch.tensor([0, 1]))  # would count as (true 1, pred 0)
    with pytest.raises(ValueError, match=r"target holds classes -1\.\.1"):
        cm.update(torch.tensor([0, 1]), torch.tensor([-1, 1]))
    assert cm.total == 0
    cm.update(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))


def test_empty_confusion_matrix_is_nan():
    cm = ConfusionMatrix(3)
    assert math.isnan(cm.overall_accuracy()) and math.isnan(cm.mean_iou())
    assert math.isnan(cm.mean_class_accuracy())


def test_metrics_log_and_truncate(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path)
    for step in range(1, 6):
        log.write({"kind": "train", "step": step, "loss": 1.0 / step})
    log.write({"kind": "eval", "step": 5, "oa": float("nan"), "iou": [0.5, None]})
    with open(path, "a") as f:
        f.write('{"kind": "train", "st')  # a line cut short by a crash
    assert log.truncate_after(3) == 4
    log.write({"kind": "train", "step": 4, "loss": 0.2})
    log.close()
    recs = read_metrics(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[1]["loss"] == 0.5
    MetricsLog(path).write({"kind": "eval", "step": 4, "oa": float("nan")})
    assert read_metrics(path, "eval") == [{"kind": "eval", "step": 4, "oa": None}]  # NaN -> null
    for line in path.read_text().splitlines():
        json.loads(line)


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "sub" / "m.jsonl", enabled=False)
    log.write({"step": 1})
    log.sync()
    assert log.truncate_after(0) == 0
    assert not (tmp_path / "sub").exists()


def test_summary_line():
    text = format_summary({"step": 10, "epoch": 1, "loss": 0.5},
                          {"oa": 0.75, "miou": 0.4, "iou": []}, 12.34)
    assert text == "done: step 10 epoch 1 loss 0.5000 oa 0.7500 miou 0.4000 time 12.3 s"
