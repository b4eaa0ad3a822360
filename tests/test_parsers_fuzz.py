"""The parsers of untrusted storage bytes, fuzzed: whatever a tar or a manifest.json holds, the
tar reader ends or raises TarFormatError, and load_manifest returns or raises ManifestError,
in bounded time and without reads larger than the input.

The suite runs a few hundred examples of each fuzzer; FUZZ_EXAMPLES=20000 (`make fuzz`) runs
more. Every input that once broke a parser is kept below as a plain regression case.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import tarfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssl_vit.data import tar_reader
from ssl_vit.data.manifest import (
    SHARD_NAME,
    Manifest,
    ManifestError,
    ShardInfo,
    SplitInfo,
    is_shard_name,
    load_manifest,
)
from ssl_vit.data.shard_writer import sample_blob, sample_members
from ssl_vit.data.tar_reader import (
    BLOCK,
    MAX_MEMBER,
    TarFormatError,
    iter_samples,
    read_samples,
    sample_offsets,
)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a slow shared machine; the wall-clock guard below bounds each example
    database=None,  # nothing written into the work tree; a failure prints its input
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GUARD_S = 10.0  # one example reads a few KiB six times: milliseconds when nothing hangs


class Hang(Exception):
    """A parser still running at the guard's deadline (a loop that does not advance)."""


@contextlib.contextmanager
def deadline(seconds: float = GUARD_S) -> Iterator[None]:
    """Interrupt the block with Hang after `seconds` (SIGALRM: it stops a pure-Python loop,
    which a thread's timeout could only abandon). Without a main thread it does not guard."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- tars


class File(io.BytesIO):
    """A seekable shard whose reads are checked: none may ask for more than is left (a block
    at most past the end), so a declared size is never trusted before it is checked."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.size = len(data)

    def read(self, n: int | None = -1) -> bytes:
        left = self.size - self.tell()
        assert n is not None and 0 <= n <= max(BLOCK, left), f"read({n}) with {left} bytes left"
        return super().read(n)


class Stream:
    """A stream that cannot seek (a pipe, an HTTP body): no read may ask for more than the
    reader's piece size, as a pipe's read allocates what it is asked for."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        assert 0 <= n <= tar_reader._CHUNK, f"read({n}) of a stream"
        return self._f.read(n)


def header(
    name: bytes = b"k.cls", size: int = 0, kind: bytes = b"0", size_field: bytes | None = None
) -> bytes:
    """A ustar header with a correct checksum, whatever its fields hold."""
    h = bytearray(BLOCK)
    h[: len(name)] = name[:100]
    h[100:108] = b"0000644\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    return fix_checksum(h, 0)


def fix_checksum(data: bytearray, at: int) -> bytes:
    h = data[at : at + BLOCK]
    h[148:156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(h)
    return bytes(data[at : at + BLOCK])


def member(name: bytes, data: bytes, kind: bytes = b"0", size: int | None = None) -> bytes:
    """A member: header, data, zero padding (`size` declares another size than len(data))."""
    declared = len(data) if size is None else size
    return header(name, declared, kind) + data + bytes(-len(data) % BLOCK)


def pax(records: bytes) -> bytes:
    return member(b"PaxHeaders/k", records, b"x")


def pax_record(key: bytes, value: bytes) -> bytes:
    """A well-formed record: its length counts its own digits."""
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


END = bytes(2 * BLOCK)
GOOD = member(b"a.cls", b"1") + member(b"a.png", b"\x89PNG") + END


def our_shard() -> bytes:
    meta = b'{"source": "x"}'
    return b"".join(
        sample_blob(sample_members(f"{i:06d}", "png", b"\x89PNG" * i, i, meta)) for i in range(3)
    ) + END  # fmt: skip


def tarfile_shard(fmt: int) -> bytes:
    """Small tars as tarfile writes them: GNU long names, pax records, a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in [("d" * 120 + "/s0.png", b"png"), ("d/s0.cls", b"3"),
                           ("b\u00e9/s1.cls", b"1"), ("s2.json", b"{}" * 300)]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("somedir")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    return buf.getvalue()


BASES = [our_shard(), tarfile_shard(tarfile.GNU_FORMAT), tarfile_shard(tarfile.PAX_FORMAT)]


