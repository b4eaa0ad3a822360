"""Real servers on 127.0.0.1 for tests that read shard sets from URLs.

`ShardHTTPServer` serves a folder over HTTP/1.1 with byte ranges, counts the requests and body
bytes of each path, and injects faults per path (`Drop`, `Status`, `Stall`). `S3Server` runs
moto's S3 in this process; `s3_endpoint` points every S3 client, in this process and in the
processes it starts after (DataLoader workers, deepspeed ranks), at an endpoint through
environment variables. A ShardHTTPServer is such an endpoint too, for reads: s3fs's HeadObject
and ranged GetObject are `HEAD /bucket/key` and `GET /bucket/key` there, so a folder holding
bucket/prefix/... serves s3://bucket/prefix/... with the same counting and faults.

The fixtures at the end are loaded by conftest.py (`pytest_plugins = ["servers"]`).
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import multiprocessing.forkserver
import os
import socket
import struct
import threading
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Drop:
    """Send the headers and `after_bytes` of the body, then close the connection: a FIN (a body
    cut short), or with `reset` a TCP RST. On HEAD it closes before answering anything."""

    after_bytes: int = 0
    reset: bool = False
    times: int | None = 1  # how many requests it spoils; None: all of them, from now on
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True)
class Status:
    """Answer with this HTTP status (and a short text body) instead of the file."""

    code: int = 503
    times: int | None = 1
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True)
class Stall:
    """Send the headers and `after_bytes` of the body, go silent for `seconds`, then send the
    rest (if the client is still there). On HEAD it goes silent before the status line."""

    seconds: float
    after_bytes: int = 0
    times: int | None = 1
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True)
class Drip:
    """Send the body `per_second` bytes a second after `after_bytes` at full speed: a server
    that never goes silent long enough for a per-read timeout, yet never finishes."""

    per_second: float = 1.0
    after_bytes: int = 0
    times: int | None = None
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True)
class Mutate:
    """Serve the file with the byte at file offset `at` inverted: the shard changed on the
    server (between epochs, say)."""

    at: int
    times: int | None = None
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True)
class Html:
    """Answer 200 with an HTML page instead of the file, as a login wall or an error page does."""

    times: int | None = None
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True)
class Length:
    """Announce Content-Length off by `delta` bytes: shorter (the body is cut there) or longer
    (the server then sends what it has and waits)."""

    delta: int
    times: int | None = None
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True)
class Redirect:
    """Answer 302 pointing at the same path: a redirect loop."""

    times: int | None = None
    methods: tuple[str, ...] = ("GET", "HEAD")


@dataclass(frozen=True)
class NoRange:
    """Ignore Range headers and answer 200 with the whole file, as simple servers do."""

    times: int | None = None
    methods: tuple[str, ...] = ("GET", "HEAD")


Fault = Drop | Status | Stall | Drip | Mutate | Html | Length | Redirect | NoRange


@dataclass
class Hit:
    """One request: the path relative to the folder, the Range header (None without one), the
    status answered (0 while none is) and the file's bytes sent. Filled in before the client can
    see any of it, so a client that has its answer finds it here."""

    method: str
    path: str
    range: str | None
    status: int = 0
    sent: int = 0


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """First and last byte of a single `bytes=` range; None if it starts past the end of the
    file; ValueError if it is malformed or a multi-range (this server does not do those)."""
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not dash or "," in spec:
        raise ValueError(header)
    if not first:  # bytes=-N: the last N bytes
        n = int(last)
        return (max(0, size - n), size - 1) if n > 0 and size > 0 else None
    start, stop = int(first), int(last) if last else None
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(header)
    return (start, size - 1 if stop is None else min(stop, size - 1)) if start < size else None


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ShardHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers and aiohttp's pool use it
    timeout = 30  # a client that goes silent cannot hold a thread (and the shutdown) forever

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: `hits` has every request

    def _serve(self) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        self._hit = self.server.record(Hit(self.command, path, self.headers.get("Range")))
        try:
            self._respond(path, self.server.take_fault(path, self.command))
        except OSError:  # the client went away (or timed out) mid-answer
            self.close_connection = True

    def _respond(self, path: str, fault: Fault | None) -> None:
        head = self.command == "HEAD"
        if head and isinstance(fault, Drop):
            return self._abort(fault.reset)
        if head and isinstance(fault, Stall) and self.server.stopping.wait(fault.seconds):
            return self._abort(reset=False)
        if isinstance(fault, Status):
            return self._error(fault.code)
        if isinstance(fault, Redirect):
            return self._error(302, {"Location": self.path})
        if isinstance(fault, Html):
            page = b"<!doctype html><html><body>Please sign in</body></html>\n" * 40
            self._start(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if not head:
                self.wfile.write(page)
            return
        file = self.server.resolve(path)
        if file is None:
            return self._error(403)
        if not file.is_file():
            return self._error(404)
        size = file.stat().st_size
        first, last, code = 0, size - 1, 200
        if "Range" in self.headers and not isinstance(fault, NoRange):
            try:
                span = _byte_range(self.headers["Range"], size)
            except ValueError:
                return self._error(400)
            if span is None:
                return self._error(416, {"Content-Range": f"bytes */{size}"})
            (first, last), code = span, 206
        self._start(code)
        if code == 206:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Type", "application/octet-stream")
        todo = last + 1 - first
        announced = todo + fault.delta if isinstance(fault, Length) else todo
        self.send_header("Content-Length", str(announced))
        if not isinstance(fault, NoRange):
            self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if head:
            return
        if isinstance(fault, Mutate):
            data = bytearray(file.read_bytes()[first : last + 1])
            if first <= fault.at <= last:
                data[fault.at - first] ^= 0xFF
            self.server.count_sent(self._hit, len(data))
            self.wfile.write(bytes(data))
            return
        if isinstance(fault, Length):
            with open(file, "rb") as f:
                f.seek(first)
                self._copy(f, min(todo, announced))
            if announced > todo:  # promised more than there is: hold the connection open
                self.server.stopping.wait(30)
            return
        with open(file, "rb") as f:
            f.seek(first)
            before = todo if not hasattr(fault, "after_bytes") else min(todo, fault.after_bytes)
            self._copy(f, before)
            if isinstance(fault, Drip):
                while todo > before and not self.server.stopping.wait(1 / fault.per_second):
                    self._copy(f, 1)
                    before += 1
                if todo > before:  # the server is closing
                    self._abort(reset=False)
                return
            if isinstance(fault, Drop):
                return self._abort(fault.reset)
            if isinstance(fault, Stall) and self.server.stopping.wait(fault.seconds):
                return self._abort(reset=False)
            self._copy(f, todo - before)

    def _start(self, code: int) -> None:
        self._hit.status = code
        self.send_response(code)

    def _error(self, code: int, headers: Mapping[str, str] | None = None) -> None:
        body = f"{code} {http.HTTPStatus(code).phrase}\n".encode()
        self._start(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _copy(self, f, n: int) -> None:
        while n > 0:
            chunk = f.read(min(n, 1 << 16))
            if not chunk:  # the file shrank under the server: a short body, as from a drop
                return self._abort(reset=False)
            self.server.count_sent(self._hit, len(chunk))  # counted first: see Hit
            self.wfile.write(chunk)
            n -= len(chunk)

    def _abort(self, reset: bool) -> None:
        """Close the connection now, mid-answer: FIN, or RST (SO_LINGER 0) with `reset`."""
        self.close_connection = True
        if reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()


class ShardHTTPServer(http.server.ThreadingHTTPServer):
    """Serve `folder` read-only at `self.url` (127.0.0.1, a free port), one thread a connection.

    GET and HEAD; `Range: bytes=A-B`, `bytes=A-` and `bytes=-N` answer 206 with Content-Range
    (past the end: 416; malformed or several ranges: 400); a missing file 404, a path out of
    `folder` 403. Counted per path relative to `folder` ("train-000000.tar"), live and under a
    lock: `requests[path]` as they arrive, `bytes_sent[path]` as the file's bytes are handed to
    the socket (error pages not counted; a client that hangs up may have read fewer); `hits`
    lists every request as it arrives (a `Hit`, its status and bytes filled in as they go).

    `faults` maps such a path to faults that its requests meet in turn: with
    `{"a.tar": [Drop(after_bytes=100_000), Status(503)]}` the first GET of a.tar is cut after
    100000 body bytes, the second answers 503, later ones succeed; `Status(503, times=None)`
    fails every GET. HEADs are left alone unless a fault names them in `methods`. `set_faults`
    changes them while it runs. Use it as a context manager (or `start()` and `close()`).
    """

    daemon_threads = False  # server_close() joins every connection's thread: nothing leaks

    def __init__(
        self, folder: str | os.PathLike, *, faults: Mapping[str, Sequence[Fault]] | None = None
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder = Path(folder).resolve()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.requests: Counter[str] = Counter()
        self.bytes_sent: Counter[str] = Counter()
        self.hits: list[Hit] = []
        self.stopping = threading.Event()  # wakes stalled answers at shutdown
        self._lock = threading.Lock()
        self._faults: dict[str, list[list]] = {}  # path -> [[fault, times left or None], ...]
        self._open: set[socket.socket] = set()
        self._thread: threading.Thread | None = None
        for path, path_faults in (faults or {}).items():
            self.set_faults(path, *path_faults)

    def url_for(self, path: str) -> str:
        """The URL of `path` (relative to the folder)."""
        return f"{self.url}/{urllib.parse.quote(path)}"

    def set_faults(self, path: str, *faults: Fault) -> None:
        """Replace the faults waiting for `path` (none: it answers normally from now on)."""
        with self._lock:
            self._faults[path.lstrip("/")] = [[f, f.times] for f in faults]

    def take_fault(self, path: str, method: str) -> Fault | None:
        """The fault this request meets, if any, used up by one."""
        with self._lock:
            queue = self._faults.get(path, [])
            for entry in queue:
                fault, left = entry
                if method in fault.methods:
                    if left is not None:
                        entry[1] = left - 1
                        if entry[1] <= 0:
                            queue.remove(entry)
                    return fault
        return None

    def record(self, hit: Hit) -> Hit:
        with self._lock:
            self.requests[hit.path] += 1
            self.hits.append(hit)
        return hit

    def count_sent(self, hit: Hit, n: int) -> None:
        with self._lock:
            hit.sent += n
            self.bytes_sent[hit.path] += n

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_sent.clear()
            self.hits.clear()

    def resolve(self, path: str) -> Path | None:
        """The file `path` names in the folder, or None when it points out of the folder."""
        try:
            file = (self.folder / path).resolve()
        except (ValueError, OSError):
            return None
        return file if file.is_relative_to(self.folder) else None

    # the connections still open, so that closing can end their keep-alive waits
    def process_request(self, request, client_address) -> None:
        with self._lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def start(self) -> ShardHTTPServer:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, name=f"http{self.url}"
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, end every open connection and join every thread."""
        self.stopping.set()
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        with self._lock:
            still_open = list(self._open)
        for sock in still_open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.server_close()

    def __enter__(self) -> ShardHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# Dummy credentials and the endpoint: botocore reads these when a client is made, in every
