"""Jobs end to end: determinism, multi-job merge, SIGKILL resume, WebDataset round trip, CLI."""

from __future__ import annotations

import gzip
import io
import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from ssl_vit.data.imaging import ImageOptions
from ssl_vit.data.manifest import load_manifest
from ssl_vit.data.shard_job import JobError, run_job
from ssl_vit.data.shard_plan import ShardOptions, make_plan
from ssl_vit.data.sources import open_source

REPO = Path(__file__).resolve().parents[1]
MAKE = str(REPO / "data_prep" / "make_shards.py")
VERIFY = str(REPO / "data_prep" / "verify_shards.py")


def corpus(root: Path, n: int, classes: int = 3, size: int = 12, start: int = 0) -> Path:
    rng = np.random.default_rng(start)
    for i in range(start, start + n):
        path = root / f"class{i % classes}" / f"img.{i:04d}.png"  # a dot inside the stem
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return root


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def opts(**kw) -> ShardOptions:
    base = {"image": ImageOptions(mode="auto"), "shard_size": 7, "val_fraction": 0.25}
    return ShardOptions(**{**base, **kw})


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_deterministic_across_runs_and_worker_counts(tmp_path):
    src = corpus(tmp_path / "src", 40)
    run_job(src, tmp_path / "a", opts(), workers=1)
    run_job(src, tmp_path / "b", opts(), workers=2)
    a, b = snapshot(tmp_path / "a"), snapshot(tmp_path / "b")
    assert a == b
    m = load_manifest(tmp_path / "a")
    assert set(m.splits) == {"train", "val"} and m.splits["train"].num_samples > 0
    assert sum(s.num_samples for s in m.splits.values()) == 40
    with tarfile.open(tmp_path / "a" / "train-000000.tar") as tar:
        members = tar.getmembers()
    assert all(t.mtime == 0 and t.uid == 0 and t.gid == 0 and t.uname == "" for t in members)
    names = [t.name for t in members]
    keys = [n.split(".", 1)[0] for n in names]
    assert keys == sorted(keys, key=keys.index)  # each sample's members are contiguous
    assert names[:3] == sorted(names[:3])  # cls, json, png in sorted order


def test_multi_job_merge_equals_single_job(tmp_path):
    src = corpus(tmp_path / "src", 40)
    run_job(src, tmp_path / "single", opts(), workers=1)
    multi = tmp_path / "multi"
    for j in (2, 0):
        s = run_job(src, multi, opts(), num_jobs=3, job_index=j)
        assert not s.merged and not (multi / "manifest.json").exists()
    with pytest.raises(JobError, match="not written yet"):
        run_job(src, multi, opts(), merge_only=True)
    run_job(src, multi, opts(), num_jobs=3, job_index=1)
    assert run_job(src, multi, opts(), merge_only=True).merged
    assert snapshot(multi) == snapshot(tmp_path / "single")
    assert not (multi / ".work").exists()


def test_resume_after_sigkill_is_byte_identical(tmp_path):
    src = corpus(tmp_path / "src", 300, size=16)
    args = ["--shard-size", "10", "--workers", "1", "--format", "png", "--val-fraction", "0.1"]
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, MAKE, str(src), str(out), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((out / ".work").glob("*-g*.json"))) >= 2:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists(), "the job finished before it could be killed"
    assert not list(out.glob("*.tar"))  # nothing under a final name yet
    rerun = cli(MAKE, str(src), str(out), *args)
    assert rerun.returncode == 0, rerun.stderr
    reused = int(rerun.stdout.split(" reused")[0].rsplit(" ", 1)[-1])
    assert reused >= 2
    clean = cli(MAKE, str(src), str(tmp_path / "clean"), *args)
    assert clean.returncode == 0
    assert snapshot(out) == snapshot(tmp_path / "clean")
    assert not (out / ".work").exists()


def test_round_trip_with_plain_webdataset(tmp_path):
    src = corpus(tmp_path / "src", 20)
    run_job(src, tmp_path / "out", opts(val_fraction=0.0))
    m = load_manifest(tmp_path / "out")
    urls = [str(p) for p in m.shard_paths("train")]
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))
    assert len(samples) == 20 == m.splits["train"].num_samples
    assert len({s["__key__"] for s in samples}) == 20
    for s in samples:
        meta = s["json"]
        assert "." not in s["__key__"] and "/" not in s["__key__"]
        assert s["cls"] == int(meta["source"].split("/")[0].removeprefix("class"))
        original = Image.open(src / meta["source"])
        assert meta["original_size"] == [original.height, original.width]
        assert np.array_equal(np.asarray(s["png"]), np.asarray(original))  # kept losslessly
    assert m.class_names == ["class0", "class1", "class2"] and m.channels == 3


def test_shard_bytes_limit_and_count(tmp_path):
    src = corpus(tmp_path / "src", 30, size=24)
    out = tmp_path / "out"
    run_job(src, out, opts(shard_size=1000, shard_bytes=8192, val_fraction=0.0))
    shards = load_manifest(out).splits["train"].shards
    assert len(shards) > 1 and sum(s.num_samples for s in shards) == 30
    assert all(s.bytes <= 8192 and (out / s.name).stat().st_size == s.bytes for s in shards)


