"""In-training evaluation sets (ssl_vit.engine.in_training_evals.EvalSplits): decoded once and
kept when they fit, streamed every time when not, and scored the same either way."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from test_stream import make_set
from torch import nn

from ssl_vit.data.manifest import load_manifest
from ssl_vit.engine import in_training_evals
from ssl_vit.engine.in_training_evals import EvalSplits, classifier_accuracy


class LookupClassifier(nn.Module):
    """Knows the label of some images by their exact pixels: a score that a wrong pixel or a
    misaligned label changes."""

    def __init__(self, known: dict[bytes, int], classes: int) -> None:
        super().__init__()
        self.known, self.classes = known, classes
        self.anchor = nn.Parameter(torch.zeros(()), requires_grad=False)  # gives the device

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (B, classes)
        keys = [img.mul(255).round().to(torch.uint8).numpy().tobytes() for img in x]
        labels = torch.tensor([self.known.get(k, 0) for k in keys])
        return nn.functional.one_hot(labels, self.classes).float()


def _splits(root: Path, **kw) -> EvalSplits:
    base = dict(img_size=8, rank=0, world=1, num_workers=0, device=torch.device("cpu"))
    return EvalSplits(load_manifest(root), **{**base, **kw})


def _score(batches, known: dict[bytes, int]) -> float:
    return classifier_accuracy(LookupClassifier(known, 40), batches, channels=1, img_size=8,
                               autocast=False)  # fmt: skip


def test_a_split_that_fits_is_decoded_once_and_scored_as_streamed(tmp_path: Path, monkeypatch):
    root = make_set(tmp_path / "set", [30, 10])
    splits = _splits(root)
    first = splits.batches("train", 0.2)  # the held-out part of train
    whole = _splits(root).batches("train", None)
    pairs = [(img, int(y)) for x, ys in whole for img, y in zip(x, ys, strict=True)]
    known = {img.numpy().tobytes(): y for img, y in pairs[::2]}  # every other sample's label
    with monkeypatch.context() as m:  # the same split streamed: nothing kept
        m.setattr(in_training_evals, "EVAL_CACHE_BUDGET", 0)
        stream = _splits(root).batches("train", 0.2)
        assert not isinstance(stream, list)
        streamed = _score(stream, known)
    assert isinstance(first, list) and sum(len(y) for _, y in first) < 40
    shutil.move(root, tmp_path / "gone")  # a kept split reads no file again
    again = splits.batches("train", 0.2)
    assert again is first
    assert _score(again, known) == streamed
    assert 0 < streamed < 1  # the score depends on the images: the check can fail


def test_a_split_over_the_budget_is_streamed_every_time(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(in_training_evals, "EVAL_CACHE_BUDGET", 0)
    root = make_set(tmp_path / "set", [30, 10])
    splits = _splits(root)
    assert not isinstance(splits.batches("train", None), list)
    assert splits.kept == {}
    assert sum(len(y) for _, y in splits.batches("train", None)) == 40