# process (AWS_ENDPOINT_URL_S3 sends S3 alone there). The files point nowhere so that no
# profile, region or endpoint of the machine's own AWS setup gets mixed in.
def aws_env(endpoint: str) -> dict[str, str]:
    """The environment that makes `fsspec.open("s3://...")` (s3fs, botocore) use `endpoint`."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


_AWS_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")


def _restart_forkserver() -> None:
    """Stop multiprocessing's fork server if it runs: its children get the environment it
    started with, so the next "forkserver" child would not see a change made since."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def _forget_s3_clients() -> None:
    """Drop fsspec's cached S3FileSystem objects: they keep the endpoint they were made with."""
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_endpoint(endpoint: str) -> Iterator[dict[str, str]]:
    """Point S3 clients at `endpoint` inside the block: sets `aws_env(endpoint)` in os.environ
    (the block's processes inherit it; the fork server is restarted to pick it up), and puts
    the previous environment back after."""
    env = aws_env(endpoint)
    saved = {k: os.environ.get(k) for k in (*env, *_AWS_UNSET)}
    for k in _AWS_UNSET:
        os.environ.pop(k, None)
    os.environ.update(env)
    _forget_s3_clients()
    _restart_forkserver()
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_s3_clients()
        _restart_forkserver()


class S3Server:
    """moto's S3 on 127.0.0.1 and a free port, in this process; as a context manager it also
    points S3 clients at itself (`s3_endpoint`) until it stops."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        if logging.getLogger("werkzeug").level == logging.NOTSET:  # a log line per request
            logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._env: contextlib.ExitStack | None = None
        self.endpoint = ""

    def start(self) -> S3Server:
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._env = contextlib.ExitStack()
        self._env.enter_context(s3_endpoint(self.endpoint))
        return self

    def stop(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
            self._moto.stop()
            self._moto._server.server_close()  # stop() leaves the listening socket open

    def client(self):
        """A boto3 S3 client of this server (whatever the environment says)."""
        import boto3

        env = aws_env(self.endpoint)
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=env["AWS_DEFAULT_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip

    def upload_folder(self, folder: str | os.PathLike, url: str) -> list[str]:
        """Copy every file under `folder` to `url` ("s3://bucket/prefix", the bucket made if
        missing), keeping relative paths; returns the URLs of the objects, sorted."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"not an s3://bucket[/prefix] URL: {url}")
        bucket, prefix = parts.netloc, parts.path.strip("/")
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        urls = []
        root = Path(folder)
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            key = "/".join(filter(None, (prefix, file.relative_to(root).as_posix())))
            client.upload_file(str(file), bucket, key)
            urls.append(f"s3://{bucket}/{key}")
        return urls

    def reset(self) -> None:
        """Delete every bucket: moto's reset of its whole state."""
        urllib.request.urlopen(
            urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST"), timeout=30
        ).close()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture()
def serve_http() -> Iterator[Callable[..., ShardHTTPServer]]:
    """Start ShardHTTPServers: `serve_http(folder, faults=...)`; all are closed after the test."""
    with contextlib.ExitStack() as stack:

        def start(folder: str | os.PathLike, **kw) -> ShardHTTPServer:
            return stack.enter_context(ShardHTTPServer(folder, **kw))

        yield start


@pytest.fixture(scope="session")
def s3_session() -> Iterator[S3Server]:
    """One moto S3 server for the test session; S3 clients point at it from its start on."""
    with S3Server() as server:
        yield server


@pytest.fixture()
def s3(s3_session: S3Server) -> S3Server:
    """The session's S3 server, emptied: `s3.upload_folder(folder, "s3://bucket/prefix")`."""
    s3_session.reset()
    return s3_session
