"""The code a reader follows for one streamed MPP step: files, and code lines on the path.

    python benchmarks/reading_path.py --data shards/fashion-mnist
    python benchmarks/reading_path.py --data shards/fashion-mnist --list   # every function

Runs a real 4-step pretraining in this process (streamed from the shards, data.num_workers=0
so that the reader runs here, a checkpoint at step 2) under `sys.setprofile`, and records
every function of the project that runs. A function counts for the step when it is first
called once the training loop has asked for its first batch; the export after the last step
is left out. "Code lines" are lines of a function's body that are not blank, a comment or a
docstring; a nested function counts once. Also prints the code size of `ssl_vit/`: physical
and logical (one per statement) code lines, docstrings and comments excluded.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tempfile
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROJECT = ("ssl_vit", "pipelines")


def code_lines(path: Path) -> tuple[set[int], int]:
    """Line numbers holding code (no blank, comment or docstring line), and the statement count."""
    src = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    docs.update(range(first.lineno, first.end_lineno + 1))
    lines: set[int] = set()
    statements = 0
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NEWLINE:
            statements += tok.start[0] not in docs
        elif tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return lines, statements


def function_spans(path: Path) -> dict[int, range]:
    """First line of each function (as `co_firstlineno` gives it: its first decorator) -> span."""
    spans = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            decorators = getattr(node, "decorator_list", [])
            first = min([node.lineno, *(d.lineno for d in decorators)])
            spans[first] = range(first, node.end_lineno + 1)
    return spans


def trace_step(data: str, steps: int = 4) -> dict[Path, set[int]]:
    """Run a short streamed pretraining; return {file: first lines of the step's functions}."""
    from ssl_vit.engine import cli, trainer

    called: dict[Path, set[int]] = defaultdict(set)
    phase = {"now": "setup"}
    roots = tuple(str(ROOT / p) for p in PROJECT)
    first_batch = trainer._batches.__code__
    export = trainer.Run.export.__code__

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code is first_batch and phase["now"] == "setup":
            phase["now"] = "step"
        elif code is export:
            phase["now"] = "end"
        if phase["now"] == "step" and code.co_filename.startswith(roots):
            called[Path(code.co_filename)].add(code.co_firstlineno)

    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            "--config", str(ROOT / "configs/fmnist_vit_tiny_mpp.yaml"), "--data", data,
            f"run.dir={tmp}/run", f"train.steps={steps}", "train.epochs=null",
            "train.global_batch=32", "run.checkpoint_every=2", "data.num_workers=0",
            "data.in_memory=false", "monitor.knn_every=0", "train.compile=false",
            f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        ]  # fmt: skip
        sys.setprofile(profile)
        try:
            rc = cli.main("mpp", "reading path", argv)
        finally:
            sys.setprofile(None)
    if rc != 0:
        raise SystemExit(f"reading_path.py: the pretraining exited {rc}")
    return called


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT / "shards/fashion-mnist"), help="a shard set")
    p.add_argument("--list", action="store_true", help="also print every function on the path")
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = p.parse_args()
    called = trace_step(args.data)
    per_file = {}
    for path, firsts in sorted(called.items()):
        spans = function_spans(path)
        lines, _ = code_lines(path)
        on_path = set().union(*(spans[f] for f in firsts if f in spans)) & lines
        per_file[str(path.relative_to(ROOT))] = len(on_path)
    size_lines = size_statements = 0
    for path in sorted((ROOT / "ssl_vit").rglob("*.py")):
        lines, statements = code_lines(path)
        size_lines += len(lines)
        size_statements += statements
    for name, n in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {name}")
        if args.list:
            for first in sorted(called[ROOT / name]):
                print(f"          line {first}")
    result = {
        "step_files": len(per_file),
        "step_code_lines": sum(per_file.values()),
        "ssl_vit_code_lines": size_lines,
        "ssl_vit_statements": size_statements,
        "per_file": per_file,
    }
    print(
        f"one streamed step: {result['step_files']} files, {result['step_code_lines']} code lines "
        f"on the path; ssl_vit/: {size_lines} code lines, {size_statements} statements"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
