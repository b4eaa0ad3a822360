"""Bad inputs are skipped with a reason in errors.jsonl, and the job still finishes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

from ssl_vit.data.imaging import ImageOptions
from ssl_vit.data.manifest import load_manifest
from ssl_vit.data.shard_job import run_job
from ssl_vit.data.shard_plan import ShardOptions


def noise_png(path: Path, seed: int = 0, size: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    a = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(a).save(path)
    return path


def errors_of(out: Path) -> dict[str, str]:
    lines = (out / "errors.jsonl").read_text().splitlines()
    return {e["source"]: e["reason"] for e in map(json.loads, lines)}


def opts(**kw) -> ShardOptions:
    return ShardOptions(image=ImageOptions(mode="RGB"), **kw)


def make_corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    noise_png(src / "cls" / "good1.png", 1)
    noise_png(src / "cls" / "good2.png", 2)
    (src / "cls" / "zero.png").write_bytes(b"")
    full = noise_png(tmp_path / "scratch" / "t.png", 3, size=64).read_bytes()
    (src / "cls" / "truncated.png").write_bytes(full[: len(full) // 2])
    (src / "cls" / "notimage.png").write_bytes(b"just some text, not pixels\n" * 4)
    (src / "cls" / "page.jpg").write_text("<!DOCTYPE html><html><body>404 Not Found</body></html>")
    os.symlink(src / "cls" / "missing.png", src / "cls" / "dangling.png")
    outside = noise_png(tmp_path / "elsewhere" / "o.png", 4)
    os.symlink(outside, src / "cls" / "outside.png")
    os.symlink(src / "cls" / "good1.png", src / "cls" / "inside.png")  # inside: followed
    return src


def test_bad_inputs_are_recorded_and_skipped(tmp_path):
    src = make_corpus(tmp_path)
    out = tmp_path / "out"
    summary = run_job(src, out, opts())
    errors = errors_of(out)
    assert set(errors) == {
        "cls/zero.png",
        "cls/truncated.png",
        "cls/notimage.png",
        "cls/page.jpg",
        "cls/dangling.png",
        "cls/outside.png",
    }
    assert "empty file" in errors["cls/zero.png"]
    assert "truncated" in errors["cls/truncated.png"]
    assert "not an image" in errors["cls/notimage.png"]
    assert "HTML" in errors["cls/page.jpg"]
    assert "dangling symlink" in errors["cls/dangling.png"]
    assert "outside the source folder" in errors["cls/outside.png"]
    assert (summary.kept, summary.skipped) == (3, 6)  # good1, good2, inside
    m = load_manifest(out)
    assert m.splits["train"].num_samples == 3 and m.num_skipped == 6


def test_follow_symlinks_includes_outside_target(tmp_path):
    src = make_corpus(tmp_path)
    out = tmp_path / "out"
    summary = run_job(src, out, opts(follow_symlinks=True))
    assert "cls/outside.png" not in errors_of(out)
    assert summary.kept == 4


def test_unreadable_file(tmp_path):
    good = noise_png(tmp_path / "good.png")
    if os.geteuid() != 0:
        bad = noise_png(tmp_path / "locked.png")
        bad.chmod(0)
        entry = "locked.png"
    else:  # root reads any mode-000 file; this one fails with EIO for everybody
        entry = "/proc/self/mem"
    (tmp_path / "list.txt").write_text(f"{good.name}\n{entry}\n")
    out = tmp_path / "out"
    summary = run_job(tmp_path / "list.txt", out, opts())
    assert errors_of(out)[entry].startswith("unreadable file")
    assert (summary.kept, summary.skipped) == (1, 1)