def test_split_assignment_stable_when_files_are_added(tmp_path):
    src = corpus(tmp_path / "src", 60)
    o = opts(val_fraction=0.2, test_fraction=0.2)
    before = {it.rel: g.split for g in make_plan(open_source(src), o) for it in g.items}
    corpus(src, 60, start=60)
    after = {it.rel: g.split for g in make_plan(open_source(src), o) for it in g.items}
    assert len(after) == 120 and all(after[rel] == split for rel, split in before.items())
    assert set(before.values()) == {"train", "val", "test"}


def write_idx(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write((0x803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (n, h, w)))
        f.write(images.tobytes())
    with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write((0x801).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.tobytes())


def test_idx_set_png_gray_and_train_stats(tmp_path):
    rng = np.random.default_rng(1)
    train = rng.integers(0, 256, (12, 5, 4), dtype=np.uint8)
    write_idx(tmp_path / "fashion", "train", train, rng.integers(0, 10, 12, dtype=np.uint8))
    write_idx(tmp_path / "fashion", "t10k", train[:3] // 2, np.zeros(3, dtype=np.uint8))
    run_job(tmp_path / "fashion", tmp_path / "out", ShardOptions(image=ImageOptions(mode="auto")))
    m = load_manifest(tmp_path / "out")
    assert m.channels == 1 and m.image_size == [5, 4] and m.stats_split == "train"
    assert (m.splits["train"].num_samples, m.splits["test"].num_samples) == (12, 3)
    assert m.class_names[0] == "T-shirt/top"
    assert m.mean[0] == pytest.approx(train.mean() / 255, abs=1e-6)
    assert m.std[0] == pytest.approx(train.std() / 255, abs=1e-6)
    with tarfile.open(m.shard_paths("train")[0]) as tar:
        png = next(t for t in tar.getmembers() if t.name.endswith(".png"))
        assert png.name.startswith("train_0000")
        img = Image.open(io.BytesIO(tar.extractfile(png).read()))
        assert img.format == "PNG" and img.mode == "L"
    assert m.created_by["options"]["image"]["mode"] == "L"


def test_cli_summary_verify_and_rerun(tmp_path):
    src = corpus(tmp_path / "src", 12)
    (src / "class0" / "bad.png").write_bytes(b"")
    out = tmp_path / "out"
    r = cli(MAKE, str(src), str(out), "--workers", "2", "--shard-size", "5")
    assert r.returncode == 0 and "kept 12 images, skipped 1" in r.stdout
    assert "make_shards" in r.stderr or r.stderr == ""  # log lines only, no traceback
    v = cli(VERIFY, str(out))
    assert v.returncode == 0 and v.stdout.rstrip().endswith("OK")
    again = cli(MAKE, str(src), str(out), "--workers", "2", "--shard-size", "5")
    assert again.returncode == 0 and "already complete" in again.stdout
    shard = out / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = cli(VERIFY, str(out))
    assert bad.returncode == 1 and "train-000001.tar: sha256 differs" in bad.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    n = manifest["splits"]["train"]["shards"][0]["num_samples"]
    manifest["splits"]["train"]["shards"][0]["num_samples"] += 1
    for key in ("offsets", "block_sha256"):  # else the manifest itself is refused
        del manifest["splits"]["train"]["shards"][0][key]
    manifest["splits"]["train"]["num_samples"] += 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert f"train-000000.tar: {n} samples, manifest says {n + 1}" in cli(VERIFY, str(out)).stderr


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--missing"], "source not found"),
        (["--other-set"], "holds a different shard set"),
        (["--resize", "shorter"], "--resize and --size go together"),
        (["--num-jobs", "2", "--job-index", "5"], "--job-index 5 must be in"),
        (["--shard-bytes", "lots"], "is not a size"),
    ],
)
def test_cli_bad_arguments_one_line_error(tmp_path, extra, message):
    src = corpus(tmp_path / "src", 3)
    out = tmp_path / "out"
    if extra == ["--missing"]:
        src, extra = tmp_path / "no-such-folder", []
    if extra == ["--other-set"]:
        assert cli(MAKE, str(src), str(out), "--shard-size", "2", "--workers", "1").returncode == 0
        extra = ["--shard-size", "3"]
    r = cli(MAKE, str(src), str(out), "--workers", "1", *extra)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_hand_written_tar_bytes_equal_tarfile_ustar():
    """shard_writer writes tar headers by hand (speed); the bytes must be tarfile's own."""
    import io
    import tarfile

    from ssl_vit.data.shard_writer import _END, sample_blob, sample_members, sample_meta

    members = sample_members(
        "a/000123", "png", b"\x89PNG" + bytes(700), 7, sample_meta("x.png", (28, 28))
    )
    members += sample_members("b/9", "jpg", b"\xff\xd8" * 300, None, sample_meta("d/é.jpg", (5, 9)))
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), 0o644, 0, 0, 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    ours = sample_blob(members) + _END
    assert ref.getvalue()[: len(ours)] == ours
    assert not ref.getvalue()[len(ours) :].strip(b"\0")  # tarfile pads the record with zeros
