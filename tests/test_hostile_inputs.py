"""Shard sets and servers that lie: every case ends in one line or a counted skip, and nothing
runs, hangs or is trained on silently (SECURITY.md, "Shard sets").

The servers are real (tests/servers.py, on 127.0.0.1); the shard sets are conftest's tiny set,
copied and then tampered with.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from servers import Drip, Html, Length, Mutate, NoRange, Redirect, Stall

from ssl_vit.data.manifest import ManifestError, load_manifest
from ssl_vit.data.shards import ReadCounter, ShardReadError, read_shard, select_shards
from ssl_vit.data.stream import make_eval_loader, make_train_loader
from ssl_vit.data.tar_reader import block_digests, iter_members
from ssl_vit.data.urls import Retry, UnsafeNameError, join

QUICK = Retry(attempts=2, backoff=0.01, timeout=2.0)
SHARD = "train-000001.tar"


def _copy(tiny_shards: Path, tmp_path: Path) -> Path:
    out = tmp_path / "set"
    shutil.copytree(tiny_shards, out)
    return out


def _edit_manifest(root: Path, edit) -> None:
    path = root / "manifest.json"
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body))


def _shard_entry(body: dict, name: str = SHARD) -> dict:
    return next(s for s in body["splits"]["train"]["shards"] if s["name"] == name)


def _reseal(root: Path, name: str = SHARD) -> None:
    """Make the manifest agree with the shard's bytes again (size, sha256, block checksums)."""
    path = root / name
    data = path.read_bytes()

    def edit(body: dict) -> None:
        entry = _shard_entry(body, name)
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        with open(path, "rb") as f:
            entry["block_sha256"] = block_digests(f, entry["offsets"], len(data))

    _edit_manifest(root, edit)


def _member_offset(path: Path, suffix: str, nth: int = 0) -> tuple[int, int]:
    """(byte offset of the data, size) of the nth member whose name ends with `suffix`."""
    with open(path, "rb") as f:
        found = [
            (at + 512, len(data))
            for name, data, at in iter_members(f, path)
            if name.endswith(suffix)
        ]
    return found[nth]


def _samples(root: str, missing: str = "error", retry: Retry = QUICK) -> tuple[dict, object]:
    """{manifest index: sample} of the train split read whole, and the read counter."""
    refs = select_shards(load_manifest(root), "train", missing)  # type: ignore[arg-type]
    counter = ReadCounter(mp.get_context())
    got = {
        s["__index__"]: s
        for ref in refs
        for s in read_shard(ref, counter, retry=retry, missing=missing)  # type: ignore[arg-type]
    }
    return got, counter


def _read_all(root: str, missing: str = "error", retry: Retry = QUICK) -> tuple[list, object]:
    got, counter = _samples(root, missing, retry)
    return sorted(got), counter


# --- names from a manifest never reach a shell or leave the set -----------------------------