def header_offsets(data: bytes) -> list[int]:
    """Where the headers of a valid tar are (walked by their octal sizes)."""
    at, found = 0, []
    while at + BLOCK <= len(data) and data[at : at + BLOCK].count(0) != BLOCK:
        found.append(at)
        size = int(data[at + 124 : at + 136].split(b"\0")[0] or b"0", 8)
        at += BLOCK + size + (-size % BLOCK)
    return found


def read_all(data: bytes, shard: Path) -> dict[str, Any]:
    """Every reader over `data`: its result, or the TarFormatError it raised. Anything else
    (another exception, a read too large, a hang) propagates and fails the test."""
    shard.write_bytes(data)
    readers: dict[str, Callable[[], Any]] = {
        "iter_samples": lambda: list(iter_samples(shard)),
        "seekable": lambda: list(read_samples(File(data), "x")),
        "stream": lambda: list(read_samples(Stream(data), "x")),
        "seekable-skip": lambda: list(read_samples(File(data), "x", skip=lambda i: i % 2 == 0)),
        "stream-skip": lambda: list(read_samples(Stream(data), "x", skip=lambda i: i % 2 == 1)),
        "offsets": lambda: sample_offsets(File(data), 2, "x"),
    }
    out: dict[str, Any] = {}
    with deadline():
        for what, read in readers.items():
            try:
                out[what] = read()
            except TarFormatError as e:
                assert "\n" not in str(e) and str(e).startswith(("x: ", f"{shard}: ")), str(e)
                out[what] = e
    # Where the file can be read whole, a stream of the same bytes reads the same samples.
    if not isinstance(out["seekable"], Exception):
        assert out["stream"] == out["seekable"]
    return out


SIZES = [MAX_MEMBER, MAX_MEMBER + 1, 8**11 - 1, 2**63, 2**64, 2**88 - 1]  # limits and overflows


