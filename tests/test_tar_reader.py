"""The shard tar reader against Python's tarfile and webdataset's grouping."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from ssl_vit.data.tar_reader import TarFormatError, iter_samples


def _tar(path: Path, members: list[tuple[str, bytes]], fmt: int) -> None:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("somedir")
        info.type = tarfile.DIRTYPE  # not a file: skipped by both readers
        tar.addfile(info)


MEMBERS = [
    ("a/s0.png", b"\x89PNG0"), ("a/s0.cls", b"3"), ("a/s0.json", b"{}"),
    ("a/s1.PNG", b"\x89PNG1" * 300), ("a/s1.cls", b"7"),
    ("d" * 120 + "/s2.seg.png", b"x"),  # a long name: GNU L member, pax path or ustar prefix
    ("noext", b"ignored"), ("a/s3.cls", b""),
    ("b\u00e9/s4.cls", b"1"),  # a non-ASCII name: pax path record
]  # fmt: skip


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_samples_equal_webdataset_on_every_tar_format(tmp_path: Path, fmt: int) -> None:
    members = [m for m in MEMBERS if fmt != tarfile.USTAR_FORMAT or m[0].isascii()]
    if fmt == tarfile.USTAR_FORMAT:  # ustar: a long directory goes into the prefix field
        members = [(n if len(n) < 100 else "d" * 120 + "/s2.png", d) for n, d in members]
    path = tmp_path / "shard.tar"
    _tar(path, members, fmt)
    ours = list(iter_samples(path))
    theirs = list(wds.tarfile_samples([{"url": str(path)}]))
    assert ours == theirs
    assert [s["__key__"] for s in ours][:2] == ["a/s0", "a/s1"]
    assert ours[1]["png"] == b"\x89PNG1" * 300  # extension lower-cased, padding skipped


def test_corrupt_and_cut_short_tars_raise_after_the_good_samples(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    _tar(path, MEMBERS[:5], tarfile.USTAR_FORMAT)
    raw = path.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(raw[: 512 * 7 + 100])  # inside s1.png's contents
    samples = iter_samples(cut)
    assert next(samples)["__key__"] == "a/s0"  # the samples before the damage are read
    with pytest.raises(TarFormatError, match="cut short inside a member"):
        next(samples)
    bad = bytearray(raw)
    bad[512 * 2] ^= 0xFF  # the name of the second header: its checksum no longer matches
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    with pytest.raises(TarFormatError, match="checksum"):
        list(iter_samples(tmp_path / "bad.tar"))
    dup = tmp_path / "dup.tar"
    _tar(dup, [("k.png", b"1"), ("k.png", b"2")], tarfile.USTAR_FORMAT)
    samples = iter_samples(dup)
    assert next(samples) == {"__key__": "k", "__url__": str(dup), "png": b"1"}
    with pytest.raises(TarFormatError, match="appears twice"):
        next(samples)
