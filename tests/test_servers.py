"""The test servers of tests/servers.py, read through fsspec as the loader reads URLs.

The exceptions asserted here are what fsspec, aiohttp and s3fs raise today for each fault: the
loader's retries are built on them, so a new version that changes them fails here first.
"""

from __future__ import annotations

import http.client
import multiprocessing
import random
import threading
import time
from pathlib import Path

import aiohttp
import fsspec
import pytest
from fsspec.exceptions import FSTimeoutError
from servers import Drop, S3Server, ShardHTTPServer, Stall, Status, s3_endpoint

DATA = random.Random(0).randbytes(300_000)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """shards/a.tar (DATA) and shards/sub/b.bin, beside a secret.txt the server must not serve."""
    root = tmp_path / "shards"
    (root / "sub").mkdir(parents=True)
    (root / "a.tar").write_bytes(DATA)
    (root / "sub" / "b.bin").write_bytes(b"b" * 10)
    (tmp_path / "secret.txt").write_text("not yours")
    return root


def _get(conn: http.client.HTTPConnection, path: str, range_: str | None = None, method="GET"):
    conn.request(method, path, headers={"Range": range_} if range_ else {})
    resp = conn.getresponse()
    return resp, resp.read()


def test_ranges_head_and_counts(serve_http, folder: Path) -> None:
    server: ShardHTTPServer = serve_http(folder)
    size = len(DATA)
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=10)
    resp, body = _get(conn, "/a.tar", method="HEAD")
    assert (resp.status, body) == (200, b"")
    assert resp.headers["Content-Length"] == str(size)
    assert resp.headers["Accept-Ranges"] == "bytes"
    resp, body = _get(conn, "/a.tar", "bytes=100-199")
    assert (resp.status, resp.headers["Content-Range"], body) == (
        206, f"bytes 100-199/{size}", DATA[100:200],
    )  # fmt: skip
    assert _get(conn, "/a.tar", f"bytes={size - 10}-")[1] == DATA[-10:]
    assert _get(conn, "/a.tar", "bytes=-7")[1] == DATA[-7:]
    resp, body = _get(conn, "/a.tar", "bytes=0-999999999")  # clipped to the file
    assert (resp.status, resp.headers["Content-Range"], body) == (
        206,
        f"bytes 0-{size - 1}/{size}",
        DATA,
    )
    resp, body = _get(conn, "/a.tar")
    assert (resp.status, body) == (200, DATA)
    resp, _ = _get(conn, "/a.tar", f"bytes={size}-")
    assert (resp.status, resp.headers["Content-Range"]) == (416, f"bytes */{size}")
    assert _get(conn, "/a.tar", "bytes=5-1")[0].status == 400
    assert _get(conn, "/a.tar", "bytes=0-1,5-6")[0].status == 400
    assert _get(conn, "/sub/b.bin")[1] == b"b" * 10
    conn.close()
    assert server.requests == {"a.tar": 9, "sub/b.bin": 1}
    assert server.bytes_sent == {"a.tar": 100 + 10 + 7 + size + size, "sub/b.bin": 10}
    assert [h.status for h in server.hits][:3] == [200, 206, 206]


def test_fsspec_seek_and_read_is_one_ranged_get(serve_http, folder: Path) -> None:
    server: ShardHTTPServer = serve_http(folder)
    with fsspec.open(server.url_for("a.tar"), "rb", cache_type="none") as f:
        f.seek(123_456)
        assert f.read(1000) == DATA[123_456:124_456]
    assert [(h.method, h.range) for h in server.hits] == [
        ("HEAD", None), ("GET", "bytes=123456-124455"),
    ]  # fmt: skip
    assert server.bytes_sent["a.tar"] == 1000


def test_missing_files_404_and_paths_out_of_the_folder_403(serve_http, folder: Path) -> None:
    (folder / "link.txt").symlink_to(folder.parent / "secret.txt")
    server: ShardHTTPServer = serve_http(folder)
    with pytest.raises(FileNotFoundError):  # HEAD 404, then GET 404: fsspec says not found
        fsspec.open(server.url_for("nope.tar"), "rb").open()
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=10)
    for path in ("/../secret.txt", "/%2e%2e/secret.txt", "/sub/../../secret.txt", "/link.txt"):
        resp, body = _get(conn, path)
        assert resp.status == 403, path
        assert b"not yours" not in body
    assert _get(conn, "/")[0].status == 404  # a folder: no listings
    assert _get(conn, "/sub")[0].status == 404
    conn.close()