@st.composite
def damaged_tars(draw: st.DrawFn) -> bytes:
    """A valid small tar with one to four damages: flipped bits, a cut, a pax or GNU record of
    any length inserted, a size field rewritten (base-256, signs, huge), a type or a name
    changed. A rewritten field gets a checksum that matches (and, half the time, so does every
    header at the end), so that the damage reaches the parsing of the fields rather than
    stopping at the checksum."""
    data = bytearray(draw(st.sampled_from(BASES)))
    heads = header_offsets(bytes(data))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "pax", "gnu", "size", "kind", "name"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[draw(st.integers(0, len(data))) :]
        elif op in ("pax", "gnu"):
            if op == "pax":
                length = draw(st.one_of(st.integers(0, 60), st.just(-1)))
                key = draw(st.sampled_from([b"path", b"mtime", b"size", b"", b"path=x"]))
                value = draw(st.binary(max_size=40))
                exact = pax_record(key, value)
                record = exact if length < 0 else b"%d %s=%s\n" % (length, key, value)
                payload = record * draw(st.integers(1, 3)) + draw(st.binary(max_size=8))
            else:
                payload = draw(st.binary(max_size=300))
            size = len(payload) + draw(st.sampled_from([0, 0, 0, -1, 1, 600, 1 << 21]))
            rec = member(b"././@LongLink", payload, b"x" if op == "pax" else b"L", max(size, 0))
            blocks = st.integers(0, len(data) // BLOCK).map(lambda b: b * BLOCK)
            at = draw(st.one_of(st.sampled_from(heads), blocks) if heads else blocks)
            data[at:at] = rec
            heads = [h + len(rec) if h >= at else h for h in heads] + [at]
        elif heads:
            at = draw(st.sampled_from(heads))
            if at + BLOCK > len(data):
                continue
            if op == "size":
                field = draw(
                    st.one_of(
                        st.integers(0, 2**88 - 1).map(lambda n: b"\x80" + n.to_bytes(11, "big")),
                        st.sampled_from(SIZES).map(lambda n: b"\x80" + n.to_bytes(11, "big")),
                        st.binary(min_size=11, max_size=11).map(lambda b: b"\xff" + b),
                        st.integers(0x81, 0xFE).map(lambda b: bytes([b]) + bytes(11)),
                        st.integers(0, 8**11 - 1).map(lambda n: b"%011o\0" % n),
                        st.sampled_from([b"-1", b"+7", b"1_0", b" 9 ", b"\0", b" " * 12, b"-0"]),
                    )
                )
                data[at + 124 : at + 136] = field.ljust(12, b"\0")[:12]
            elif op == "kind":
                data[at + 156] = draw(st.sampled_from(b"0\x0012357LxgKS"))
            else:  # any bytes in the name, the ustar magic or the prefix
                start = draw(st.sampled_from([0, 257, 345]))
                chunk = draw(st.binary(min_size=1, max_size=100))
                data[at + start : at + start + len(chunk)] = chunk  # inside the header block
            if op != "name" or draw(st.booleans()):
                fix_checksum(data, at)
    if draw(st.booleans()):
        for at in heads:
            if at + BLOCK <= len(data):
                fix_checksum(data, at)
    return bytes(data)


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "shard.tar"


@FUZZ
@given(data=damaged_tars())
def test_damaged_tars_end_or_raise_tar_format_error(shard: Path, data: bytes) -> None:
    read_all(data, shard)


@FUZZ
@given(data=st.binary(max_size=3 * BLOCK))
def test_random_bytes_end_or_raise_tar_format_error(shard: Path, data: bytes) -> None:
    read_all(data, shard)


def test_the_fuzzed_tars_are_valid_before_damage(shard: Path) -> None:
    """The bases read whole, so the damages above start from tars that parse."""
    for base in BASES:
        out = read_all(base, shard)
        assert all(not isinstance(v, Exception) for v in out.values()), out
        assert len(out["seekable"]) >= 3


# Inputs that broke the reader before it checked every field (each names what it did).
TAR_REGRESSIONS = [
    # a pax record of length 0 never moved on: training hung at step 0, so did the indexer
    ("pax-length-0", pax(b"0 mtime=1\n") + GOOD, "malformed record at its byte 0"),
    # a pax length that is not a number: ValueError
    ("pax-length-not-a-number", pax(b"abc path=x\n") + GOOD, "malformed record"),
    ("pax-length-past-the-header", pax(b"99 path=x\n") + GOOD, "malformed record"),
    ("pax-record-without-equals", pax(b"8 pathx\n") + GOOD, "malformed record"),
    ("pax-record-after-a-good-one", pax(pax_record(b"path", b"a.cls") + b"3 x") + GOOD,
     "malformed record at its byte 14"),
    # a pax path that is not UTF-8: UnicodeDecodeError
    ("pax-path-not-utf8", pax(pax_record(b"path", b"\xff\xfe.png")) + GOOD,
     "path that is not UTF-8"),
    # a base-256 size beyond any file: OverflowError from read()
    ("base256-size-huge", header(size_field=b"\x80" + (2**80).to_bytes(11, "big")) + GOOD,
     f"declares {2**80} bytes, more than a shard member may hold ({MAX_MEMBER})"),
    # base-256's negative form was read as a huge positive number
    ("base256-size-negative", header(size_field=b"\xff" * 12) + GOOD, "bad size field"),
    # int() took a sign: a size of -1 read the rest of the file as one member
    ("octal-size-negative", header(size_field=b"-0000000001\0") + GOOD, "bad size field"),
    # an 8 GiB member: read() asked for all of it (MemoryError, or a stream's allocation)
    ("size-8gib", header(size=8**11 - 1) + GOOD, "more than a shard member may hold"),
    # more than the file holds: a seekable file is refused before the read
    ("size-past-the-end", header(size=5000) + b"x" * 100, "cut short inside a member"),
    # a name that is not UTF-8: UnicodeDecodeError
    ("name-not-utf8", member(b"\xff\xfe.png", b"1") + END, "has a name that is not UTF-8"),
    ("gnu-long-name-not-utf8", member(b"././@LongLink", b"\xff.png\0", b"L") + GOOD,
     "GNU long name at byte 0 is not UTF-8"),
    ("gnu-long-name-2mib", header(b"././@LongLink", 2 << 20, b"L") + bytes(2 << 20) + GOOD,
     "GNU long name at byte 0 declares 2097152 bytes, more than one may hold"),
]  # fmt: skip


@pytest.mark.parametrize(
    "data,message", [c[1:] for c in TAR_REGRESSIONS], ids=[c[0] for c in TAR_REGRESSIONS]
)
def test_tar_regressions(shard: Path, data: bytes, message: str) -> None:
    out = read_all(data, shard)
    assert isinstance(out["seekable"], TarFormatError), out["seekable"]
    assert message in str(out["seekable"])
    for what in ("iter_samples", "seekable-skip", "offsets"):  # every reader of a file agrees
        assert isinstance(out[what], TarFormatError) and message in str(out[what]), what


def test_a_name_of_slashes_is_read_in_linear_time(shard: Path) -> None:
    """webdataset's key pattern backtracked quadratically on this (hours for 200 KB)."""
    long = b"/" * 200_000 + b"a" * 1000
    data = member(b"././@LongLink", long + b"\0", b"L") + member(b"x", b"1") + GOOD
    out = read_all(data, shard)
    assert [s["__key__"] for _, s in out["seekable"]] == ["a"]


# ----------------------------------------------------------------------------- manifests


def valid_manifest() -> dict[str, Any]:
    """A manifest as make_shards writes it: two splits, an offset index every 2 samples."""
    shards = {
        "train": [ShardInfo(f"train-{i:06d}.tar", 5, 10240, f"{i:064x}", [0, 2048, 4096])
                  for i in range(2)],
        "test": [ShardInfo("test-000000.tar", 2, 4096, "f" * 64, [0])],
    }  # fmt: skip
    m = Manifest(
        splits={k: SplitInfo(sum(s.num_samples for s in v), v) for k, v in shards.items()},
        class_names=["a", "b"],
        channels=1,
        image_size=[28, 28],
        mean=[0.5],
        std=[0.25],
        stats_split="train",
        index_every=2,
        created_by={"tool": "t", "options": {"seed": 0}},
    )
    return m.to_json()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("manifest")


def load(folder: Path, body: Any) -> Manifest:
    text = body if isinstance(body, str | bytes) else json.dumps(body)
    (folder / "manifest.json").write_bytes(text.encode() if isinstance(text, str) else text)
    with deadline():
        return load_manifest(folder)


def assert_sound(m: Manifest) -> None:
    """What every consumer relies on, for a manifest load_manifest accepted."""
    assert m.channels in (1, 3) and len(m.mean) == len(m.std) == m.channels
    assert all(type(v) is float and math.isfinite(v) for v in m.mean + m.std)
    assert m.index_every is None or (type(m.index_every) is int and m.index_every >= 1)
    names = [sh.name for s in m.splits.values() for sh in s.shards]
    assert len(names) == len(set(names))
    for split, s in m.splits.items():
        assert type(s.num_samples) is int and s.num_samples == sum(h.num_samples for h in s.shards)
        for sh in s.shards:
            assert is_shard_name(split, sh.name) and "/" not in sh.name
            assert type(sh.num_samples) is int and sh.num_samples >= 0
            assert type(sh.bytes) is int and sh.bytes >= 0
            if sh.offsets is not None:
                assert m.index_every is not None
                assert len(sh.offsets) == -(-sh.num_samples // m.index_every)
                assert sh.offsets == sorted(set(sh.offsets)) and sh.offsets[:1] in ([], [0])
                assert all(type(o) is int and o < sh.bytes for o in sh.offsets)


def test_a_valid_manifest_loads(folder: Path) -> None:
    m = load(folder, valid_manifest())
    assert_sound(m)
    assert m.to_json() == valid_manifest()


JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 3, -1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet="ab01-_./ \"';\n\u00e9", max_size=12),
    st.sampled_from(["train-000000.tar", "test-000000.tar", "../../x.tar", "a" * 64]),
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(alphabet="abn_se", max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)


def nodes(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """The path of every value inside a JSON tree (keys and list indices)."""
    yield path
    if isinstance(value, dict | list):
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            yield from nodes(child, (*path, key))


@st.composite
def mutated_manifests(draw: st.DrawFn) -> Any:
    """A valid manifest with one to three values replaced, deleted, added or duplicated."""
    body = valid_manifest()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(nodes(body))))
        if not path:
            continue
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "dup", "offset"]))
        if op == "replace":
            parent[key] = draw(JSON_VALUE)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["offsets", "extra", "name", "index_every"]))] = draw(
                JSON_VALUE
            )
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, parent[key])
        elif op == "offset" and isinstance(parent[key], int):
            parent[key] += draw(st.sampled_from([-1, 1, 512, -(10**6)]))
    return body


