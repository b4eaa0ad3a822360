"""Wheels for a GPU node without internet (an air-gapped cluster): `ssl-vit[node]` and all it needs.

    python benchmarks/offline_kit.py --present node-packages.txt [--python 3.12] [--fmnist DIR]
    (`make offline-kit PRESENT=node-packages.txt` runs the same; copy .whl/ over)

An offline GPU node usually has a Python with torch and a list of other packages, and no way
to reach PyPI. Run this on a machine that can, with --present naming what the node already has
(`pip freeze` or `pip list --format=freeze` run there, or one name per line). It writes .whl/:
  ssl_vit-*.whl              this tree, built as a wheel (rebuilt on every run);
  deepspeed-*.whl            the deepspeed package as installed here, packed as a wheel (PyPI
                             has only its source; its ops compile on first use, so the Python
                             files suffice);
  the other *.whl            manylinux wheels, for the node's Python (--python) on Linux x86_64,
                             of what `ssl-vit[node]` requires (pyproject.toml: the base
                             dependencies and the `node` extra, or --extras) and everything
                             those require, found by reading each wheel's Requires-Dist under
                             the node's markers, stopping at what --present lists.
With --fmnist DIR, Fashion-MNIST's four IDX files from DIR go to .fmnist/ too (the study's
data). On the node, benchmarks/offline_install.sh (`make offline-install KIT=.whl`) installs
the kit with pip, the package index switched off.
Versions are this venv's, so the node runs the code the test suite tested. A wheel already in
.whl is kept (the job resumes); a second version of one package is refused, since pip would stop
on it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "ssl-vit"
# Built from its installed files, not downloaded: PyPI has no wheel of it.
REPACKED = ("deepspeed",)
# What a wheel of this tree is built from (pyproject.toml packs ssl_vit/ alone).
SOURCES = ("pyproject.toml", "README.md", "ssl_vit")
# The node's interpreter and platform, for evaluating environment markers (--python sets the
# version).
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def canonical(name: str) -> str:
    """PEP 503 name: `PyYAML`, `pyyaml` and `py_yaml` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def present_names(text: str) -> set[str]:
    """Package names from a list: `pip freeze` lines (name==version, name @ url), or names one
    per line or separated by commas; blank lines and # comments are passed over."""
    names = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for item in line.split(","):
            name = re.split(r"[=<>!~ @\[;]", item.strip(), maxsplit=1)[0]
            if name and not name.startswith("-"):
                names.add(canonical(name))
    return names


def needs(requires_dist: Iterable[str], extras: Iterable[str] = ()) -> list[str]:
    """What a package requires on the target, with `extras` of it asked for (others are
    dropped): names, with the extras asked of them (`cuda-toolkit[cudart,nvrtc]`)."""
    envs = [TARGET, *({**TARGET, "extra": e} for e in extras)]
    out = []
    for spec in requires_dist:
        req = Requirement(spec)
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            asked = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            out.append(canonical(req.name) + asked)
    return out


def closure(
    roots: Iterable[str],
    present: set[str],
    requires: Callable[[str], list[str]],
    prefetch: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Every package reachable from `roots` through `requires`, not crossing `present`, breadth
    first. A package asked again with extras not asked before is read again, with all of them.
    `prefetch`, if given, sees each level's names before any of them is read (one download for
    the level rather than one a package)."""
    kit: list[str] = []
    asked: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        level, todo = todo, []
        if prefetch is not None:
            prefetch([canonical(Requirement(spec).name) for spec in level])
        for spec in level:
            req = Requirement(spec)
            name, extras = canonical(req.name), set(req.extras)
            if name in present or (name in asked and extras <= asked[name]):
                continue
            if name not in asked:
                kit.append(name)
            asked[name] = asked.get(name, set()) | extras
            with_extras = f"{name}[{','.join(sorted(asked[name]))}]" if asked[name] else name
            todo.extend(requires(with_extras))
    return kit


def wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(z.read(meta).decode())  # the body is prose
    return headers.get_all("Requires-Dist") or []


def wheel_of(name: str, folder: Path) -> Path | None:
    found = [w for w in folder.glob("*.whl") if canonical(w.name.split("-")[0]) == name]
    if len(found) > 1:
        sys.exit(f"{folder}: holds {len(found)} wheels of {name}; keep one (pip would stop)")
    return found[0] if found else None


def _pin(name: str) -> str:
    try:
        return f"{name}=={md.version(name)}"  # this venv's version: the one the suite tested
    except md.PackageNotFoundError:
        return name  # not installed here: the latest


def _download(pins: list[str], folder: Path) -> bool:
    """`pip download` of `pins` (no dependencies) as the target's wheels; whether all came."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", TARGET["python_version"], "--implementation", "cp",
           "-d", str(folder), *pins]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return subprocess.run(cmd).returncode == 0


def fetch_level(names: list[str], folder: Path, present: set[str]) -> None:
    """The wheels of a level of the closure that are not in `folder` yet, in one `pip download`
    (each pip start costs about a second); a level that fails is left to `fetch`, one package
    at a time, which names the one pip cannot find."""
    pins = sorted(
        {_pin(n) for n in names
         if n not in present and n != PROJECT and n not in REPACKED and wheel_of(n, folder) is None}
    )  # fmt: skip
    if pins:
        _download(pins, folder)


