"""The in-RAM training loader (ssl_vit.data.memory) on small real shard sets: the streaming
loader's contract (samples, held-out, equal steps, exact resume, rank invariance), its crop
geometry, bad data, and when `auto` holds a split in RAM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_stream import make_set

from ssl_vit.data import memory, stream
from ssl_vit.data.augment import crop_resize_batch, shift_image
from ssl_vit.data.holdout import held_out_indices
from ssl_vit.data.manifest import load_manifest
from ssl_vit.data.memory import resolve_in_memory
from ssl_vit.data.stream import make_eval_loader, make_train_loader
from ssl_vit.data.workers import IN_TRAINING_START


def _loader(root: Path, **kw) -> memory.MemoryTrainLoader:
    base = dict(global_batch=8, num_workers=2, img_size=8, seed=0, in_memory=True)
    return make_train_loader(root, "train", **{**base, **kw})


def _epoch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*loader, strict=True)
    return torch.cat(xs), torch.cat(ys)


def test_an_epoch_is_a_permutation_of_the_training_samples(tmp_path):
    """Without augmentation, an epoch's images are the split's own pixels (as the eval loader
    reads them), each label once, held-out samples never; epochs differ in order only."""
    root = make_set(tmp_path, [30, 17, 40])  # 87 samples; sample i has label i
    held = set(held_out_indices(87, 0.1).tolist())
    assert held
    loader = _loader(root, augment=False, holdout_fraction=0.1)
    train = 87 - len(held)
    assert loader.num_samples == train and len(loader) == train // 8
    x0, y0 = _epoch(loader)
    assert len(y0) == 8 * (train // 8) and len(set(y0.tolist())) == len(y0)
    assert not held & set(y0.tolist())
    ref_x, ref_y = _epoch(make_eval_loader(root, "train", batch_size=16, img_size=8))
    pixels = dict(zip(ref_y.tolist(), ref_x, strict=True))
    assert all(torch.equal(x, pixels[y]) for x, y in zip(x0, y0.tolist(), strict=True))
    loader.set_epoch(1)
    _, y1 = _epoch(loader)
    assert y1.tolist() != y0.tolist()


@pytest.mark.parametrize("translate", [0, 2])
def test_resume_yields_the_tail_and_ranks_split_the_global_batch(tmp_path, translate):
    """set_epoch(e, k) gives batches k.. of epoch e exactly, augmentation included; two ranks
    at half the batch give, side by side, what one rank gives at the whole batch."""
    root = make_set(tmp_path, [50, 50], size=12)
    aug = dict(img_size=8, scale=(0.3, 1.0), global_batch=16, translate=translate)
    one = _loader(root, **aug)
    one.set_epoch(2)
    full = list(one)
    one.set_epoch(2, skip_batches=3)
    tail = list(one)
    assert len(tail) == len(full) - 3
    for (a, la), (b, lb) in zip(full[3:], tail, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    ranks = [_loader(root, rank=r, world_size=2, **aug) for r in (0, 1)]
    for r in ranks:
        r.set_epoch(2)
    for (x, y), (x0, y0), (x1, y1) in zip(full, *ranks, strict=True):
        assert x0.shape == (8, 1, 8, 8)
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)


def test_batched_crop_lands_on_the_box_and_flips_are_exact():
    """A crop box the output's size is that box's pixels (the sampling grid hits pixel centres);
    a whole-image box at its own size is the image."""
    images = torch.randint(0, 256, (3, 1, 12, 12), dtype=torch.uint8)
    boxes = [(0, 0, 6, 6), (3, 5, 6, 6), (6, 6, 6, 6)]
    out = crop_resize_batch(images, boxes, 6)
    for img, (t, left, h, w), o in zip(images, boxes, out, strict=True):
        assert torch.equal(o, img[:, t : t + h, left : left + w])
    assert torch.equal(crop_resize_batch(images, [(0, 0, 12, 12)] * 3, 12), images)
    # Through the loader: with flips only, every image is its sample or its mirror, both occur.
    gray = torch.arange(64, dtype=torch.uint8).view(1, 1, 8, 8).repeat(64, 1, 1, 1)
    loader = memory.MemoryTrainLoader(
        gray, torch.arange(64), manifest=None, split="train", global_batch=64, rank=0,
        world_size=1, img_size=8, seed=0, augment=True, scale=(1.0, 1.0), hflip=True,
        counter=None,
    )  # fmt: skip
    ((x, _),) = list(loader)
    flipped = torch.tensor([torch.equal(im, gray[0].flip(-1)) for im in x])
    same = torch.tensor([torch.equal(im, gray[0]) for im in x])
    assert bool((flipped | same).all()) and 10 < int(flipped.sum()) < 54


def test_shifts_are_the_streaming_loaders_within_the_bound():
    """translate=2: each image is its sample moved by some (dy, dx) in [-2, 2]^2 (the streaming
    path's shift_image), many different shifts in one batch, each rank's slice its own."""
    gray = torch.arange(1, 65, dtype=torch.uint8).view(1, 1, 8, 8).repeat(64, 1, 1, 1)
    kw = dict(manifest=None, split="train", global_batch=64, world_size=1, img_size=8, seed=0,
              augment=True, scale=(1.0, 1.0), hflip=False, counter=None, translate=2)  # fmt: skip
    ((x, _),) = list(memory.MemoryTrainLoader(gray, torch.arange(64), rank=0, **kw))
    src = gray[0, 0].numpy()
    shifts = [next(((dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                    if np.array_equal(shift_image(src, dy, dx), im[0].numpy())), None)
              for im in x]  # fmt: skip
    assert None not in shifts and len(set(shifts)) > 12


def test_batched_shift_is_shift_image_for_every_offset_and_channel_count():
    """The batch shift (what a GPU runs) against the per-image reference, for every offset up to
    the pad, shifts past the image (all zero), grayscale and RGB."""
    rng = np.random.default_rng(0)
    offsets = [(dy, dx) for dy in range(-3, 4) for dx in range(-3, 4)] + [(5, -5), (-6, 0)]
    for c in (1, 3):
        imgs = torch.from_numpy(rng.integers(1, 256, (len(offsets), c, 5, 6), dtype=np.uint8))
        out = memory.shift_batch(imgs, offsets, pad=6)
        for img, moved, (dy, dx) in zip(imgs, out, offsets, strict=True):
            hwc = img.permute(1, 2, 0).numpy()
            assert np.array_equal(moved.permute(1, 2, 0).numpy(), shift_image(hwc, dy, dx))


def test_a_loader_on_a_device_gives_the_host_loaders_batches(tmp_path):
    """`device` holds the split there and makes each batch there: the same samples, crops,
    shifts and flips as the host loader's (on the CPU device here; a GPU may round a resampled
    pixel differently)."""
    root = make_set(tmp_path, [40], size=10)
    kw = dict(img_size=8, scale=(0.3, 1.0), global_batch=8, translate=1)
    host = _loader(root, **kw)
    there = _loader(root, **kw, device="cpu")
    for (x, y), (xd, yd) in zip(host, there, strict=True):
        assert torch.equal(x, xd) and torch.equal(y, yd)
        assert xd.device.type == "cpu"


@pytest.mark.parametrize("in_memory", [False, True])
def test_workers_from_the_training_start_method_give_the_same_batches(
    tmp_path, monkeypatch, in_memory
):
    """What a training run uses (IN_TRAINING_START: a fork server, never a fork of the threaded
    trainer) yields exactly what forked workers yield, streamed or decoded into RAM."""
    monkeypatch.setattr(stream, "IN_PROCESS_SAMPLES", 0)  # decode with workers all the same
    root = make_set(tmp_path, [30, 30], size=12, corrupt_image=(7,))
    kw = dict(img_size=8, scale=(0.3, 1.0), global_batch=8, translate=1, in_memory=in_memory)
    if not in_memory:
        kw.update(in_memory=False, shuffle_buffer=20, timeout=60)
    got = _epoch(_loader(root, multiprocessing_context=IN_TRAINING_START, **kw))
    want = _epoch(_loader(root, multiprocessing_context="fork", **kw))
    assert IN_TRAINING_START == "forkserver"  # Linux has it
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_fork_server_starts_only_for_a_loader_that_uses_workers(tmp_path, monkeypatch):
    """Starting one imports torch and the readers (seconds of CPU per training process): a
    split held in RAM and decoded in-process starts none; workers, streamed or decoding a
    large split into RAM, do."""
    from ssl_vit.data import workers

    started = []
    real = workers.multiprocessing.forkserver.ensure_running
    monkeypatch.setattr(workers.multiprocessing.forkserver, "ensure_running",
                        lambda: started.append(1) or real())  # fmt: skip
    root = make_set(tmp_path, [30, 30], size=12)
    kw = dict(img_size=8, global_batch=8, multiprocessing_context=IN_TRAINING_START)
    _epoch(_loader(root, **kw))
    assert started == []  # 60 samples: decoded in this process
    _epoch(_loader(root, in_memory=False, shuffle_buffer=20, timeout=60, **kw))
    assert started == [1]
    monkeypatch.setattr(stream, "IN_PROCESS_SAMPLES", 0)
    _epoch(_loader(root, **kw))
    assert started == [1, 1]


def test_corrupt_samples_are_dropped_and_counted(tmp_path):
    root = make_set(tmp_path, [20, 20], corrupt_image=(3, 25), bad_cls=(11,))
    loader = _loader(root, augment=False)
    assert loader.num_samples == 37 and loader.num_skipped == 3
    _, y = _epoch(loader)
    assert not {3, 11, 25} & set(y.tolist())


def test_auto_holds_a_split_of_one_size_within_the_budget(tmp_path, monkeypatch):
    root = make_set(tmp_path, [20])
    manifest = load_manifest(root)
    assert resolve_in_memory("auto", manifest, "train")[0]
    assert not resolve_in_memory(False, manifest, "train")[0]
    monkeypatch.setattr(memory, "MEMORY_BUDGET", 20 * 8 * 8 - 1)  # one byte short
    ok, why = resolve_in_memory("auto", manifest, "train")
    assert not ok and "budget" in why
    manifest.image_size = None  # images of several sizes
    assert not resolve_in_memory("auto", manifest, "train")[0]
    with pytest.raises(ValueError, match="image_size is null.*data.in_memory=false"):
        resolve_in_memory(True, manifest, "train")
