"""Untrusted files and network exposure, checked with real files and real processes.

- A crafted pickle that would run code, placed where a backbone's weights belong, is refused by
  the loader and by an eval command line; the code never runs (its marker file never appears).
- data_prep skips symlinks leaving the source folder unless --follow-symlinks.
- A decompression bomb (tiny file, huge declared size) is refused by data_prep.
- The MLflow UI/server command we document binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, run_cli
from PIL import Image


class _RunsCode:
    """Unpickling this calls os.system: it writes `marker` (what an attacker's payload does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _evil_export(folder: Path, marker: Path) -> Path:
    """An export folder whose weights file is a code-running pickle (as torch.save would write)."""
    folder.mkdir(parents=True)
    meta = {"format_version": 1, "arch": "vit_tiny_patch16_224",
            "kwargs": {"img_size": 16, "patch_size": 4, "in_chans": 1, "depth": 1,
                       "embed_dim": 32, "num_heads": 2},
            "mean": [0.5], "std": [0.5]}  # fmt: skip
    (folder / "backbone.json").write_text(json.dumps(meta))
    payload = pickle.dumps({"state_dict": _RunsCode(marker)})
    (folder / "backbone.safetensors").write_bytes(payload)
    (folder / "backbone.pt").write_bytes(payload)  # a tempting neighbour for a careless loader
    return folder


def test_crafted_pickle_backbone_is_refused_in_process(tmp_path):
    from ssl_vit.models import load_backbone

    marker = tmp_path / "pwned"
    folder = _evil_export(tmp_path / "export", marker)
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do; running the code will not
        load_backbone(folder)
    assert not marker.exists()


def test_crafted_pickle_backbone_is_refused_by_eval_cli(tiny_shards, tmp_path):
    marker = tmp_path / "pwned"
    folder = _evil_export(tmp_path / "export", marker)
    proc = run_cli(
        ["evals/knn.py", "--backbone", str(folder), "--data", str(tiny_shards), "--no-mlflow",
         "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "knn.json")],
        timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert not marker.exists(), "unpickling ran the attacker's code"
    assert not (tmp_path / "knn.json").exists()


def _png(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(path)
    return path


def _sources(out: Path) -> set[str]:
    import tarfile

    found = set()
    for tar in out.glob("*.tar"):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                if m.name.endswith(".json"):
                    found.add(json.loads(t.extractfile(m).read())["source"])
    return found


def test_data_prep_does_not_follow_symlinks_out_of_source(tmp_path):
    src = tmp_path / "src"
    for i in range(4):
        _png(src / "cat" / f"{i}.png", i)
    secret = _png(tmp_path / "outside" / "secret.png", 99)
    (src / "cat" / "link.png").symlink_to(secret)
    (src / "dog").symlink_to(tmp_path / "outside", target_is_directory=True)

    proc = run_cli(["data_prep/make_shards.py", str(src), str(tmp_path / "a"), "--workers", "1"])
    assert proc.returncode == 0, proc.stderr
    kept = _sources(tmp_path / "a")
    assert kept and not any("link" in s or "secret" in s for s in kept), kept
    errors = (tmp_path / "a" / "errors.jsonl").read_text()
    assert "outside the source folder" in errors and "--follow-symlinks" in errors

    proc = run_cli(["data_prep/make_shards.py", str(src), str(tmp_path / "b"), "--workers", "1",
                    "--follow-symlinks"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert any("link" in s for s in _sources(tmp_path / "b"))


def _png_bomb(path: Path, side: int) -> Path:
    """A valid PNG declaring side x side gray pixels, all zero: a few KB on disk, side^2 in RAM."""
    import struct

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    comp = zlib.compressobj(9)
    row = b"\x00" * (side + 1)  # filter byte + pixels
    body = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body)
                     + chunk(b"IEND", b""))  # fmt: skip
    return path


def test_decompression_bomb_is_refused(tmp_path):
    src = tmp_path / "src"
    for i in range(3):
        _png(src / f"ok{i}.png", i)
    bomb = _png_bomb(src / "bomb.png", 20_000)  # 4e8 pixels declared
    assert bomb.stat().st_size < 1_000_000
    proc = run_cli(["data_prep/make_shards.py", str(src), str(tmp_path / "out"), "--workers", "1"],
                   timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    errors = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert [e["source"] for e in errors] == ["bomb.png"]
    assert "pixels" in errors[0]["reason"].lower()
    assert len(_sources(tmp_path / "out")) == 3


def test_documented_mlflow_commands_bind_localhost():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for line in "\n".join(p.read_text() for p in docs).splitlines():
        # the commands we document never widen the bind
        if "mlflow ui" in line or "mlflow server" in line:
            assert "0.0.0.0" not in line, line
