"""Streaming loader on small real shard sets written here with webdataset.TarWriter."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from ssl_vit.data.holdout import (
    MAX_SUBSET_BYTES,
    excluded_indices,
    held_out_indices,
    read_subset_file,
)
from ssl_vit.data.manifest import Manifest, ManifestError, ShardInfo, SplitInfo, write_manifest
from ssl_vit.data.stream import make_eval_loader, make_train_loader

TIMEOUT = 60  # DataLoader timeout: a hung worker fails the test instead of stalling it


def _png(value: int, channels: int, size: int) -> bytes:
    rng = np.random.default_rng(value)
    shape = (size, size) if channels == 1 else (size, size, 3)
    arr = rng.integers(0, 256, shape, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_set(
    root: Path,
    sizes: list[int],
    *,
    split: str = "train",
    channels: int = 1,
    size: int = 8,
    corrupt_image: tuple[int, ...] = (),
    bad_cls: tuple[int, ...] = (),
) -> Path:
    """Shards whose sample i has label i (so tests can see which samples came out)."""
    root.mkdir(parents=True, exist_ok=True)
    shards, i = [], 0
    for s, n in enumerate(sizes):
        name = f"{split}-{s:06d}.tar"
        with wds.TarWriter(str(root / name)) as w:
            for _ in range(n):
                img = b"not a png at all" if i in corrupt_image else _png(i, channels, size)
                cls = b"seven" if i in bad_cls else str(i).encode()
                w.write({"__key__": f"s{i:06d}", "png": img, "cls": cls, "json": b"{}"})
                i += 1
        shards.append(ShardInfo(name, n, (root / name).stat().st_size, "0" * 64))
    manifest = Manifest(
        splits={split: SplitInfo(num_samples=i, shards=shards)},
        class_names=[str(k) for k in range(i)],
        channels=channels,
        image_size=[size, size],
        mean=[0.5] * channels,
        std=[0.25] * channels,
    )
    write_manifest(root, manifest)
    return root


def _epoch(loader) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    images, labels = [], []
    for x, y in loader:
        images.append(x)
        labels.append(y)
    return images, labels


def _train(root: Path, **kw):
    base = dict(num_workers=2, img_size=8, seed=0, timeout=TIMEOUT, shuffle_buffer=50)
    return make_train_loader(root, "train", **{**base, **kw})


@pytest.mark.parametrize("sizes", [[10, 7, 13], [5, 3, 9, 2, 6, 4, 3, 8, 1]])
def test_equal_steps_on_every_rank(tmp_path: Path, sizes: list[int]) -> None:
    # 4 ranks x 2 workers = 8 streams: 3 shards (split by sample index) and 9 uneven shards.
    root = make_set(tmp_path, sizes)
    steps = sum(sizes) // 8
    for rank in range(4):
        loader = _train(root, global_batch=8, rank=rank, world_size=4)
        assert loader.steps_per_epoch == steps == len(loader)
        images, labels = _epoch(loader)
        assert len(images) == steps
        for x, y in zip(images, labels, strict=True):
            assert x.shape == (2, 1, 8, 8) and x.dtype == torch.uint8
            assert y.shape == (2,) and y.dtype == torch.int64
            assert ((y >= 0) & (y < sum(sizes))).all()


@pytest.mark.parametrize("sizes,global_batch", [([16] * 8, 32), ([32, 32], 16)])
def test_every_sample_once_per_epoch(tmp_path: Path, sizes: list[int], global_batch: int) -> None:
    root = make_set(tmp_path, sizes)
    seen: list[int] = []
    for rank in range(2):
        _, labels = _epoch(_train(root, global_batch=global_batch, rank=rank, world_size=2))
        seen += torch.cat(labels).tolist()
    assert sorted(seen) == list(range(sum(sizes)))


def test_deterministic_per_epoch(tmp_path: Path) -> None:
    root = make_set(tmp_path, [9, 9, 9, 9])  # 2 streams x 18: sizes divide
    a_img, a_lab = _epoch(_train(root, global_batch=6))
    b_img, b_lab = _epoch(_train(root, global_batch=6))
    assert all(torch.equal(p, q) for p, q in zip(a_img + a_lab, b_img + b_lab, strict=True))
    loader = _train(root, global_batch=6)
    loader.set_epoch(1)
    c_img, c_lab = _epoch(loader)
    assert torch.cat(c_lab).tolist() != torch.cat(a_lab).tolist()
    assert sorted(torch.cat(c_lab).tolist()) == sorted(torch.cat(a_lab).tolist()) == list(range(36))
    other_seed = _epoch(_train(root, global_batch=6, seed=1))[1]
    assert torch.cat(other_seed).tolist() != torch.cat(a_lab).tolist()


@pytest.mark.parametrize("skip", [1, 2, 4])
def test_skip_batches_is_the_tail(tmp_path: Path, skip: int) -> None:
    root = make_set(tmp_path, [9, 8, 7, 6, 5])  # 35 samples, batch 7: 5 steps (odd, 2 workers)
    shift = dict(translate=1)  # the augmentation draws resume too
    full_img, full_lab = _epoch(_train(root, global_batch=7, epoch=3, **shift))
    assert len(full_img) == 5
    loader = _train(root, global_batch=7, epoch=3, skip_batches=skip, **shift)
    assert len(loader) == 5 - skip
    tail_img, tail_lab = _epoch(loader)
    assert len(tail_img) == 5 - skip
    for p, q in zip(full_img[skip:] + full_lab[skip:], tail_img + tail_lab, strict=True):
        assert torch.equal(p, q)


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) + 100])


def test_corrupt_and_truncated_are_skipped_and_counted(tmp_path: Path) -> None:
    sizes = [10, 10, 10, 10]
    root = make_set(tmp_path, sizes, corrupt_image=(3, 25), bad_cls=(17,))
    _truncate(root / "train-000003.tar")  # samples 30..39, the tail lost
    bad = {3, 17, 25}

    loader = make_eval_loader(
        root, "train", batch_size=4, img_size=8, num_workers=2, timeout=TIMEOUT
    )
    labels = torch.cat([y for _, y in loader]).tolist()
    good_before = [i for i in range(30) if i not in bad]
    assert labels[: len(good_before)] == good_before
    tail = labels[len(good_before) :]
    assert 0 < len(tail) < 10 and tail == list(range(30, 30 + len(tail)))
    assert loader.num_skipped == 40 - len(labels)
    assert loader.num_shard_errors == 1

    train = _train(root, global_batch=8, world_size=1)
    images, labels_t = _epoch(train)
    assert len(images) == 5 and all(x.shape == (8, 1, 8, 8) for x in images)
    out = set(torch.cat(labels_t).tolist())
    assert not out & bad and not out & set(range(30 + len(tail), 40))
    assert train.num_skipped >= 3 + 10 - len(tail) and train.num_shard_errors >= 1


def test_missing_shard_error_or_skip(tmp_path: Path) -> None:
    root = make_set(tmp_path, [8, 8, 8, 8])
    (root / "train-000002.tar").unlink()
    with pytest.raises(ManifestError, match="train-000002.tar.*missing"):
        _train(root, global_batch=8)
    with pytest.raises(ManifestError, match="train-000002.tar"):
        make_eval_loader(root, "train", batch_size=4, img_size=8)
    loader = _train(root, global_batch=8, missing="skip")
    assert loader.steps_per_epoch == 3
    seen = sorted(torch.cat(_epoch(loader)[1]).tolist())
    assert seen == [i for i in range(32) if not 16 <= i < 24]
    labels = [
        y for _, y in make_eval_loader(root, "train", batch_size=5, img_size=8, missing="skip")
    ]
    assert torch.cat(labels).tolist() == seen


def test_vanished_after_construction_does_not_hang(tmp_path: Path) -> None:
    root = make_set(tmp_path, [8, 8, 8, 8])
    loader = _train(root, global_batch=8)
    (root / "train-000001.tar").unlink()
    images, _ = _epoch(loader)
    assert len(images) == 4 and loader.num_skipped >= 8 and loader.num_shard_errors >= 1


@pytest.mark.parametrize("workers", [0, 2])
def test_eval_order_exactly_once(tmp_path: Path, workers: int) -> None:
    root = make_set(tmp_path, [7, 5, 9], split="test", channels=3, size=6)
    loader = make_eval_loader(
        root,
        "test",
        batch_size=4,
        img_size=10,
        num_workers=workers,
        timeout=TIMEOUT if workers else 0,
    )
    assert len(loader) == 6
    batches = list(loader)
    assert [x.shape for x, _ in batches] == [(4, 3, 10, 10)] * 5 + [(1, 3, 10, 10)]
    assert batches[0][0].dtype == torch.uint8
    assert torch.cat([y for _, y in batches]).tolist() == list(range(21))
    parts = []
    for rank in range(3):
        part = make_eval_loader(
            root, "test", batch_size=3, img_size=6, num_workers=workers, rank=rank, world_size=3,
            with_keys=True,
        )  # fmt: skip
        parts.append([k for _, _, keys in part for k in keys])
    assert [len(p) for p in parts] == [7, 7, 7]
    assert sum(parts, []) == [f"s{i:06d}" for i in range(21)]


def test_rgb_train_shapes_and_bad_arguments(tmp_path: Path) -> None:
    root = make_set(tmp_path, [6, 6], channels=3, size=12)
    x, y = next(iter(_train(root, global_batch=4, img_size=8, num_workers=0)))
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.uint8
    with pytest.raises(ValueError, match="not divisible"):
        _train(root, global_batch=6, world_size=4)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _train(root, global_batch=16)
    with pytest.raises(ManifestError, match="no split 'val'"):
        make_train_loader(root, "val", global_batch=4)


@pytest.mark.parametrize("sizes", [[40] * 8, [160, 160]])  # shards dealt / split by index
def test_held_out_samples_never_train_and_are_the_holdout_eval(tmp_path: Path, sizes) -> None:
    root = make_set(tmp_path, sizes)
    held = set(held_out_indices(sum(sizes), 0.1).tolist())
    assert 15 < len(held) < 50  # ~10% of 320, by hash
    trained: list[int] = []
    for rank in range(2):  # 2 ranks x 2 workers, two epochs
        loader = _train(root, global_batch=16, rank=rank, world_size=2, holdout_fraction=0.1)
        assert loader.steps_per_epoch == (sum(sizes) - len(held)) // 16
        for epoch in range(2):
            loader.set_epoch(epoch)
            trained += torch.cat(_epoch(loader)[1]).tolist()
    assert trained and not held & set(trained)
    assert len(set(trained)) > 0.9 * (sum(sizes) - len(held))  # the rest does train
    parts = []
    for rank in range(2):
        part = make_eval_loader(
            root, "train", batch_size=4, img_size=8, num_workers=2, rank=rank, world_size=2,
            holdout_fraction=0.1, timeout=TIMEOUT,
        )  # fmt: skip
        assert part.num_samples in (len(held) // 2, len(held) - len(held) // 2)
        parts.append(torch.cat([y for _, y in part]).tolist())
    assert parts[0] + parts[1] == sorted(held)  # each held-out sample once, in order
    # Without the holdout nothing is excluded: the same samples do train.
    plain = torch.cat(_epoch(_train(root, global_batch=16, rank=0, world_size=1))[1]).tolist()
    assert held & set(plain)


def test_train_fraction_trains_a_nested_hashed_subset(tmp_path: Path) -> None:
    """data.train_fraction: both loaders train on the same hashed share of the not held-out
    samples (in RAM each once an epoch; streamed, shards of unequal use re-read, module doc);
    a smaller share lies inside a larger one."""
    root = make_set(tmp_path, [100, 100, 100])
    unused = {f: set(excluded_indices(300, 0.1, f).tolist()) for f in (0.3, 0.6)}
    held = set(held_out_indices(300, 0.1).tolist())
    assert held <= unused[0.6] <= unused[0.3]  # nested, the held-out never used
    assert 300 * 0.9 * 0.3 * 0.7 < 300 - len(unused[0.3]) < 300 * 0.9 * 0.3 * 1.3
    for in_memory in (False, True):
        loader = _train(root, global_batch=4, holdout_fraction=0.1, train_fraction=0.3,
                        augment=False, in_memory=in_memory)  # fmt: skip
        labels = torch.cat(_epoch(loader)[1]).tolist()
        assert len(labels) == 4 * ((300 - len(unused[0.3])) // 4) and not set(labels) & unused[0.3]
        distinct = len(set(labels)) / len(labels)
        assert distinct == 1 if in_memory else distinct > 0.7
    with pytest.raises(ValueError, match="raise data.train_fraction=0.01"):
        _train(root, global_batch=16, train_fraction=0.01)


@pytest.mark.parametrize("world,workers", [(1, 0), (1, 2), (3, 1), (2, 2), (4, 2), (8, 2)])
def test_every_sample_exactly_once_at_any_stream_count(tmp_path: Path, world, workers) -> None:
    """Exact epochs at 1 to 16 streams over 3 shards, with a held-out share: each training
    sample comes once, and each is read once (the counters see no sample read twice)."""
    root = make_set(tmp_path, [10, 7, 13])
    held = set(held_out_indices(30, 0.1).tolist())
    global_batch = 2 * world
    steps = (30 - len(held)) // global_batch
    seen: list[int] = []
    read = 0
    for rank in range(world):
        loader = _train(root, global_batch=global_batch, rank=rank, world_size=world,
                        num_workers=workers, holdout_fraction=0.1)  # fmt: skip
        assert loader.read_factor <= 1.0
        labels = torch.cat(_epoch(loader)[1]).tolist()
        assert len(labels) == steps * (global_batch // world)
        seen += labels
        read += loader.counter.samples_read
    assert len(seen) == len(set(seen)) == steps * global_batch
    assert not set(seen) & held
    assert read == len(seen)  # no sample read twice, none read and dropped


def _refs(n_shards: int, per_shard: int, url: str, every: int = 0) -> list:
    from ssl_vit.data.shards import ShardRef

    index = tuple(range(0, per_shard, every)) if every else ()
    return [
        ShardRef(f"{url}/train-{i:06d}.tar", per_shard, i * per_shard, index, every)
        for i in range(n_shards)
    ]


@pytest.mark.parametrize("streams", [1, 2, 3, 100, 320, 512])
def test_plan_reads_each_sample_once_at_scale(streams: int) -> None:
    """The epoch plan in-process for many streams: 257 shards of 5,000 (ImageNet at the default
    shard size) over up to 512 streams. Each sample is planned at most once; the plan reads the
    set about once where streams can enter a shard (local, or an indexed remote shard) and far
    more where they must read its head (an unindexed remote shard)."""
    from ssl_vit.data.stream import Exclusions, exact_pieces, read_factor, stream_quota

    workers = 1 if streams < 8 else 8
    world = max(1, streams // workers)
    steps = 257 * 5000 // (world * 64)
    quotas = [stream_quota(steps, 64, workers, r) for r in range(workers)] * world
    local = _refs(257, 5000, "/data/shards")
    plans = exact_pieces(local, quotas, Exclusions([]), seed=0, epoch=3)
    assert [sum(p.stop - p.start for p in pieces) for pieces in plans] == quotas
    covered = sorted((p.ref.offset + p.start, p.ref.offset + p.stop) for ps in plans for p in ps)
    assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:], strict=False))  # disjoint
    assert read_factor(local, plans) <= 1.0
    indexed = _refs(257, 5000, "https://data.example.org/shards", every=100)
    plans = exact_pieces(indexed, quotas, Exclusions([]), seed=0, epoch=3)
    assert read_factor(indexed, plans) <= 1.05
    bare = _refs(257, 5000, "https://data.example.org/shards")
    plans = exact_pieces(bare, quotas, Exclusions([]), seed=0, epoch=3)
    if streams >= 100:
        assert read_factor(bare, plans) > 1.05  # what the preflight refuses


def test_resampled_draws_shards_with_replacement(tmp_path: Path) -> None:
    root = make_set(tmp_path, [6, 6, 6])
    runs = []
    for _ in range(2):
        loader = _train(root, global_batch=4, resampled=True, augment=False)
        assert loader.steps_per_epoch == 4 and loader.read_factor == 1.0
        runs.append(torch.cat(_epoch(loader)[1]).tolist())
    assert runs[0] == runs[1] and len(runs[0]) == 16  # seeded, and an epoch is a sample count
    assert set(runs[0]) <= set(range(18))


def test_workers_persist_across_epochs(tmp_path: Path) -> None:
    """One set of worker processes for the loader's life; `set_epoch` reaches them, and an
    epoch they make equals the same epoch of a fresh loader."""
    root = make_set(tmp_path, [9, 9, 9, 9])
    loader = _train(root, global_batch=6)
    _epoch(loader)
    pids = [w.pid for w in loader._loader._iterator._workers]
    loader.set_epoch(2)
    again = _epoch(loader)
    assert [w.pid for w in loader._loader._iterator._workers] == pids
    fresh = _epoch(_train(root, global_batch=6, epoch=2))
    assert all(torch.equal(p, q) for p, q in zip(again[0] + again[1], fresh[0] + fresh[1],
                                                 strict=True))  # fmt: skip


def test_shared_memory_too_small_is_one_line() -> None:
    from ssl_vit.data.stream import check_shared_memory

    check_shared_memory(1 << 20, 2, 2)
    with pytest.raises(RuntimeError, match=r"/dev/shm has \d+ MB free .*--shm-size"):
        check_shared_memory(1 << 50, 8, 2)


def _jpeg(value: int, size: tuple[int, int]) -> bytes:
    """A smooth, photo-like RGB JPEG (gradients and a disc), different for each value."""
    h, w = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = np.hypot(y - h * (0.3 + value % 5 / 10), x - w / 2) < min(h, w) / 4
    arr = np.stack([x / w * 255, y / h * 255, np.where(r, 200.0, 40.0 + value)], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_gpu_decode_path_matches_the_cpu_path(tmp_path: Path) -> None:
    """data.decode=gpu run on the CPU: the same samples, crops and flips as the worker path,
    pixels within resampling tolerance; a PNG among the JPEGs takes the worker path, and a
    JPEG whose body is broken is decoded in the main process or counted and replaced."""
    root = tmp_path / "jpg"
    root.mkdir()
    sizes = [(48, 64), (64, 48), (56, 56)]
    with wds.TarWriter(str(root / "train-000000.tar")) as w:
        for i in range(24):
            sample = {"__key__": f"s{i:06d}", "cls": str(i).encode()}
            if i == 5:
                sample["png"] = _png(i, 3, 40)
            elif i == 9:  # a valid header, a broken body
                sample["jpg"] = _jpeg(i, (48, 64))[:400]
            else:
                sample["jpg"] = _jpeg(i, sizes[i % 3])
            w.write(sample)
    info = ShardInfo("train-000000.tar", 24, (root / "train-000000.tar").stat().st_size, "0" * 64)
    write_manifest(root, Manifest(splits={"train": SplitInfo(24, [info])}, channels=3,
                                  class_names=[str(k) for k in range(24)], image_size=None,
                                  mean=[0.5] * 3, std=[0.25] * 3))  # fmt: skip
    kw = dict(global_batch=8, img_size=32, num_workers=2, timeout=TIMEOUT)
    cpu = _epoch(make_train_loader(root, "train", **kw))
    loader = make_train_loader(root, "train", decode="gpu", device="cpu", **kw)
    gpu = _epoch(loader)
    assert loader.num_skipped == 1 and 9 not in torch.cat(gpu[1]).tolist()
    compared = 0
    for a, b, la, lb in zip(cpu[0], gpu[0], cpu[1], gpu[1], strict=True):
        assert a.shape == b.shape == (8, 3, 32, 32) and b.dtype == torch.uint8
        if la.tolist() != lb.tolist():  # the batch that held the broken JPEG: filled apart
            continue
        diff = (a.float() - b.float()).abs().mean(dim=(1, 2, 3))
        assert (diff < 1.0).all(), diff
        compared += 1
    assert compared == 2
    with pytest.raises(ValueError, match="needs a device"):
        make_train_loader(root, "train", decode="gpu", **kw)


def _subset_file(path: Path, values) -> Path:
    path.write_text(json.dumps(values))
    return path


def test_subset_file_trains_on_the_listed_samples_only(tmp_path: Path) -> None:
    """data.subset_file: both loaders train on the listed samples and no other (in RAM each
    once an epoch), the held-out ones staying out through the same exclusions as
    data.train_fraction."""
    root = make_set(tmp_path / "set", [100, 100, 100])
    held = set(held_out_indices(300, 0.1).tolist())
    listed = [i for i in range(0, 300, 7) if i not in held]  # across all three shards
    keep = read_subset_file(_subset_file(tmp_path / "subset.json", listed), 300, 0.1)
    assert keep.dtype == np.int64 and keep.tolist() == listed
    unused = excluded_indices(300, 0.1, subset=keep)
    assert sorted(set(range(300)) - set(unused.tolist())) == listed
    for in_memory in (False, True):
        loader = _train(root, global_batch=4, holdout_fraction=0.1, subset=keep,
                        augment=False, in_memory=in_memory)  # fmt: skip
        labels = torch.cat(_epoch(loader)[1]).tolist()
        assert len(labels) == 4 * (len(listed) // 4) and set(labels) <= set(listed)
        if in_memory:
            assert len(set(labels)) == len(labels)  # each once; the remainder waits a batch
    with pytest.raises(ValueError, match="or list more samples in the subset"):
        _train(root, global_batch=16, subset=keep[:3])
    with pytest.raises(ValueError, match="not both"):
        excluded_indices(300, 0.1, train_fraction=0.5, subset=keep)


@pytest.mark.parametrize(
    "body,why",
    [
        ("[1, 2", "not JSON"),
        ('{"indices": [1, 2]}', "holds dict"),
        ("[]", "holds list"),
        ("[1, true]", "lists true, not a manifest index"),
        ("[1, 2.0]", "lists 2.0, not a manifest index"),
        ("[-1, 2]", "lists -1, not a manifest index"),
        ('[1, "2"]', 'lists "2", not a manifest index'),
        ("[3, 2]", "not sorted, or one repeats"),
        ("[2, 2]", "not sorted, or one repeats"),
        ("[1, 300]", "index 300, past the 300 samples"),
        ("[1, 100000000000000000000000]", "past the 300 samples"),
        ("[" * 100000, "not JSON"),
    ],
)
def test_a_bad_subset_file_is_one_line_naming_it(tmp_path: Path, body: str, why: str) -> None:
    path = tmp_path / "subset.json"
    path.write_text(body)
    with pytest.raises(ValueError) as e:
        read_subset_file(path, 300, 0.0)
    assert str(e.value).startswith(f"{path}: ") and why in str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_a_subset_file_with_a_held_out_index_or_no_file_is_refused(tmp_path: Path) -> None:
    held = held_out_indices(300, 0.1)
    path = _subset_file(tmp_path / "subset.json", [0, int(held[0])] if held[0] else [int(held[0])])
    with pytest.raises(
        ValueError, match=rf"subset.json: lists 1 held-out index\(es\) \(first {held[0]};"
    ):
        read_subset_file(path, 300, 0.1)
    assert read_subset_file(path, 300, 0.0).tolist() == json.loads(path.read_text())
    for missing in (tmp_path / "nope.json", tmp_path):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(missing))}: cannot read"):
            read_subset_file(missing, 300, 0.0)
    big = tmp_path / "big.json"
    with big.open("wb") as f:  # sparse: the size is refused before a byte is read
        f.truncate(MAX_SUBSET_BYTES + 1)
    with pytest.raises(ValueError, match="more than the 67108864 a subset file may hold"):
        read_subset_file(big, 300, 0.0)
