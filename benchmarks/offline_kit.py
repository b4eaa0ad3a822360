"""Wheels for a GPU node without internet (an air-gapped cluster), packed beside the tree.

    python benchmarks/offline_kit.py --present target-packages.txt [--python 3.12]
    (`make offline-kit PRESENT=target-packages.txt` runs the same; copy .whl/ and .fmnist/ over)

An offline GPU node usually has a Python with torch and a list of other packages, and no way
to reach PyPI. Run this on a machine that can, with --present naming what the node already has
(`pip freeze` or `pip list --format=freeze` run there, or one name per line). It writes
  .whl/*.whl                 manylinux wheels, for the node's Python (--python) on Linux x86_64,
                             of what ssl-vit needs there (ROOTS) and everything those require,
                             found by reading each wheel's Requires-Dist under the node's
                             markers, stopping at what --present lists;
  .whl/deepspeed-site.tgz    the deepspeed package as installed here (PyPI has no wheel of it;
                             its ops compile on first use, so the Python files suffice);
  .fmnist/                   Fashion-MNIST's four IDX files (the study's data).
benchmarks/gpu_check.sh and studies/mpp_fashion_mnist/gpu_track.sh install from there.
Versions are this venv's, so the node runs the code the test suite tested. A wheel already in
.whl is kept (the job resumes); a second version of one package is refused, since pip would stop
on it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterable
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# What ssl-vit imports on a GPU node beyond torch, timm and numpy (deepspeed travels apart).
ROOTS = ("webdataset", "mlflow-skinny", "sqlalchemy", "alembic")
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


def needs(requires_dist: Iterable[str]) -> list[str]:
    """The names a package requires on the target (extras not asked for are dropped)."""
    out = []
    for spec in requires_dist:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate(TARGET):
            out.append(canonical(req.name))
    return out


def closure(
    roots: Iterable[str], present: set[str], requires: Callable[[str], list[str]]
) -> list[str]:
    """Every package reachable from `roots` through `requires`, not crossing `present`."""
    kit: list[str] = []
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop(0)
        if name in present or name in kit:
            continue
        kit.append(name)
        todo.extend(requires(name))
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


def fetch(name: str, folder: Path) -> Path:
    """The target's wheel of `name` at this venv's version (latest if not installed here)."""
    have = wheel_of(name, folder)
    if have is not None:
        return have
    try:
        pin = f"{name}=={md.version(name)}"
    except md.PackageNotFoundError:
        pin = name
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        TARGET["python_version"],
        "--implementation",
        "cp",
        "-d",
        str(folder),
        pin,
    ]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"{pin}: pip found no Linux x86_64 wheel for Python {TARGET['python_version']}")
    got = wheel_of(name, folder)
    assert got is not None, f"pip downloaded {pin} under another name"
    return got


def pack_deepspeed(folder: Path) -> list[str]:
    """deepspeed's installed Python files as a tarball; returns what it requires."""
    dist = md.distribution("deepspeed")
    src = Path(dist.locate_file("deepspeed"))
    with tarfile.open(folder / "deepspeed-site.tgz", "w:gz") as tar:
        tar.add(src, "deepspeed", filter=lambda t: None if "__pycache__" in t.name else t)
    return needs(dist.requires or [])


def copy_fmnist(src: Path, dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    for stem in FMNIST_FILES:
        hits = [p for p in (src / stem, src / f"{stem}.gz") if p.is_file()]
        if not hits:
            sys.exit(f"{src}: no {stem}[.gz]; install dataset-fashion-mnist or pass --fmnist")
        shutil.copy2(hits[0], dest / hits[0].name)


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
        "--fmnist",
        type=Path,
        default=Path("/usr/share/datasets/fashion-mnist"),
        help="Fashion-MNIST's IDX files here go to .fmnist/",
    )
    args = p.parse_args(argv)
    if not args.present.is_file():
        p.error(f"--present {args.present}: not a file")
    present = present_names(args.present.read_text())
    TARGET["python_version"] = TARGET["python_full_version"] = args.python
    args.out.mkdir(exist_ok=True)

    ds_needs = pack_deepspeed(args.out)
    kit = closure([*ROOTS, *ds_needs], present, lambda n: needs(wheel_requires(fetch(n, args.out))))
    for w in args.out.glob("*.whl"):  # an older kit's wheel that nothing requires now
        if canonical(w.name.split("-")[0]) not in kit:
            w.unlink()
    copy_fmnist(args.fmnist, ROOT / ".fmnist")
    size = sum(f.stat().st_size for d in (args.out, ROOT / ".fmnist") for f in d.iterdir())
    print(
        f"{len(kit)} wheels + deepspeed-site.tgz in {args.out}, Fashion-MNIST in .fmnist: "
        f"{size / 2**20:.1f} MiB"
    )
    print("wheels: " + ", ".join(sorted(kit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