def test_faults_meet_the_gets_of_a_path_in_turn(folder: Path) -> None:
    faults = {"a.tar": [Drop(after_bytes=100_000), Status(503)]}
    with ShardHTTPServer(folder, faults=faults) as server:
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        url = server.url_for("a.tar")
        with pytest.raises(aiohttp.ClientPayloadError) as cut:  # the body cut short
            fs.cat_file(url, 0, 200_000)
        assert not isinstance(cut.value, OSError)
        with pytest.raises(aiohttp.ClientResponseError) as unavailable:
            fs.cat_file(url, 0, 200_000)
        assert unavailable.value.status == 503 and not isinstance(unavailable.value, OSError)
        assert fs.cat_file(url, 0, 200_000) == DATA[:200_000]
        assert fs.cat_file(server.url_for("sub/b.bin")) == b"b" * 10  # other paths untouched
        assert [h.status for h in server.hits if h.path == "a.tar"] == [206, 503, 206]
        assert server.bytes_sent["a.tar"] == 100_000 + 200_000

        server.set_faults("a.tar", Drop(after_bytes=1000, reset=True))  # a TCP RST
        with pytest.raises(aiohttp.ClientPayloadError):
            fs.cat_file(url, 0, 200_000)


def test_a_path_that_always_fails_until_its_faults_are_cleared(serve_http, folder: Path) -> None:
    server: ShardHTTPServer = serve_http(folder)
    server.set_faults("a.tar", Status(503, times=None, methods=("HEAD", "GET")))
    for _ in range(3):  # fsspec tries HEAD, then GET, and calls any failure "not found"
        with pytest.raises(FileNotFoundError) as err:
            fsspec.open(server.url_for("a.tar"), "rb").open()
        assert isinstance(err.value.__cause__, aiohttp.ClientResponseError)
        assert err.value.__cause__.status == 503
    assert [h.status for h in server.hits] == [503] * 6
    server.set_faults("a.tar")
    with fsspec.open(server.url_for("a.tar"), "rb") as f:
        assert f.read() == DATA


def test_stalls_time_out_readers_and_do_not_hold_up_close(folder: Path) -> None:
    before = set(threading.enumerate())
    server = ShardHTTPServer(folder, faults={"a.tar": [Stall(30), Stall(0.3, after_bytes=10)]})
    with server:
        timeout = aiohttp.ClientTimeout(sock_read=0.5)
        fs = fsspec.filesystem("http", skip_instance_cache=True, client_kwargs={"timeout": timeout})
        start = time.monotonic()
        with pytest.raises(FSTimeoutError):  # aiohttp's SocketTimeoutError, as fsspec's own
            fs.cat_file(server.url_for("a.tar"), 0, 1000)
        assert time.monotonic() - start < 5
        start = time.monotonic()
        assert fs.cat_file(server.url_for("a.tar"), 0, 1000) == DATA[:1000]  # slow, whole
        assert time.monotonic() - start >= 0.3

        server.set_faults("a.tar", Stall(30))  # a reader still waiting when the server closes
        idle = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        _get(idle, "/sub/b.bin")  # a kept-alive connection, idle in its thread
        waiting = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        waiting.request("GET", "/a.tar")
        cut: list[Exception] = []

        def read() -> None:
            try:
                waiting.getresponse().read()
            except http.client.IncompleteRead as e:  # the headers came, the body never did
                cut.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while server.requests["a.tar"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
    assert time.monotonic() - start < 2
    reader.join(10)
    assert not reader.is_alive() and cut
    idle.close()
    waiting.close()
    assert not [t for t in set(threading.enumerate()) - before if t.name != "fsspecIO"]


def _read_in_child(url: str, start: int, n: int, out) -> None:
    with fsspec.open(url, "rb") as f:
        f.seek(start)
        out.put(f.read(n))


def test_s3_round_trip_with_seek_here_and_in_a_forkserver_child(s3: S3Server, folder: Path) -> None:
    urls = s3.upload_folder(folder, "s3://bucket/prefix")
    assert urls == ["s3://bucket/prefix/a.tar", "s3://bucket/prefix/sub/b.bin"]
    with fsspec.open("s3://bucket/prefix/a.tar", "rb") as f:  # no arguments: the environment
        f.seek(250_000)
        assert f.read(1234) == DATA[250_000:251_234]
    with pytest.raises(FileNotFoundError):
        fsspec.open("s3://bucket/prefix/nope.tar", "rb").open()
    ctx = multiprocessing.get_context("forkserver")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(urls[0], 7, 100, out))
    child.start()
    assert out.get(timeout=60) == DATA[7:107]
    child.join(30)
    assert child.exitcode == 0


def test_s3_reads_meet_faults_through_the_http_server(serve_http, tmp_path: Path) -> None:
    (tmp_path / "bucket" / "prefix").mkdir(parents=True)
    (tmp_path / "bucket" / "prefix" / "a.tar").write_bytes(DATA)
    key = "bucket/prefix/a.tar"
    server: ShardHTTPServer = serve_http(tmp_path, faults={key: [Drop(after_bytes=1000)]})
    with s3_endpoint(server.url):
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        assert fs.cat_file(key, start=5000, end=9000) == DATA[5000:9000]  # s3fs retried the cut GET
        assert [(h.method, h.range, h.sent) for h in server.hits] == [
            ("GET", "bytes=5000-8999", 1000), ("GET", "bytes=5000-8999", 4000),
        ]  # fmt: skip
        server.set_faults(key, Status(404))
        with pytest.raises(FileNotFoundError):
            fs.cat_file(key, start=0, end=10)
