"""The manifest's byte-offset index of each shard, and --num-shards."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from ssl_vit.data.imaging import ImageOptions
from ssl_vit.data.manifest import Manifest, ShardInfo, SplitInfo, load_manifest, write_manifest
from ssl_vit.data.shard_job import INDEX_EVERY, index_stride, run_job
from ssl_vit.data.shard_plan import ShardOptions, make_plan
from ssl_vit.data.shard_verify import verify_shard_set
from ssl_vit.data.sources import open_source
from ssl_vit.data.tar_reader import sample_offsets

REPO = Path(__file__).resolve().parents[1]
MAKE = str(REPO / "data_prep" / "make_shards.py")
VERIFY = str(REPO / "data_prep" / "verify_shards.py")


def corpus(root: Path, n: int, classes: int = 3, size: int = 8) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        path = root / f"class{i % classes}" / f"img.{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return root


def opts(**kw) -> ShardOptions:
    base = {"image": ImageOptions(mode="auto"), "shard_size": 250, "val_fraction": 0.1}
    return ShardOptions(**{**base, **kw})


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def keys_of(path: Path) -> list[str]:
    """Sample keys in order, as webdataset (which ssl_vit.data.tar_reader mirrors) groups them."""
    return [s["__key__"] for s in wds.WebDataset(str(path), shardshuffle=False)]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    """Source and shard set: 600 inputs, shards of up to 250, so some shards hold 3 indexed
    samples and the last train shard a partial stride."""
    tmp = tmp_path_factory.mktemp("index")
    src = corpus(tmp / "src", 600)
    run_job(src, tmp / "out", opts(), workers=1)
    return src, tmp / "out"


# ----------------------------------------------------------------------------- the index


def test_offsets_point_at_each_indexed_samples_first_member(made):
    _, out = made
    m = load_manifest(out)
    counts = [sh.num_samples for s in m.splits.values() for sh in s.shards]
    k = m.index_every
    assert k == index_stride(counts) == min(INDEX_EVERY, min(counts) // 20) and k > 1
    for split in m.splits:
        for sh, path in zip(m.split(split).shards, m.shard_paths(split), strict=True):
            keys = keys_of(path)
            assert len(keys) == sh.num_samples
            assert sh.offsets is not None and len(sh.offsets) == -(-len(keys) // k)
            assert sh.offsets[0] == 0
            with open(path, "rb") as f:
                for i, offset in enumerate(sh.offsets):
                    f.seek(offset)
                    info = tarfile.TarInfo.frombuf(f.read(512), "utf-8", "surrogateescape")
                    assert info.name.split(".", 1)[0] == keys[i * k]
                    assert info.name.endswith(".cls")  # a sample's first member, sorted order
            # A reader seeking to an offset reads whole samples from there on.
            with open(path, "rb") as f:
                f.seek(sh.offsets[-1])
                tail = tarfile.open(fileobj=io.BytesIO(f.read()), mode="r:")
                names = tail.getnames()
            assert len({n.split(".", 1)[0] for n in names}) == len(keys) - (len(sh.offsets) - 1) * k


def test_sample_offsets_every_one_and_foreign_tars(tmp_path):
    """tarfile-written tars: GNU long names start their sample at the long-name header,
    directories and extensionless files belong to no sample."""
    path = tmp_path / "t.tar"
    long_key = "d/" + "k" * 120
    starts = []  # where each sample's first member begins
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:

        def add(name: str, kind: bytes = tarfile.REGTYPE, first: bool = False) -> None:
            if first:
                starts.append(tar.offset)
            info = tarfile.TarInfo(name)
            info.type, info.size = kind, 700 if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(b"x" * info.size))

        add("a.cls", first=True)
        add("a.png")
        add("somedir", tarfile.DIRTYPE)
        add("README")
        add(f"{long_key}.cls", first=True)  # preceded by a GNU long-name member
        add(f"{long_key}.png")
        add("b.cls", first=True)
    with open(path, "rb") as f:
        assert sample_offsets(f, 1) == starts
        assert sample_offsets(f, 2) == [starts[0], starts[2]]
        assert sample_offsets(f, 100) == [0]
    assert keys_of(path) == ["a", long_key, "b"]  # webdataset groups them the same way
    with open(path, "rb") as f:
        f.seek(starts[1])
        assert (
            tarfile.open(fileobj=io.BytesIO(f.read()), mode="r:").getnames()[0].startswith(long_key)
        )


def test_sample_offsets_rejects_a_cut_tar(made):
    _, out = made
    data = (out / "train-000000.tar").read_bytes()
    second = load_manifest(out).splits["train"].shards[0].offsets[1]
    with pytest.raises(ValueError, match="cut short inside a tar header"):
        sample_offsets(io.BytesIO(data[: second + 300]), 100)
    with pytest.raises(ValueError, match="cut short inside a member"):
        sample_offsets(io.BytesIO(data[: second + 512]), 100)  # its .cls holds a digit or two
    corrupt = bytearray(data)
    corrupt[second + 10] ^= 0x01
    with pytest.raises(ValueError, match="checksum"):
        sample_offsets(io.BytesIO(bytes(corrupt)), 100)


def test_manifest_identical_across_workers_and_jobs(made, tmp_path):
    src, out = made
    run_job(src, tmp_path / "two", opts(), workers=2)
    multi = tmp_path / "multi"
    for j in (1, 0):
        run_job(src, multi, opts(), num_jobs=2, job_index=j)
    run_job(src, multi, opts(), merge_only=True)
    assert snapshot(tmp_path / "two") == snapshot(out) == snapshot(multi)


def test_resumed_parts_get_offsets_too(made, tmp_path):
    """A merge over parts left by earlier runs reads their offsets from the parts."""
    src, out = made
    resumed = tmp_path / "resumed"
    run_job(src, resumed, opts(), num_jobs=2, job_index=0)
    run_job(src, resumed, opts(), num_jobs=2, job_index=1)
    run_job(src, resumed, opts(), workers=2)  # every group verified and reused, then merged
    assert snapshot(resumed) == snapshot(out)


def test_old_manifest_without_index_loads_and_serialises_unchanged(tmp_path):
    old = {
        "format": "ssl-vit-shards",
        "format_version": 1,
        "splits": {
            "train": {
                "num_samples": 3,
                "shards": [
                    {"name": "train-000000.tar", "num_samples": 3, "bytes": 10, "sha256": "ab" * 32}
                ],
            }
        },
        "class_names": None,
        "channels": 1,
        "image_size": None,
        "mean": [0.5],
        "std": [0.25],
        "stats_split": "train",
        "num_skipped": 0,
        "created_by": {"tool": "x"},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    m = load_manifest(tmp_path)
    assert m.index_every is None and m.splits["train"].shards[0].offsets is None
    assert m.to_json() == old
    assert list(m.to_json()) == list(old)  # key order kept


def test_to_json_key_order_with_index():
    m = Manifest(
        splits={"train": SplitInfo(2, [ShardInfo("train-000000.tar", 2, 10, "ab", [0])])},
        class_names=None,
        channels=1,
        image_size=None,
        mean=[0.5],
        std=[0.25],
        index_every=100,
    )
    body = m.to_json()
    assert list(body["splits"]["train"]["shards"][0]) == [
        "name", "num_samples", "bytes", "sha256", "offsets"
    ]  # fmt: skip
    keys = list(body)
    assert (
        keys.index("num_skipped") + 1 == keys.index("index_every") == keys.index("created_by") - 1
    )


def test_verify_catches_a_wrong_offset(made, tmp_path):
    _, out = made
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in snapshot(out).items():
        (copy / name).write_bytes(data)
    assert verify_shard_set(copy).ok
    m = load_manifest(copy)
    sh = m.splits["train"].shards[0]
    bad = ShardInfo(
        sh.name,
        sh.num_samples,
        sh.bytes,
        sh.sha256,
        [sh.offsets[0], sh.offsets[1] + 512, *sh.offsets[2:]],
    )
    m.splits["train"].shards[0] = bad
    write_manifest(copy, m)
    r = cli(VERIFY, str(copy), "--no-decode")
    assert r.returncode == 1
    problems = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(problems) == 1
    assert (
        f"{sh.name}: offsets[1] = {sh.offsets[1] + 512} is not where sample {m.index_every} starts"
        in (problems[0])
    )
    m.splits["train"].shards[0] = ShardInfo(
        sh.name, sh.num_samples, sh.bytes, sh.sha256, sh.offsets[:-1]
    )
    write_manifest(copy, m)
    report = verify_shard_set(copy, decode=False)  # a count that disagrees: refused at load
    assert report.problems == [
        f"{copy / 'manifest.json'}: split 'train' shard 0 key 'offsets' has "
        f"{len(sh.offsets) - 1} entries; {sh.num_samples} samples indexed every {m.index_every} "
        f"need {len(sh.offsets)}; re-create the manifest with data_prep/make_shards.py"
    ]


# ----------------------------------------------------------------------------- --num-shards


@pytest.mark.parametrize("n", [1, 3, 7, 40])
def test_num_shards_gives_n_balanced_train_shards(made, n):
    src, _ = made
    listing = open_source(src)
    groups = make_plan(listing, opts(shard_size=5000, num_shards=n))
    for split in ("train", "val"):
        sizes = [len(g.items) for g in groups if g.split == split]
        assert len(sizes) == n and max(sizes) - min(sizes) <= 1  # val: over 40 samples
    assert sum(len(g.items) for g in groups) == 600


def test_num_shards_exact_where_ceil_sizes_would_fall_short(tmp_path):
    """10 samples in 6 shards: shards of ceil(10 / 6) = 2 would make only 5."""
    src = corpus(tmp_path / "src", 10)
    groups = make_plan(open_source(src), opts(val_fraction=0.0, num_shards=6))
    assert sorted(len(g.items) for g in groups) == [1, 1, 2, 2, 2, 2]
    assert [g.index for g in groups] == list(range(6))


def test_num_shards_end_to_end_and_rerun(tmp_path):
    src = corpus(tmp_path / "src", 23)
    out = tmp_path / "out"
    args = ["--num-shards", "4", "--workers", "1", "--val-fraction", "0.3"]
    r = cli(MAKE, str(src), str(out), *args)
    assert r.returncode == 0, r.stderr
    m = load_manifest(out)
    assert len(m.splits["train"].shards) == 4
    sizes = [s.num_samples for s in m.splits["train"].shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == m.splits["train"].num_samples
    assert m.created_by["options"]["num_shards"] == 4
    assert m.created_by["options"]["shard_size"] is None
    assert verify_shard_set(out).ok
    again = cli(MAKE, str(src), str(out), *args)
    assert again.returncode == 0 and "already complete" in again.stdout
    other = cli(
        MAKE, str(src), str(out), "--num-shards", "5", "--workers", "1", "--val-fraction", "0.3"
    )
    assert other.returncode == 1 and "holds a different shard set" in other.stderr
    default = cli(MAKE, str(src), str(out), "--workers", "1", "--val-fraction", "0.3")
    assert default.returncode == 1 and "holds a different shard set" in default.stderr


def test_default_options_record_no_num_shards():
    """Sets made before --num-shards existed keep the same recorded options (reruns no-op)."""
    body = ShardOptions().to_json()
    assert "num_shards" not in body and body["shard_size"] == 5000


def test_num_shards_more_than_train_samples_is_an_error(tmp_path):
    src = corpus(tmp_path / "src", 10)
    with pytest.raises(
        ValueError, match="--num-shards 11 is more than the 10 samples of the train"
    ):
        make_plan(open_source(src), opts(val_fraction=0.0, num_shards=11))
    r = cli(MAKE, str(src), str(tmp_path / "out"), "--num-shards", "11", "--workers", "1")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "more than the 10 samples of the train split" in r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.tar"))


def test_num_shards_caps_a_smaller_held_out_split(tmp_path):
    src = corpus(tmp_path / "src", 40)
    groups = make_plan(open_source(src), opts(val_fraction=0.1, num_shards=20))
    val = [len(g.items) for g in groups if g.split == "val"]
    assert len([g for g in groups if g.split == "train"]) == 20
    assert 0 < len(val) < 20 and set(val) == {1}


def test_num_shards_refused_with_shard_size(tmp_path):
    src = corpus(tmp_path / "src", 3)
    r = cli(MAKE, str(src), str(tmp_path / "out"), "--num-shards", "2", "--shard-size", "5")
    assert r.returncode == 2
    assert "not allowed with argument" in r.stderr and "--num-shards" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        ShardOptions(num_shards=0)
