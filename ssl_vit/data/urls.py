"""Where a shard set lives, and how its files are opened: a local folder or any URL.

`data.root`, every evaluation's `--data` and `verify_shards.py` take a folder (or file://),
https://, s3:// or gs:// (fsspec, with s3fs or gcsfs), or 'pipe:CMD' with {} for the file name
(docs/streaming.md has the table). A file of the set is its name joined onto the root (put in
place of `{}` for a pipe). Remote files are opened through fsspec, whose files seek with ranged
requests: a reader that starts in the middle of a shard (the manifest's offset index) fetches
only what it reads. Pipes are opened by webdataset's `gopen` and read from their start; a reader
skips what it does not need.

Transient failures (a reset connection, a body cut short, a timeout, a 5xx answer) are retried
with exponential backoff by `Retry`; a file that does not exist (404, no such key) is not.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
PIPE = "pipe:"
_REMOTE_BLOCK = 8 << 20  # bytes fetched per ranged request: large enough to stream a shard


def is_pipe(url: str) -> bool:
    return str(url).startswith(PIPE)


def local_path(url: str | os.PathLike) -> Path | None:
    """The local path a root or file URL names, or None for a remote one or a pipe."""
    text = os.fspath(url)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    if "://" in text or is_pipe(text):
        return None
    return Path(text)


def normalise_root(root: str | os.PathLike) -> str:
    """A root as readers store it: an absolute local path, or the URL without a trailing '/'."""
    path = local_path(root)
    if path is not None:
        return str(path.resolve())
    return os.fspath(root) if is_pipe(os.fspath(root)) else os.fspath(root).rstrip("/")


# A file of a shard set is one plain name: no folder part, no leading dot (so no "..") and no
# character a shell or a URL would read as syntax. Names come from manifests, which are data.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def is_plain_name(name: str) -> bool:
    """Whether `name` is one plain file name that `join` takes."""
    return _SAFE_NAME.fullmatch(name) is not None


class UnsafeNameError(ValueError):
    """A file name from a shard set that could leave the set or reach a shell."""


def join(root: str, name: str) -> str:
    """The URL of file `name` of the set at `root`.

    `name` is untrusted (manifests are data): anything but one plain file name is refused, so a
    name never reaches a file outside the set nor, through a pipe root, a shell. The user's own
    command around `{}` is trusted; the name put in its place is quoted all the same."""
    if not _SAFE_NAME.fullmatch(name):
        raise UnsafeNameError(
            f"{name!r}: not a plain file name of a shard set (letters, digits, '_', '-', '.'); "
            "refusing to read it"
        )
    if is_pipe(root):
        if "{}" not in root:
            raise ValueError(f"{root!r}: a pipe root needs '{{}}' where the file name goes")
        return root.replace("{}", shlex.quote(name))
    path = local_path(root)
    return str(path / name) if path is not None else f"{root.rstrip('/')}/{name}"


# WebDataset's shard patterns: `data-{000000..000099}.tar` (a zero-padded range, with an
# optional step: `{0..98..2}`) and `{train,val}`, several per pattern, expanded left to right.
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?[0-9]+)\.\.(-?[0-9]+)(?:\.\.([1-9][0-9]*))?")
MAX_EXPANSION = 1_000_000  # names one pattern may give: a typo's {0..9999999999} fails fast


def has_braces(text: str) -> bool:
    return "{" in text and not is_pipe(text)  # a pipe's `{}` is its own placeholder


def expand_braces(pattern: str) -> list[str]:
    """Every name a brace pattern stands for, in order: the first brace varies slowest."""
    match = _BRACE.search(pattern)
    if match is None:
        if "{" in pattern or "}" in pattern:
            raise ValueError(f"{pattern!r}: an unmatched brace; write {{a..b}} or {{x,y}}")
        return [pattern]
    body, head, tail = match.group(1), pattern[: match.start()], pattern[match.end() :]
    numbers = _RANGE.fullmatch(body)
    if numbers:
        lo, hi, step = int(numbers.group(1)), int(numbers.group(2)), int(numbers.group(3) or 1)
        ends = (numbers.group(1).lstrip("-"), numbers.group(2).lstrip("-"))
        padded = any(len(e) > 1 and e.startswith("0") for e in ends)
        width = max(len(e) for e in ends) if padded else 0
        if abs(hi - lo) // step + 1 > MAX_EXPANSION:
            raise ValueError(f"{pattern!r}: {{{body}}} stands for more than {MAX_EXPANSION} names")
        direction = 1 if hi >= lo else -1
        parts = [str(v).zfill(width) for v in range(lo, hi + direction, step * direction)]
    elif "," in body:
        parts = body.split(",")
    else:
        raise ValueError(f"{pattern!r}: {{{body}}} is neither a range {{a..b}} nor a list {{x,y}}")
    rests = expand_braces(tail)
    if len(parts) * len(rests) > MAX_EXPANSION:
        raise ValueError(f"{pattern!r}: stands for more than {MAX_EXPANSION} names")
    return [head + p + rest for p in parts for rest in rests]


def split_pattern(root: str) -> tuple[str, list[str]] | None:
    """(folder, file names) of a brace pattern naming shards (`https://host/set/{0..9}.tar`);
    None where `root` has no braces. Only the file name may hold braces: a set is one folder."""
    if not has_braces(root):
        return None
    folder, _, name = root.rstrip("/").rpartition("/")
    if not folder or "{" in folder or "}" in folder:
        raise ValueError(
            f"{root!r}: braces may stand only in the file name part of a pattern "
            "(one folder per shard set)"
        )
    return folder, expand_braces(name)


@dataclass(frozen=True)
class Retry:
    """How often and how patiently a failed read is tried again (remote files only)."""

    attempts: int = 5  # tries in all, the first included
    backoff: float = 1.0  # seconds before the second try, doubled for each later one
    timeout: float = 60.0  # seconds a remote read may stall before it counts as failed
    # bytes/s below which an http(s) request fails even while bytes keep coming (a server
    # that drips never trips `timeout`): each request must end within
    # timeout + block / min_rate seconds (92 s for the 8 MiB blocks at the default)
    min_rate: float = float(256 << 10)

    @property
    def deadline(self) -> float:
        """Seconds one ranged http(s) request may take in all."""
        return self.timeout + _REMOTE_BLOCK / self.min_rate

    def call(self, fn: Callable[[], T], what: str) -> T:
        """fn(), tried again after transient errors; the last error is raised as it was."""
        for attempt in range(self.attempts - 1):
            try:
                return fn()
            except Exception as e:
                if is_missing(e):
                    raise
                time.sleep(self.backoff * 2**attempt)
        return fn()  # the last try: its error is raised as it was


def is_missing(error: BaseException | None) -> bool:
    """An error that another try will not change: the file does not exist or is forbidden.

    fsspec's HTTP files raise FileNotFoundError for any failure at open (a 503, a refused
    connection), with the reason as its cause, and aiohttp's ClientResponseError for a bad
    status while reading: the HTTP status decides where there is one."""
    if error is None:
        return False
    cause = error.__cause__
    status = getattr(error, "status", None) or getattr(cause, "status", None)
    if isinstance(status, int):
        return status in (401, 403, 404, 410)
    if cause is not None and "Connect" in type(cause).__name__:  # a refused connection
        return False
    return isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError))


def reason(error: BaseException) -> str:
    """Why a read failed, on one line: the innermost cause (fsspec wraps a refused connection
    or a redirect loop in a bare FileNotFoundError), with bytes and control characters from a
    server escaped."""
    inner = error
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = " ".join(str(inner).encode("ascii", "backslashreplace").decode("ascii").split())
    return f"{type(inner).__name__}: {text[:300]}"


# Servers found to ignore Range headers (simple web servers, some proxies): reads from them start
# at byte 0 and the reader skips forward, costing the bytes before the start (counted as read).
_NO_RANGE: set[str] = set()


def _server(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


def _mark_no_range(url: str) -> bool:
    """Record that the server of `url` ignores Range headers: later opens of its files read
    from the start (logged once per server). False where it was known already."""
    if _server(url) in _NO_RANGE:
        return False
    _NO_RANGE.add(_server(url))
    log.warning(
        "%s: the server ignores Range requests; its shards are read from their start, "
        "skipping to where each read begins (more bytes read, see data/gbytes_read)",
        _server(url),
    )
    return True


def note_no_range(error: BaseException | None, url: str) -> bool:
    """Whether `error` is fsspec's word that the server of `url` ignores Range headers; if so,
    later opens of its files read from the start. A server known already to ignore them that
    fails so again has failed for real (False)."""
    if not isinstance(error, ValueError) or "support range requests" not in str(error):
        return False
    return _mark_no_range(url)


def ranged(url: str) -> bool:
    """Whether a reader of `url` can start inside the file: false for a pipe and for a web
    server found to ignore Range requests (probe_range, note_no_range)."""
    return not is_pipe(url) and ("://" not in url or _server(url) not in _NO_RANGE)


def probe_range(url: str, retry: Retry | None = None) -> bool | None:
    """Whether the web server of `url` answers a ranged GET with that range (206); where it
    does not, later opens of its files read from the start (logged once). None: not an
    http(s) URL (files and object storage always seek, pipes never), or no answer (the
    shards' existence check reports that)."""
    if not url.startswith(("http://", "https://")):
        return None
    import urllib.request

    request = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
    try:  # the headers are enough: closing drops a body sent whole
        with urllib.request.urlopen(request, timeout=(retry or Retry()).timeout) as answer:
            ok = answer.status == 206
    except Exception:  # a missing file or a refused connection: reported by the callers
        return None
    if not ok:
        _mark_no_range(url)
    return ok


class _Stream:
    """A file read from its start to its end, never seeked (fsspec's streaming HTTP file says
    it can seek, then refuses to)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f

    def read(self, n: int = -1) -> bytes:
        return self.f.read(n)

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsspec_open(url: str, retry: Retry, stream: bool = False):
    import fsspec

    protocol = url.split("://", 1)[0]
    options: dict = {}
    if protocol in ("http", "https"):
        import aiohttp

        # A stall of `timeout` seconds fails a request, and so does one slower than min_rate
        # in all (`deadline`): fsspec reads a shard in requests of one block each.
        limits = aiohttp.ClientTimeout(
            total=retry.deadline, sock_connect=retry.timeout, sock_read=retry.timeout
        )
        options["client_kwargs"] = {"timeout": limits}
    elif protocol == "s3":
        options["config_kwargs"] = {"read_timeout": retry.timeout, "connect_timeout": retry.timeout}
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs.open(path, "rb", block_size=0 if stream else _REMOTE_BLOCK)


def open_url(url: str, start: int = 0, *, retry: Retry | None = None) -> tuple[IO[bytes], int]:
    """(binary file, the byte offset it is at): at `start` where the source can seek (a local
    file, http(s), s3, gs), at 0 for a pipe (the caller reads up to `start` itself)."""
    path = local_path(url)
    if path is not None:
        # 64 KiB: a few reads per shard of small samples, and passing over a large sample by
        # its header (a seek) refills no more than that
        f = open(path, "rb", buffering=1 << 16)  # noqa: SIM115 (the caller closes it)
        f.seek(start)
        return f, start
    if is_pipe(url):
        from webdataset.gopen import gopen

        return gopen(url, "rb"), 0
    if start and _server(url) in _NO_RANGE:  # from the start: the caller skips up to `start`
        return _Stream(_fsspec_open(url, retry or Retry(), stream=True)), 0  # type: ignore[return-value]
    f = _fsspec_open(url, retry or Retry())
    if start:
        f.seek(start)
    return f, start


def read_bytes(url: str, retry: Retry | None = None) -> bytes:
    """The whole file at `url` (a manifest, say), retried like shard reads."""
    path = local_path(url)
    if path is not None:
        return path.read_bytes()

    def read() -> bytes:
        with open_url(url, retry=retry)[0] as f:
            return f.read()

    return (retry or Retry()).call(read, url)


def exists(url: str) -> bool | None:
    """Whether a file exists: answered for local files; None (unknown until read) otherwise."""
    path = local_path(url)
    return path.is_file() if path is not None else None


def list_folder(url: str, *, recursive: bool = False, retry: Retry | None = None) -> list[str]:
    """The sorted names in the folder at `url` (local, object storage, or a web server's HTML
    index where fsspec reads one). `recursive` (remote folders only: sources.py walks local ones
    itself, minding symlinks): the relative paths of every file below it, in a paged listing on
    object storage. Remote listings are retried."""
    folder = local_path(url)
    if folder is not None:
        return sorted(os.listdir(folder))
    if is_pipe(url):
        raise ValueError(f"{url}: a pipe cannot be listed; give the folder or URL it reads")
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    found = (retry or Retry()).call(
        lambda: fs.find(path) if recursive else fs.ls(path, detail=False), url
    )
    prefix = path.rstrip("/") + "/"
    return sorted(str(f)[len(prefix) :] for f in found if str(f).startswith(prefix))


def _head(url: str, retry: Retry) -> int | None:
    """A web server's size of `url` (a HEAD), or None where it has no such file."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    try:
        return retry.call(lambda: fs.info(path), url).get("size")
    except FileNotFoundError as e:
        if is_missing(e):
            return None
        raise


def remote_sizes(urls: list[str], retry: Retry | None = None, workers: int = 16) -> dict:
    """{url: size in bytes, or None where no such file exists} of remote files, asked once
    each: a listing per folder for object storage (one request per 1,000 keys), a HEAD per file
    for a web server, `workers` at a time. Pipes cannot be asked: they are left out."""
    import fsspec

    retry = retry or Retry()
    out: dict[str, int | None] = {}
    folders: dict[str, list[str]] = {}
    for u in urls:
        if local_path(u) is None and not is_pipe(u):
            folders.setdefault(u.rsplit("/", 1)[0], []).append(u)
    for folder, members in folders.items():
        if folder.split("://", 1)[0] in ("http", "https"):  # no listing: a HEAD each
            with ThreadPoolExecutor(workers) as pool:
                sizes = pool.map(lambda u: _head(u, retry), members)
                out.update(zip(members, sizes, strict=True))
            continue
        fs, path = fsspec.core.url_to_fs(folder)
        fs.invalidate_cache(path)  # fsspec keeps listings: this one must be of now
        listed = retry.call(lambda fs=fs, path=path: fs.ls(path, detail=True), folder)
        found = {str(e["name"]).rsplit("/", 1)[-1]: e.get("size") for e in listed}
        out.update({u: found.get(u.rsplit("/", 1)[-1]) for u in members})
    return out
