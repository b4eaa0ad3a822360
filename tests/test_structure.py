"""The library's import structure, read from the source with `ast` (nothing is imported).

Every `import` and `from ... import` statement of a module counts, at module level or inside a
function: a late import is a dependency all the same, only a cheaper one. Importing
`ssl_vit.a.b` runs `ssl_vit/a/__init__.py` first, so it depends on the package `ssl_vit.a` too
(except from inside `ssl_vit.a`, whose `__init__` is already running). A module loaded by a
name held in a string (`importlib.import_module`, e.g. the objectives' registry) is a plug-in
that a configuration chooses and is not followed.

The rules:

- no import cycles between the modules of ssl_vit/;
- layers: ssl_vit/evaluation/ (the evaluators) sits on top. A module of data, models, objectives,
  engine, tracking or inspect, or a loose ssl_vit/*.py module, imports nothing of
  ssl_vit.evaluation; and ssl_vit/tracking/, the bottom layer for MLflow, imports no loose module
  that imports ssl_vit.engine or ssl_vit.evaluation;
- the library imports nothing of the entry scripts (pipelines/, evals/, data_prep/);
- MPP pretraining (ssl_vit.engine.trainer and everything it reaches, and what
  pipelines/mpp_pretrain.py imports with all it reaches) reaches no cascade, Dynamic ViT or sweep
  module: those are other kinds of training, loaded only when asked for.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from conftest import ROOT

LIB = ROOT / "ssl_vit"
PACKAGES = ("data", "models", "objectives", "engine", "tracking", "inspect")
NOT_FOR_MPP = re.compile(r"cascade|dynamic|sweep")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(LIB.rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name the file imports (relative imports resolved), as written."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # a submodule or a name in it
    return names


def edges(importer: str, imported: str) -> set[str]:
    """The modules of ssl_vit/ that importing `imported` from `importer` runs."""
    known = modules()
    parts = imported.split(".")
    out = set()
    for i in range(2, len(parts) + 1):  # the packages on the way, then the module itself
        target = ".".join(parts[:i])
        inside = importer == target or importer.startswith(target + ".")
        if target in known and not (inside and i < len(parts)):
            out.add(target)
    out.discard(importer)
    return out


@cache
def graph() -> dict[str, frozenset[str]]:
    return {
        name: frozenset(e for imp in imported_names(path, name) for e in edges(name, imp))
        for name, path in modules().items()
    }


def reach(roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph().get(m, ()))
    return seen


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    g, index, low, stack, on, out = graph(), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer(name: str) -> str:
    """'evaluation', one of PACKAGES, or 'loose' for ssl_vit/*.py."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or name in {f"ssl_vit.{p}" for p in PACKAGES} else "loose"


def test_the_graph_sees_late_imports_and_packages():
    g = graph()
    assert "ssl_vit.data.stream" in g["ssl_vit.features"]  # imported inside a function
    assert "ssl_vit.models" in g["ssl_vit.features"]  # `from ssl_vit.models import NAME`
    assert "ssl_vit.tracking" in g["ssl_vit.registry"]  # the package runs before its module
    assert "ssl_vit.tracking" not in g["ssl_vit.tracking.cli"]  # ... but not from inside


def test_no_import_cycles():
    assert cycles() == []


KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left: keep it so


def test_lower_layers_do_not_import_the_evaluators():
    bad = [
        (m, t)
        for m, targets in graph().items()
        if layer(m) != "evaluation"
        for t in targets
        if layer(t) == "evaluation" and (m, t) not in KNOWN_UPWARD
    ]
    assert bad == []


def test_tracking_imports_no_loose_module_above_it():
    above = {"engine", "evaluation"}
    heavy = {
        m for m in graph() if layer(m) == "loose" and {layer(t) for t in reach({m}) - {m}} & above
    }
    bad = [(m, t) for m, ts in graph().items() if layer(m) == "tracking" for t in ts & heavy]
    assert bad == []


def test_the_library_imports_no_entry_script():
    top = ("pipelines", "evals", "data_prep")
    bad = [
        (m, n)
        for m, path in modules().items()
        for n in imported_names(path, m)
        if n.split(".")[0] in top
    ]
    assert bad == []


def test_mpp_pretraining_reaches_no_cascade_dynamic_or_sweep_module():
    script = ROOT / "pipelines" / "mpp_pretrain.py"
    roots = {"ssl_vit.engine.trainer"}
    roots |= {e for n in imported_names(script, "pipelines.mpp_pretrain") for e in edges("", n)}
    assert "ssl_vit.engine.cli" in roots
    reached = reach(roots)
    assert "ssl_vit.objectives.mpp" in reached
    assert sorted(m for m in reached if NOT_FOR_MPP.search(m)) == []


def test_every_file_pyproject_names_exists():
    """Its comments name the modules that depend on a pin (e.g. the one calling a private timm
    function): a module renamed or removed must not leave the pin explained by a ghost."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    named = set(re.findall(r"[\w/.-]+/[\w.-]+\.(?:py|sh|md)\b", text))
    assert named  # the pattern still finds the references
    missing = sorted(n for n in named if not (ROOT / n).exists() and not (LIB / n).exists())
    assert missing == []


def test_no_library_function_runs_past_100_lines():
    """A function a reader cannot take in at once is split where it has a seam; the trainer's
    setup, the page a reader follows first, stays within 80."""
    longest = {}
    for path in sorted(LIB.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{path.relative_to(LIB.parent)}:{node.name}"
                longest[name] = node.end_lineno - node.lineno + 1
    assert sorted(n for n, lines in longest.items() if lines > 100) == []
    assert longest["ssl_vit/engine/trainer.py:setup"] <= 80
