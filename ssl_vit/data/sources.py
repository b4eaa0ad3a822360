"""Enumerate a corpus into `Item`s: image folders, list files and IDX (MNIST-format) datasets.

Enumeration never decodes images; it only finds what to shard. Problems that are visible without
reading pixels (dangling symlinks, symlinks leaving the source folder, duplicate list entries) are
returned as error records so the job can skip them and keep going.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ssl_vit.data.manifest import SPLIT_NAME
from ssl_vit.data.urls import Retry, has_braces, join, list_folder, open_url, read_bytes, reason

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}
)
LIST_EXTENSIONS = (".txt", ".csv", ".jsonl")
# Folder layouts with these top-level names keep their own split (ImageNet-style train/val).
SPLIT_FOLDERS = {
    "train": "train",
    "val": "val",
    "valid": "val",
    "validation": "val",
    "test": "test",
}
# IDX file prefixes (or their last -part) that name a split: MNIST's train / t10k.
IDX_SPLITS = {"train": "train", "t10k": "test", "test": "test"}

FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
MNIST_CLASSES = [str(i) for i in range(10)]
# md5 of the *decompressed* Fashion-MNIST label files (gzip bytes differ between mirrors).
_FASHION_LABEL_MD5 = {"9018921c3c673c538a1fc5bad174d6f9", "15d484375f8d13e6eb1aabb0c3f46965"}


class SourceError(ValueError):
    """The source as a whole is unusable (missing, unknown kind, malformed list or IDX file)."""


@dataclass(frozen=True)
class Item:
    """One input image. `rel` identifies it (key, split hash); exactly one of path/pixels is set."""

    rel: str
    label: int | None
    path: str | None = None  # absolute file path to read
    pixels: np.ndarray | None = field(default=None, compare=False)  # (H, W) uint8 for IDX
    split: str | None = None  # fixed by the source (IDX files, split folders, list column)
    key: str | None = None  # a readable key the source guarantees unique (IDX: "train_000123")
    offset: int | None = None  # a sample of the tar at `path`: its byte offset (a WebDataset set)


@dataclass
class Listing:
    kind: str  # "folder" | "list" | "idx" | "webdataset"
    items: list[Item]
    errors: list[dict[str, str]]
    class_names: list[str] | None
    grayscale: bool  # True when the source is known to be single-channel (IDX)
    numeric_labels: bool = False  # labels were integers (IDX, list files): any names may fit


def _err(rel: str, reason: str) -> dict[str, str]:
    return {"source": rel, "reason": reason}


def open_source(
    source: str | os.PathLike,
    *,
    follow_symlinks: bool = False,
    class_names: list[str] | None = None,
    labels: bool = True,
) -> Listing:
    """Detect the source kind and enumerate it (see make_shards.py --help for the layouts). A
    URL (s3://, gs://, http(s):// with a listing fsspec reads) is an image folder read where
    it is: nothing is copied first."""
    src = Path(source)
    text = os.fspath(source)
    if _is_webdataset(text):
        listing = _webdataset_set(text)
    elif is_remote(source) and text.lower().endswith(LIST_EXTENSIONS):
        listing = _list_file(text)
    elif is_remote(source):
        listing = _remote_image_folder(text)
    elif not src.exists():
        raise SourceError(
            f"{src}: source not found; give an image folder, a list file or an IDX folder"
        )
    elif src.is_file():
        if src.suffix.lower() not in LIST_EXTENSIONS:
            raise SourceError(
                f"{src}: a file source must be a list file ({', '.join(LIST_EXTENSIONS)})"
            )
        listing = _list_file(src)
    elif _idx_pairs(src):
        listing = _idx_folder(src)
    else:
        listing = _image_folder(src, follow_symlinks=follow_symlinks)
    if class_names is not None:
        named = listing.class_names is not None and not listing.numeric_labels
        if named and len(class_names) != len(listing.class_names or []):
            raise SourceError(
                f"{source}: --class-names gives {len(class_names)} names but the source has "
                f"{len(listing.class_names)} classes"
            )
        top = max((it.label for it in listing.items if it.label is not None), default=-1)
        if top >= len(class_names):
            raise SourceError(
                f"{source}: label {top} is out of range for {len(class_names)} class names"
            )
        listing.class_names = list(class_names)
    if not labels:
        listing.items = [replace(it, label=None) for it in listing.items]
        listing.class_names = None
    return listing


def is_remote(source: str | os.PathLike) -> bool:
    """Whether a source is a URL read through fsspec rather than a local path."""
    text = os.fspath(source)
    return "://" in text and not text.startswith("file://")


def _top_folders(subdirs: list[str]) -> list[tuple[str, str | None]]:
    """The (top folder, split) groups of an image folder with these sorted subfolders:
    ImageNet-style train/val folders keep their own split; anything else is one group ("", split
    by hash later)."""
    if subdirs and all(d.lower() in SPLIT_FOLDERS for d in subdirs):
        return [(d, SPLIT_FOLDERS[d.lower()]) for d in subdirs]
    return [("", None)]


def _image_folder(root: Path, *, follow_symlinks: bool) -> Listing:
    root_real = root.resolve()
    errors: list[dict[str, str]] = []
    subdirs = sorted(e.name for e in os.scandir(root) if _is_dir(e) and not e.name.startswith("."))
    groups = [(top, split, _walk(root, top, root_real, follow_symlinks, errors))
              for top, split in _top_folders(subdirs)]  # fmt: skip
    return _class_folders(groups, errors, lambda rel: str(root / rel))


def _remote_image_folder(url: str) -> Listing:
    """An image folder at a URL, listed once (fsspec's `find`: a paged listing on object
    storage); its files are read by the shard workers from where they are."""
    root = url.rstrip("/")
    try:
        found = list_folder(root, recursive=True)
    except Exception as e:  # a bucket or server that cannot be listed, after the retries
        raise SourceError(f"{root}: cannot be listed ({reason(e)}); check the URL and the "
                          "credentials") from None  # fmt: skip
    rels = [
        r
        for r in found
        if Path(r).suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in r.split("/"))
    ]
    if not rels:
        raise SourceError(f"{root}: no image files found there; check the URL")
    tops = _top_folders(sorted({r.split("/", 1)[0] for r in rels if "/" in r}))
    groups = [(top, split, [r for r in rels if not top or r.split("/", 1)[0] == top])
              for top, split in tops]  # fmt: skip
    return _class_folders(groups, [], lambda rel: f"{root}/{rel}")


def _class_folders(
    groups: list[tuple[str, str | None, list[str]]],
    errors: list[dict[str, str]],
    locate,
) -> Listing:
    """Items of an image folder's files (relative paths under each top folder): the classes
    are the sorted union of second-level folder names over every split; `locate(rel)` is where
    a file is read from."""
    # (rel, split, its path inside the top folder cut at the first "/": [class, rest] or [file])
    files = [(rel, split, (rel[len(top) + 1 :] if top else rel).split("/", 1))
             for top, split, rels in groups for rel in rels]  # fmt: skip
    names = sorted({inner[0] for _, _, inner in files if len(inner) == 2}) or None
    index = {n: i for i, n in enumerate(names or [])}
    items: list[Item] = []
    for rel, split, inner in files:
        if names is None:
            items.append(Item(rel, None, locate(rel), split=split))
        elif len(inner) == 2:
            items.append(Item(rel, index[inner[0]], locate(rel), split=split))
        else:
            errors.append(_err(rel, "file beside the class folders has no class; move it"))
    return Listing("folder", items, errors, names, grayscale=False)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _walk(
    root: Path, top: str, root_real: Path, follow: bool, errors: list[dict[str, str]]
) -> list[str]:
    """Relative posix paths of image files under root/top, in sorted order."""
    out: list[str] = []
    seen: set[str] = set()

    def visit(rel_dir: str) -> None:
        path = root / rel_dir if rel_dir else root
        real = os.path.realpath(path)
        if real in seen:  # a followed symlink loop
            return
        seen.add(real)
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as e:
            errors.append(_err(rel_dir or ".", f"unreadable folder ({e.strerror})"))
            return
        for e in entries:
            if e.name.startswith("."):
                continue
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if e.is_symlink():
                target = Path(os.path.realpath(e.path))
                if not target.exists():
                    if Path(e.name).suffix.lower() in IMAGE_EXTENSIONS:
                        errors.append(_err(rel, "dangling symlink (its target does not exist)"))
                    continue
                if not follow and not target.is_relative_to(root_real):
                    errors.append(
                        _err(
                            rel,
                            "symlink points outside the source folder; "
                            "pass --follow-symlinks to include it",
                        )
                    )
                    continue
            if _is_dir(e):
                visit(rel)
            elif Path(e.name).suffix.lower() in IMAGE_EXTENSIONS:
                out.append(rel)

    visit(top)
    return out


_Row = tuple[str, str | int | None, str | None]  # (path, label, split)


def _jsonl_rows(path: Path, text: str) -> list[_Row]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append((str(obj["path"]), obj.get("label"), obj.get("split")))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SourceError(
                f'{path}:{n}: expected a JSON object with "path" (and optional "label", "split")'
            ) from None
    return rows


def _csv_rows(path: Path, text: str) -> list[_Row]:
    table = [r for r in csv.reader(text.splitlines()) if r and any(c.strip() for c in r)]
    header = [c.strip().lower() for c in table[0]] if table else []
    if "path" in header:
        col = {name: header.index(name) for name in ("path", "label", "split") if name in header}
        table = table[1:]
    elif {"label", "split"} & set(header):  # a header, but the path column is misnamed
        raise SourceError(
            f"{path}: the header names columns {', '.join(header)} but none is 'path'; "
            "name the column of image paths 'path'"
        )
    else:
        col = {"path": 0, "label": 1}
    cells = [{k: r[i].strip() for k, i in col.items() if i < len(r)} for r in table]
    return [(c.get("path", ""), c.get("label"), c.get("split") or None) for c in cells]


def _txt_rows(path: Path, text: str) -> list[_Row]:
    """ "path" or "path<TAB>label" (without a tab, a last blank-separated token is one)."""
    lines = [ln.strip() for ln in text.splitlines()]
    rows = [ln.split("\t") if "\t" in ln else ln.rsplit(None, 1)
            for ln in lines if ln and not ln.startswith("#")]  # fmt: skip
    return [(r[0].strip(), r[1].strip() if len(r) > 1 else None, None) for r in rows]


def _class_names(path: Path, rows: list[_Row]) -> tuple[list[str] | None, bool]:
    """(class names, whether the labels are integers) of a list file's labels."""
    labels = [lab for _, lab, _ in rows if lab is not None and lab != ""]
    numeric = all(
        isinstance(x, int) or (isinstance(x, str) and x.lstrip("-").isdigit()) for x in labels
    )
    if not labels:
        return None, numeric
    if not numeric:
        return sorted({str(x) for x in labels}), numeric
    if min(int(x) for x in labels) < 0:
        raise SourceError(f"{path}: labels must be non-negative integers or class names")
    return [str(i) for i in range(max(int(x) for x in labels) + 1)], numeric


def _list_file(where: Path | str) -> Listing:
    """Rows of (path, optional label, optional split); paths are relative to the list's folder
    (a list file at a URL: to that URL's folder), or URLs of images read where they are."""
    if isinstance(where, str):  # a URL
        try:
            text = read_bytes(where).decode("utf-8-sig")
        except Exception as e:  # after the retries; not UTF-8
            raise SourceError(f"{where}: unreadable list file ({reason(e)})") from None
        path, base = Path(where.rsplit("/", 1)[-1]), where.rsplit("/", 1)[0]
    else:
        path, base = where, None
        text = path.read_text(encoding="utf-8-sig")
    parse = {".jsonl": _jsonl_rows, ".csv": _csv_rows}.get(path.suffix.lower(), _txt_rows)
    rows = parse(path, text)
    names, numeric = _class_names(path, rows)
    index = {n: i for i, n in enumerate(names or [])}
    items: list[Item] = []
    errors: list[dict[str, str]] = []
    seen: set[str] = set()
    for p, lab, split in rows:
        rel = Path(p).as_posix()
        if not p:
            continue
        if rel in seen:
            errors.append(_err(rel, "duplicate entry in the list file; kept the first one"))
            continue
        seen.add(rel)
        if split is not None and split.lower() not in SPLIT_FOLDERS:
            raise SourceError(f"{path}: {rel}: split {split!r} is not train/val/test")
        label = None if lab is None or lab == "" else (int(lab) if numeric else index[str(lab)])
        fixed = SPLIT_FOLDERS[split.lower()] if split else None
        if is_remote(p) or base is not None:  # an image at a URL, read where it is
            url = p if is_remote(p) else f"{base}/{p.lstrip('/')}"
            # a list read from a server is data: it names files beside it or on web servers,
            # never this machine's files nor buckets the user's credentials open
            foreign = is_remote(p) and not p.startswith(("http://", "https://"))
            if base is not None and (".." in p.split("/") or foreign):
                errors.append(_err(rel, "a list file at a URL names only http(s) URLs and paths"))
                continue
            items.append(Item(p, label, url, split=fixed))
            continue
        full = Path(p) if Path(p).is_absolute() else path.parent / p
        if full.is_symlink() and not full.exists():
            errors.append(_err(rel, "dangling symlink (its target does not exist)"))
            continue
        items.append(Item(rel, label, str(full), split=fixed))
    return Listing("list", items, errors, names, grayscale=False, numeric_labels=numeric)


def _is_webdataset(source: str) -> bool:
    """A WebDataset set as a source: a brace pattern or a .tar URL or path, or a folder (local or
    on object storage) of .tar files and no images."""
    if has_braces(source) or source.endswith(".tar"):
        return True
    if source.startswith(("http://", "https://")):
        return False  # a web server cannot be listed: give a pattern
    if not is_remote(source) and not Path(source).is_dir():
        return False
    try:
        names = [n.lower() for n in list_folder(source, retry=Retry(attempts=1))]
    except Exception:  # the image folder listing reports it, after its retries
        return False
    images = any(Path(n).suffix in IMAGE_EXTENSIONS for n in names)
    return not images and any(n.endswith(".tar") for n in names)


def _webdataset_set(source: str) -> Listing:
    """The samples of a WebDataset set (made by this project or another tool), to re-shard or
    resize: each shard is read once here for its keys and labels (`cls`); the workers then read
    each sample's image by its offset."""
    from concurrent.futures import ThreadPoolExecutor

    from ssl_vit.data.index_in_place import IndexJobError, list_shards
    from ssl_vit.data.tar_reader import TarFormatError, read_samples

    try:
        root, names = list_shards(source)
    except IndexJobError as e:
        raise SourceError(str(e)) from None

    def samples(name: str) -> list[tuple[str, int, int | None]] | str:
        """(key, offset, label) of each sample of a shard, or why the shard cannot be read (a
        reason recorded in errors.jsonl, as a bad image's is)."""
        url = join(root, name)
        out = []
        try:
            f, _ = Retry().call(lambda: open_url(url), url)
            with f:
                for at, sample in read_samples(f, url):
                    if sample is not None:
                        raw = sample.get("cls", b"").strip()
                        out.append((sample["__key__"], at, int(raw) if raw.isdigit() else None))
        except TarFormatError as e:
            return f"unreadable tar ({e})"
        except Exception as e:  # a read that failed after its retries
            return f"unreadable ({reason(e)})"
        return out

    items: list[Item] = []
    errors: list[dict[str, str]] = []
    with ThreadPoolExecutor(8) as pool:
        for name, listed in zip(names, pool.map(samples, names), strict=True):
            if isinstance(listed, str):
                errors.append(_err(name, listed))
                continue
            for key, at, label in listed:
                items.append(Item(f"{name}/{key}", label, join(root, name), offset=at))
    labels = [it.label for it in items if it.label is not None]
    if labels and len(labels) < len(items):
        raise SourceError(
            f"{source}: {len(items) - len(labels)} of {len(items)} samples have no integer .cls; "
            "give --no-labels to shard them unlabelled"
        )
    classes = [str(i) for i in range(max(labels) + 1)] if labels else None
    return Listing("webdataset", items, errors, classes, grayscale=False, numeric_labels=True)


def _idx_pairs(folder: Path) -> dict[str, tuple[Path, Path | None]]:
    """{split: (images, labels)} for `<prefix>-images-idx3-ubyte[.gz]` files. A prefix `train`,
    `t10k` or `test`, or one ending in `-train` / `-test` (EMNIST's `emnist-letters-train`),
    names that split; another prefix is a split of its own name."""
    if not folder.is_dir():
        return {}
    pairs: dict[str, tuple[Path, Path | None]] = {}
    prefixes: set[str] = set()
    for f in sorted(folder.iterdir()):  # a plain file sorts before its .gz twin, which is left
        name = f.name.removesuffix(".gz")
        prefix = name.removesuffix("-images-idx3-ubyte")
        if prefix == name or prefix in prefixes:
            continue
        split = IDX_SPLITS.get(prefix.rsplit("-", 1)[-1], prefix)
        if SPLIT_NAME.fullmatch(split) is None:
            raise SourceError(
                f"{f}: the IDX prefix {prefix!r} is not a split name (letters, digits and _, "
                "or ending in -train / -test); rename the images and labels files"
            )
        if split in pairs:
            raise SourceError(
                f"{f}: split {split!r} also comes from {pairs[split][0].name}; "
                "give make_shards one IDX dataset per folder"
            )
        prefixes.add(prefix)
        lab = [folder / f"{prefix}-labels-idx1-ubyte{gz}" for gz in ("", ".gz")]
        pairs[split] = (f, next((p for p in lab if p.exists()), None))
    return pairs


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise SourceError(f"{path}: cannot read IDX file ({e})") from None
    if len(raw) < 4 + 4 * ndim or int.from_bytes(raw[:4], "big") != 0x0800 + ndim:
        raise SourceError(f"{path}: not an unsigned-byte IDX file with {ndim} dimensions")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = raw[4 + 4 * ndim :]
    if len(body) != int(np.prod(dims)):
        raise SourceError(f"{path}: truncated IDX file (header says {dims}, got {len(body)} bytes)")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def _idx_folder(folder: Path) -> Listing:
    items: list[Item] = []
    recognised_fashion = "fashion" in folder.resolve().as_posix().lower()
    has_labels = True
    for split, (img_path, lab_path) in sorted(_idx_pairs(folder).items()):
        images = _read_idx(img_path, 3)  # (N, H, W)
        labels = None if lab_path is None else _read_idx(lab_path, 1)  # (N,)
        has_labels &= labels is not None
        if labels is not None:
            if len(labels) != len(images):
                raise SourceError(f"{lab_path}: {len(labels)} labels for {len(images)} images")
            recognised_fashion |= hashlib.md5(labels.tobytes()).hexdigest() in _FASHION_LABEL_MD5
        for i in range(len(images)):
            rel = f"{img_path.name}#{i}"
            lab = None if labels is None else int(labels[i])
            items.append(Item(rel, lab, pixels=images[i], split=split, key=f"{split}_{i:06d}"))
    names = None
    if has_labels:
        top = max((it.label for it in items if it.label is not None), default=-1) + 1
        names = FASHION_MNIST_CLASSES if recognised_fashion else MNIST_CLASSES
        names = list(names) if top <= len(names) else [str(i) for i in range(top)]
    return Listing("idx", items, [], names, grayscale=True, numeric_labels=True)
