"""The shard tar reader against Python's tarfile and webdataset's grouping."""

from __future__ import annotations

import io
import itertools
import re
import tarfile
import time
from pathlib import Path

import pytest
import webdataset as wds

from ssl_vit.data.tar_reader import (
    MAX_MEMBER,
    MAX_SAMPLE_MEMBERS,
    TarFormatError,
    iter_samples,
    read_samples,
    sample_key,
)


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


def _refield(raw: bytes, at: int, start: int, field: bytes) -> bytes:
    """`raw` with `field` written at byte `start` of the header at `at`, checksum recomputed."""
    data = bytearray(raw)
    data[at + start : at + start + len(field)] = field
    data[at + 148 : at + 156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(data[at : at + 512])
    return bytes(data)


class _Stream:
    """A stream that cannot seek, recording the size of every read asked of it."""

    def __init__(self, data: bytes) -> None:
        self.f, self.asked = io.BytesIO(data), []

    def read(self, n: int) -> bytes:
        self.asked.append(n)
        return self.f.read(n)


def test_a_base256_size_reads_as_its_octal_twin(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    _tar(path, [("k.cls", b"12345"), ("k.png", b"png")], tarfile.USTAR_FORMAT)
    raw = path.read_bytes()
    twin = _refield(raw, 0, 124, b"\x80" + (5).to_bytes(11, "big"))  # GNU base-256 for 5
    assert twin != raw
    ours = list(read_samples(io.BytesIO(twin), "t"))
    assert ours == list(read_samples(io.BytesIO(raw), "t"))
    assert ours[0][1]["cls"] == b"12345"


def test_a_declared_size_is_checked_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    _tar(path, [("k.cls", b"1")], tarfile.USTAR_FORMAT)
    raw = path.read_bytes()
    huge = _refield(raw, 0, 124, b"%011o\0" % (8**11 - 1))  # 8 GiB: the largest octal size
    stream = _Stream(huge)
    with pytest.raises(TarFormatError) as caught:
        list(read_samples(stream, "t"))
    assert str(caught.value) == (
        f"t: the tar header at byte 0 declares {8**11 - 1} bytes, more than a shard member may "
        f"hold ({MAX_MEMBER})"
    )
    assert stream.asked == [512]  # the header alone
    past = _refield(raw, 0, 124, b"%011o\0" % 50_000)  # fits the limit, not the file
    with pytest.raises(TarFormatError) as caught:
        list(read_samples(io.BytesIO(past), "t"))
    left = len(raw) - 512
    assert str(caught.value) == (
        f"t: cut short inside a member (the header at byte 0 declares 50000 bytes, {left} are left)"
    )


def test_a_sample_that_never_ends_is_refused_not_gathered(tmp_path: Path) -> None:
    """One key across more members than a sample holds: the reader stops at the first member
    past the limit with a line naming the shard and the sample, after the samples before it."""
    fields = [(f"big.f{j}", b"x") for j in range(MAX_SAMPLE_MEMBERS + 1)]
    path = tmp_path / "shard.tar"
    _tar(path, [("ok.cls", b"1"), *fields], tarfile.USTAR_FORMAT)
    samples = read_samples(_Stream(path.read_bytes()), "t")  # a stream: no seek, no size
    assert next(samples)[1] == {"__key__": "ok", "__url__": "t", "cls": b"1"}
    with pytest.raises(TarFormatError) as caught:
        next(samples)
    assert str(caught.value).startswith(
        f"t: the sample 'big' at byte 1024 goes past {MAX_SAMPLE_MEMBERS} members or "
        f"{MAX_MEMBER} bytes at big.f{MAX_SAMPLE_MEMBERS};"
    )
    _tar(path, fields[:-1], tarfile.USTAR_FORMAT)  # at the limit: one sample, every field
    (sample,) = list(iter_samples(path))
    assert len(sample) == MAX_SAMPLE_MEMBERS + 2


def test_every_pax_record_is_parsed(tmp_path: Path) -> None:
    """Records besides `path` (with spaces and `=` in their values) are read past."""
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [("k.cls", b"1"), ("k\u00e9.png", b"png")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.pax_headers = {"comment": "a b=c\n", "mtime": "1.5"}
            tar.addfile(info, io.BytesIO(data))
    ours = list(iter_samples(path))
    assert ours == list(wds.tarfile_samples([{"url": str(path)}]))
    assert [s["__key__"] for s in ours] == ["k", "k\u00e9"]


_WEBDATASET_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext


def test_sample_key_is_webdataset_pattern_in_linear_time() -> None:
    for n in range(8):  # every name of up to 7 characters of a / . and a line break
        for chars in itertools.product("a./\n", repeat=n):
            name = "".join(chars)
            match = _WEBDATASET_KEY.match(name)
            assert sample_key(name) == (match and (match.group(1), match.group(2).lower())), name
    assert sample_key("d/Key.PNG.Json") == ("d/Key", "png.json")
    start = time.perf_counter()
    assert sample_key("/" * 1_000_000 + "a") is None  # the pattern: quadratic, hours
    assert time.perf_counter() - start < 0.5