@FUZZ
@given(body=mutated_manifests())
def test_mutated_manifests_load_or_raise_manifest_error(folder: Path, body: Any) -> None:
    try:
        m = load(folder, body)
    except ManifestError as e:
        assert "\n" not in str(e) and str(e).startswith(str(folder / "manifest.json"))
        return
    assert_sound(m)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=4))
def test_bit_flipped_manifests_load_or_raise_manifest_error(folder: Path, flips: list) -> None:
    text = bytearray(json.dumps(valid_manifest()).encode())
    for i, bit in flips:
        text[i % len(text)] ^= 1 << bit
    try:
        assert_sound(load(folder, bytes(text)))
    except ManifestError as e:
        assert "\n" not in str(e)


def edit(change: Callable[[dict], Any]) -> dict:
    body = valid_manifest()
    change(body)
    return body


def shard0(body: dict) -> dict:
    return body["splits"]["train"]["shards"][0]


def put(key: str, value: Any) -> Callable[[dict], None]:
    return lambda b: shard0(b).__setitem__(key, value)


def top(key: str, value: Any) -> Callable[[dict], None]:
    return lambda b: b.__setitem__(key, value)


S0 = "split 'train' shard 0 "
REDO = "; re-create the manifest with data_prep/make_shards.py"
# Manifests that broke load_manifest (TypeError, a consumer's crash) or that it accepted though
# a consumer would misread them, with the start of the message each now gives.
MANIFEST_REGRESSIONS = [
    # ShardInfo(**sh) on a shard entry that is not an object: TypeError
    ("shard-not-an-object", lambda b: b["splits"]["train"]["shards"].__setitem__(0, "x"),
     S0 + "is 'x' (a string), not an object"),
    # an unknown key: TypeError from ShardInfo(**sh)
    ("shard-unknown-key", put("size", 3),
     S0 + "has the unknown key 'size' (known: ['block_sha256', 'bytes', 'name', 'num_samples', "
     "'offsets', 'sha256'])"),
    ("shard-missing-key", lambda b: shard0(b).pop("bytes"), S0 + "missing key 'bytes'"),
    # sum() of a string num_samples: TypeError
    ("num-samples-a-string", put("num_samples", "5"),
     S0 + "key 'num_samples' is '5' (a string), not an integer >= 0"),
    ("num-samples-negative", put("num_samples", -1), S0 + "key 'num_samples' is -1"),
    ("num-samples-bool", put("num_samples", True), S0 + "key 'num_samples' is True (a boolean)"),
    ("bytes-negative", put("bytes", -5), S0 + "key 'bytes' is -5 (an integer), not an integer"),
    ("sha256-short", put("sha256", "ab"), S0 + "key 'sha256' is 'ab' (a string), not 64 lower"),
    ("offsets-not-ints", put("offsets", [0, "2048", 4096]),
     S0 + "key 'offsets' is [0, '2048', 4096] (a list), not a list of integers"),
    ("offsets-not-from-0", put("offsets", [512, 2048, 4096]), S0 + "key 'offsets' starts at 512"),
    ("offsets-decrease", put("offsets", [0, 4096, 2048]),
     S0 + "key 'offsets' does not increase at entry 2 (4096 then 2048)"),
    ("offsets-past-the-shard", put("offsets", [0, 2048, 10240]),
     S0 + "key 'offsets' entry 2 (10240) is not inside the shard's 10240 bytes"),
    ("offsets-too-few", put("offsets", [0, 2048]),
     S0 + "key 'offsets' has 2 entries; 5 samples indexed every 2 need 3"),
    ("offsets-without-index-every", lambda b: b.pop("index_every"),
     S0 + "has 'offsets' but the manifest has no 'index_every'"),
    ("split-not-an-object", lambda b: b["splits"].__setitem__("train", []),
     "split 'train' is [] (a list), not an object"),
    ("split-count-disagrees", lambda b: b["splits"]["train"].__setitem__("num_samples", 11),
     "split 'train' has num_samples 11 but its shards hold 10"),
    ("split-name-with-a-slash", lambda b: b["splits"].__setitem__("../x", b["splits"].pop("test")),
     "the split name '../x' is not letters, digits and _ only"),
    ("index-every-0", top("index_every", 0), "key 'index_every' is 0 (an integer), not an integer"),
    ("channels-2", top("channels", 2), "key 'channels' is 2 (an integer), not 1 or 3"),
    ("channels-bool", top("channels", True), "key 'channels' is True (a boolean), not 1 or 3"),
    ("mean-a-string", top("mean", ["0.5"]), "key 'mean' is ['0.5'] (a list), not a list of 1"),
    ("std-nan", top("std", [float("nan")]), "key 'std' is [nan] (a list), not a list of 1 finite"),
    # float() of a 400-digit mean: OverflowError
    ("mean-beyond-a-float", top("mean", [10**400]), "key 'mean' is [1000000000"),
    ("class-names-not-strings", top("class_names", ["a", 1]),
     "key 'class_names' is ['a', 1] (a list), not a list of strings or null"),
    ("image-size-three", top("image_size", [28, 28, 1]), "key 'image_size' is [28, 28, 1]"),
    ("image-size-zero", top("image_size", [0, 28]), "key 'image_size' is [0, 28]"),
    ("num-skipped-negative", top("num_skipped", -1), "key 'num_skipped' is -1"),
    ("created-by-a-list", top("created_by", []), "key 'created_by' is [] (a list), not an object"),
    ("stats-split-a-number", top("stats_split", 3), "key 'stats_split' is 3 (an integer)"),
    ("splits-a-list", top("splits", []), "key 'splits' is [] (a list), not an object"),
    ("duplicate-shard-name", lambda b: b["splits"]["train"]["shards"][1].__setitem__(
        "name", "train-000000.tar"),
     "split 'train' shard 1 has the name 'train-000000.tar' of split 'train' shard 0 too"),
]  # fmt: skip