@pytest.mark.parametrize(
    "name",
    [
        "train-000001.tar;touch {marker}",
        'train-000001.tar"; touch {marker}; echo "',
        "train-000001.tar$(touch {marker})",
        "../../secret/private.tar",
        "/etc/passwd",
    ],
)
def test_a_name_in_a_manifest_never_runs_or_leaves_the_set(tiny_shards, tmp_path, name):
    root = _copy(tiny_shards, tmp_path)
    marker = tmp_path / "ran"
    name = name.format(marker=marker)
    _edit_manifest(root, lambda body: _shard_entry(body).update(name=name))
    pipes = [f"pipe:cat {root}/{{}}", f'pipe:cat "{root}/{{}}"']
    for data in [str(root), *pipes]:
        with pytest.raises(ManifestError) as err:
            _read_all(data)
        assert "\n" not in str(err.value) and "manifest.json" in str(err.value)
        proc = subprocess.run(
            [sys.executable, "data_prep/verify_shards.py", data],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()


def test_join_takes_one_plain_name_and_quotes_it_for_a_pipe():
    assert join("pipe:cat /d/{}", "train-000001.tar") == "pipe:cat /d/train-000001.tar"
    for bad in ("a/b.tar", "..", ".hidden", "x y.tar", "x;y", "", "a'b"):
        with pytest.raises(UnsafeNameError):
            join("/data", bad)


# --- every byte read is checked against the manifest -----------------------------------------


def test_checked_reads_deliver_what_unchecked_reads_do(tiny_shards):
    plain, _ = _read_all(str(tiny_shards))
    assert plain == list(range(load_manifest(tiny_shards).splits["train"].num_samples))
    manifest = load_manifest(tiny_shards)
    assert all(s.block_sha256 for s in manifest.splits["train"].shards)
    keep = lambda i: i % 7 != 3  # noqa: E731  (held-out samples: passed over)
    for verify, unverified in (("read", True), ("all", False)):
        ref = select_shards(manifest, "train", verify=verify)[1]
        counter = ReadCounter(mp.get_context())
        got = [s["__index__"] for s in read_shard(ref, counter, start=13, stop=97, keep=keep)]
        assert got == [ref.offset + p for p in range(13, 97) if keep(ref.offset + p)]
        assert (counter.unverified > 0) == unverified, verify


def test_a_changed_byte_stops_the_read_before_its_block_is_delivered(tiny_shards, tmp_path):
    root = _copy(tiny_shards, tmp_path)
    at, _ = _member_offset(root / SHARD, ".png", nth=50)
    data = bytearray((root / SHARD).read_bytes())
    data[at + 3] ^= 0xFF
    (root / SHARD).write_bytes(bytes(data))
    with pytest.raises(ShardReadError) as err:
        _read_all(str(root))
    assert "block_sha256" in err.value.one_line() and SHARD in err.value.one_line()
    got, counter = _read_all(str(root), missing="skip")
    every = load_manifest(root).index_every
    bad_block = range(128 + 50 // every * every, 128 + (50 // every + 1) * every)
    assert not set(got) & set(bad_block)  # nothing of the changed block was delivered
    assert counter.shard_errors == 1 and counter.samples > 0


def test_a_wrong_offset_is_found_where_it_is_used(tiny_shards, tmp_path):
    root = _copy(tiny_shards, tmp_path)

    def shift(body: dict) -> None:  # into the middle of a member, block checksums gone
        entry = _shard_entry(body)
        entry["offsets"][1] += 512
        del entry["block_sha256"]

    _edit_manifest(root, shift)
    ref = select_shards(load_manifest(root), "train")[1]
    with pytest.raises(ShardReadError, match="offset index"):
        list(read_shard(ref, ReadCounter(mp.get_context()), start=ref.every + 1, missing="error"))
    with pytest.raises(ShardReadError, match="offset index"):  # read from the start, crossing it
        list(read_shard(ref, ReadCounter(mp.get_context()), missing="error"))


def test_a_label_outside_the_manifests_classes_stops_in_one_line(tiny_shards, tmp_path):
    root = _copy(tiny_shards, tmp_path)
    at, size = _member_offset(root / SHARD, ".cls", nth=5)
    data = bytearray((root / SHARD).read_bytes())
    data[at : at + size] = b"9".rjust(size, b"0")  # same length: the tar stays well formed
    (root / SHARD).write_bytes(bytes(data))
    _reseal(root)  # the manifest vouches for these bytes: only the label is wrong
    with pytest.raises(ShardReadError, match=r"\.cls is 9, not a class of the manifest's 4"):
        for _ in make_train_loader(str(root), "train", global_batch=64, num_workers=1, img_size=16):
            pass
    with pytest.raises(ShardReadError, match="not a class"):
        for _ in make_eval_loader(str(root), "train", batch_size=64, img_size=16, num_workers=0):
            pass


# --- servers that misbehave -------------------------------------------------------------------


def test_a_server_that_changes_a_shard_between_reads_is_caught(tiny_shards, serve_http):
    server = serve_http(tiny_shards)
    first, _ = _read_all(server.url)
    assert len(first) == 512
    at, _ = _member_offset(tiny_shards / SHARD, ".png", nth=7)
    server.set_faults(SHARD, Mutate(at=at + 2))
    with pytest.raises(ShardReadError, match="block_sha256"):
        _read_all(server.url)


@pytest.mark.parametrize(
    "fault, words",
    [
        (Html(), ""),
        (Length(delta=-700), ""),
        (Length(delta=+700), ""),
        (Redirect(), "TooManyRedirects"),
    ],
    ids=["html", "short-length", "long-length", "redirect-loop"],
)
def test_a_lying_server_ends_in_one_line_and_trains_nothing_of_it(
    tiny_shards, serve_http, fault, words
):
    server = serve_http(tiny_shards)
    server.set_faults(SHARD, fault)
    start = time.monotonic()
    with pytest.raises(ShardReadError) as err:
        _read_all(server.url)
    line = err.value.one_line()
    assert SHARD in line and words in line and "\n" not in line
    assert time.monotonic() - start < 60
    truth, _ = _samples(str(tiny_shards))
    got, counter = _samples(server.url, missing="skip")
    assert counter.shard_errors == 1 and len(got) < len(truth)
    # what did arrive of the shard (the blocks before a short body's end) is what it holds
    assert all(s["png"] == truth[i]["png"] and s["cls"] == truth[i]["cls"] for i, s in got.items())


def test_a_dripping_server_fails_by_its_deadline(tiny_shards, serve_http):
    server = serve_http(tiny_shards)
    server.set_faults(SHARD, Drip(per_second=20, after_bytes=1000))
    retry = Retry(attempts=2, backoff=0.01, timeout=2.0, min_rate=8e6)  # deadline ~3 s
    start = time.monotonic()
    with pytest.raises(ShardReadError, match="unreadable after 2 tries"):
        _read_all(server.url, retry=retry)
    assert time.monotonic() - start < 30


def test_a_stalled_loader_names_what_it_was_reading(tiny_shards, serve_http):
    server = serve_http(tiny_shards)
    for i in range(4):
        server.set_faults(f"train-{i:06d}.tar", Stall(seconds=60, times=None))
    loader = make_train_loader(
        server.url,
        "train",
        global_batch=32,
        num_workers=1,
        img_size=16,
        timeout=3,
        retry=Retry(attempts=1, timeout=120.0),
    )
    start = time.monotonic()
    with pytest.raises(ShardReadError) as err:
        next(iter(loader))
    line = err.value.one_line()
    assert "no batch from the data loader in 3 s" in line and "train-0000" in line
    assert time.monotonic() - start < 30


def test_an_older_set_gains_block_checksums_in_place(tiny_shards, tmp_path):
    root = _copy(tiny_shards, tmp_path)
    before = load_manifest(root)

    def strip(body: dict) -> None:
        for split in body["splits"].values():
            for shard in split["shards"]:
                del shard["block_sha256"]

    _edit_manifest(root, strip)
    verify = [sys.executable, "data_prep/verify_shards.py", str(root), "--no-decode"]
    proc = subprocess.run([*verify, "--add-block-checksums"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0 and "block checksums added for 5 shards" in proc.stdout, proc
    assert load_manifest(root).splits == before.splits  # the same digests make_shards wrote
    data = bytearray((root / SHARD).read_bytes())  # a byte changed: verify names the block
    at, _ = _member_offset(root / SHARD, ".png", nth=3)
    data[at] ^= 1
    (root / SHARD).write_bytes(bytes(data))
    _reseal(root)  # whole-file sha256 and size agree again; only the block digests cannot
    _edit_manifest(
        root,
        lambda b: _shard_entry(b).update(
            block_sha256=before.splits["train"].shards[1].block_sha256
        ),
    )  # noqa: E501
    proc = subprocess.run(verify, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1 and "block_sha256[0] does not match" in proc.stderr, proc


def test_a_server_without_range_support_is_read_from_the_start(tiny_shards, serve_http):
    """Simple web servers answer a ranged GET with the whole file: a stream that starts inside
    a shard then reads it from byte 0 and skips forward, delivering the same samples."""
    server = serve_http(tiny_shards)
    for i in range(4):
        server.set_faults(f"train-{i:06d}.tar", NoRange())
    local = select_shards(load_manifest(tiny_shards), "train")[1]
    remote = select_shards(load_manifest(server.url), "train")[1]
    counter = ReadCounter(mp.get_context())
    got = [s["__index__"] for s in read_shard(remote, counter, start=50, retry=QUICK)]
    want = [s["__index__"] for s in read_shard(local, ReadCounter(mp.get_context()), start=50)]
    assert got == want and len(got) == 128 - 50
    assert counter.bytes_read >= local.size  # the shard's head was read too


def test_check_and_verify_report_whether_a_server_answers_range_requests(
    tiny_shards, serve_http
) -> None:
    """`--check` and verify_shards.py say whether the web server answers Range requests, and
    without them --check's read factor counts each stream reading its shards from the start."""
    reports = {}
    for ranged in (True, False):
        server = serve_http(tiny_shards)
        if not ranged:
            for name in tiny_shards.glob("*.tar"):
                server.set_faults(name.name, NoRange())
        verify = run_cli(["data_prep/verify_shards.py", "--no-decode", server.url])
        check = run_cli(["pipelines/mpp_pretrain.py", "--check", "--world-sizes", "1",
                         f"data.root={server.url}", "data.num_workers=3", "train.global_batch=30",
                         "data.in_memory=false", "model.img_size=16", "train.steps=2"])  # fmt: skip
        assert verify.returncode == 0 and check.returncode == 0, verify.stderr + check.stderr
        reports[ranged] = (verify.stdout, check.stdout)
    assert "range requests: answered" in reports[True][0]
    assert "range requests: ignored" in reports[False][0]
    assert "range requests: answered" in reports[True][1]
    assert "range requests: ignored by the server" in reports[False][1]
    factor = [float(re.search(r"reads the shard set ([0-9.]+) times", r[1]).group(1))
              for r in (reports[True], reports[False])]  # fmt: skip
    assert factor[1] > factor[0]


def test_a_missing_or_resized_remote_shard_stops_the_start(tiny_shards, tmp_path, serve_http, s3):
    """Each shard of a remote set is asked for once at start (a HEAD on a web server, a listing
    on object storage): one missing or resized is named before training, not a minute in."""
    from ssl_vit.config import ConfigError
    from ssl_vit.engine.preflight import check_remote_shards

    root = _copy(tiny_shards, tmp_path)
    (root / "train-000002.tar").unlink()
    with open(root / SHARD, "ab") as f:
        f.write(b"\0" * 512)
    server = serve_http(root)
    bucket = "s3://shards/tiny"
    s3.upload_folder(root, bucket)
    for url in (server.url, bucket):
        with pytest.raises(ConfigError, match=rf"{SHARD}: \d+ bytes, the manifest says"):
            check_remote_shards(load_manifest(url), "train", "error")
    (root / SHARD).write_bytes((tiny_shards / SHARD).read_bytes())
    s3.upload_folder(root, bucket)
    for url in (server.url, bucket):
        manifest = load_manifest(url)
        with pytest.raises(ConfigError, match=r"1 of 4 train shards missing \(train-000002\.tar\)"):
            check_remote_shards(manifest, "train", "error")
        check_remote_shards(manifest, "train", "skip")  # named in a warning, not an error
    proc = run_cli(["pipelines/mpp_pretrain.py", "--check", f"data.root={server.url}",
                    "train.global_batch=32", "model.img_size=16", "train.steps=2"])  # fmt: skip
    assert proc.returncode == 2 and "train-000002.tar" in proc.stderr.strip().splitlines()[-1]


def test_a_refused_connection_is_not_called_not_found():
    from test_train_e2e import free_port

    url = f"http://127.0.0.1:{free_port()}/set"  # nothing listens there
    with pytest.raises(ManifestError) as err:
        load_manifest(url, Retry(attempts=1))
    line = str(err.value)
    assert "unreadable (" in line and "not found" not in line and "\n" not in line
    assert line.isascii()