def fetch(name: str, folder: Path) -> Path:
    """The target's wheel of `name` at this venv's version (latest if not installed here)."""
    have = wheel_of(name, folder)
    if have is not None:
        return have
    pin = _pin(name)
    if not _download([pin], folder):
        sys.exit(f"{pin}: pip found no Linux x86_64 wheel for Python {TARGET['python_version']}")
    got = wheel_of(name, folder)
    assert got is not None, f"pip downloaded {pin} under another name"
    return got


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def repack_installed(name: str, folder: Path) -> Path:
    """A wheel of `name` as installed here, from its RECORD: the package's files, its scripts
    (shebangs made `#!python`, which pip rewrites for the node's interpreter) and its metadata,
    without what pip wrote at install time. Pure-Python installs only."""
    dist = md.distribution(name)
    have = wheel_of(name, folder)
    if have is not None and have.name.split("-")[1] == dist.version:
        return have
    if have is not None:
        have.unlink()  # another version: this venv's is the one the suite tested
    info = HeaderParser().parsestr(dist.read_text("WHEEL") or "")
    tags = info.get_all("Tag") or []
    if info.get("Root-Is-Purelib", "").lower() != "true" or not all(
        t.endswith("-none-any") for t in tags
    ):
        sys.exit(f"{name}: installed as {tags or 'no wheel'}, not pure Python; cannot repack it")
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}"
    data_dir, lines = f"{stem}.data", []
    dest = folder / f"{stem}-{tags[0].split('-', 1)[0]}-none-any.whl"
    part = dest.with_suffix(".part")
    skip = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files or []:
            rel = f.as_posix()
            if "__pycache__" in f.parts or rel.endswith(".pyc"):
                continue
            if ".dist-info/" in rel and f.name in skip:
                continue
            data = Path(f.locate()).read_bytes()
            if rel.startswith("../"):  # a script in the environment's bin/
                if f.parent.name != "bin":
                    continue
                rel = f"{data_dir}/scripts/{f.name}"
                head, sep, rest = data.partition(b"\n")
                if head.startswith(b"#!") and b"python" in head:
                    data = b"#!python" + sep + rest
            z.writestr(rel, data)
            lines.append(_record_line(rel, data))
        meta = next(f for f in dist.files or [] if f.match("*.dist-info/METADATA"))
        record = f"{meta.parent.as_posix()}/RECORD"
        z.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    part.replace(dest)
    return dest


def build_project(folder: Path) -> Path:
    """This tree as a wheel, built from a copy of its sources (a build/ left in the tree by an
    older build could add modules deleted since); replaces an older one in `folder`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        for part in SOURCES:
            if (ROOT / part).is_dir():
                shutil.copytree(
                    ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                src.mkdir(exist_ok=True)
                shutil.copy2(ROOT / part, src / part)
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, str(src)]
        if importlib.util.find_spec("setuptools") is not None:
            cmd.insert(5, "--no-build-isolation")  # no download of setuptools for each build
        if subprocess.run(cmd).returncode != 0:
            sys.exit(f"pip could not build a wheel of {ROOT}")
        (built,) = Path(tmp).glob("*.whl")
        old = wheel_of(PROJECT, folder)
        if old is not None:
            old.unlink()
        return Path(shutil.move(built, folder / built.name))


def copy_fmnist(src: Path, dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    for stem in FMNIST_FILES:
        hits = [p for p in (src / stem, src / f"{stem}.gz") if p.is_file()]
        if not hits:
            sys.exit(f"--fmnist {src}: no {stem}[.gz] (Debian's dataset-fashion-mnist has them)")
        shutil.copy2(hits[0], dest / hits[0].name)


def kit_requires(spec: str, folder: Path, project_extras: list[str]) -> list[str]:
    """What `spec` (a name, with extras) requires on the node, from its wheel in `folder`
    (built or fetched here)."""
    req = Requirement(spec)
    name = canonical(req.name)
    if name == PROJECT:
        return needs(wheel_requires(build_project(folder)), project_extras)
    if name in REPACKED:
        return needs(wheel_requires(repack_installed(name, folder)), req.extras)
    return needs(wheel_requires(fetch(name, folder)), req.extras)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--present",
        type=Path,
        required=True,
        help="what the node has: `pip freeze` output from it, or one package name per line",
    )
    p.add_argument("--python", default="3.12", help="the node's Python version (major.minor)")
    p.add_argument("--out", type=Path, default=ROOT / ".whl", help="the wheels' folder")
    p.add_argument(
        "--extras",
        default="node",
        help="extras of ssl-vit to pack, comma-separated (pyproject.toml; default: node)",
    )
    p.add_argument(
        "--fmnist",
        type=Path,
        help="a folder with Fashion-MNIST's IDX files: copied to .fmnist/ beside the wheels",
    )
    args = p.parse_args(argv)
    if not args.present.is_file():
        p.error(f"--present {args.present}: not a file")
    present = present_names(args.present.read_text()) - {PROJECT}
    TARGET["python_version"] = TARGET["python_full_version"] = args.python
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    args.out.mkdir(parents=True, exist_ok=True)

    kit = closure(
        [PROJECT],
        present,
        lambda n: kit_requires(n, args.out, extras),
        lambda names: fetch_level(names, args.out, present),
    )
    for w in args.out.glob("*.whl"):  # an older kit's wheel that nothing requires now
        if canonical(w.name.split("-")[0]) not in kit:
            w.unlink()
    (args.out / "deepspeed-site.tgz").unlink(missing_ok=True)  # older kits' deepspeed
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"{len(kit)} wheels in {args.out}: {size / 2**20:.1f} MiB")
    print("wheels: " + ", ".join(sorted(kit)))
    if args.fmnist is not None:
        copy_fmnist(args.fmnist, ROOT / ".fmnist")
        print(f"Fashion-MNIST in {ROOT / '.fmnist'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