@pytest.mark.parametrize(
    "change,message",
    [c[1:] for c in MANIFEST_REGRESSIONS],
    ids=[c[0] for c in MANIFEST_REGRESSIONS],
)
def test_manifest_regressions(folder: Path, change: Callable, message: str) -> None:
    with pytest.raises(ManifestError) as caught:
        load(folder, edit(change))
    text = str(caught.value)
    assert text.startswith(f"{folder / 'manifest.json'}: {message}"), text
    assert text.endswith(REDO) and "\n" not in text


@pytest.mark.parametrize(
    "name",
    ["../../secret/x.tar", "/abs/path.tar", "train-000000.tar;touch x",
     'train-000000.tar"; touch y', "train/000000.tar", "train-000000.tar ", "train -000000.tar",
     "train-000000.tar\n", "train-.tar", "train-00000a.tar", "train-000000.TAR",
     "test-000000.tar", "train-\uff10\uff10.tar", "train_x-000000.tar", "", "train-000000"],
)  # fmt: skip
def test_shard_names_outside_the_pattern_are_refused(folder: Path, name: str) -> None:
    """A shard name is joined to the root (a path, a URL or a pipe's shell command)."""
    with pytest.raises(ManifestError) as caught:
        load(folder, edit(put("name", name)))
    assert str(caught.value) == (
        f"{folder / 'manifest.json'}: split 'train' shard 0 has the name {name!r}; shard names "
        "must be <split>-<digits>.tar (re-create the manifest with data_prep/make_shards.py)"
    )
    assert not is_shard_name("train", name)


def test_shard_name_pattern() -> None:
    assert is_shard_name("train", "train-000000.tar") and is_shard_name("val", "val-1234567.tar")
    assert is_shard_name("my_split2", "my_split2-000003.tar")
    assert not is_shard_name("val", "train-000000.tar") and not is_shard_name("train", 3)
    assert SHARD_NAME.fullmatch("test-000000.tar").group(1) == "test"


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"a": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit"),  # ValueError
        ("[" * 100_000 + "]" * 100_000, "not valid JSON (maximum recursion depth"),
        (b'{"format": "ssl-vit-shards", "x": "\xff"}', "not valid JSON ('utf-8' codec"),
        ('{"format": "ssl-vit-shards", "format_version": true}', "format_version True is not"),
        ('{"format": "ssl-vit-shards", "format_version": 1.0}', "format_version 1.0 is not"),
    ],
    ids=["5000-digit-number", "nested-100000-deep", "not-utf8", "version-true", "version-float"],
)
def test_malformed_json_is_a_manifest_error(folder: Path, text: str | bytes, message: str) -> None:
    with pytest.raises(ManifestError) as caught:
        load(folder, text)
    assert str(caught.value).startswith(f"{folder / 'manifest.json'}: ")
    assert message in str(caught.value) and "\n" not in str(caught.value)
