"""Running the study's steps: skip what has a result, rerun a missing export first, record.

A step's result (results/study/<step>.json) holds the command, its wall time, the machine, the
git commit, the MLflow run id and the JSON the step wrote (for a pretraining: its last metric
line); a training step's metric lines are copied beside it (<step>.metrics.jsonl) for the
report's curves. The file is written atomically, last: a step with a result is finished.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import study_mlflow

from ssl_vit.config import load_config, training_settings
from ssl_vit.io import atomic_write_text, sha256_file
from ssl_vit.perf import describe_machine


def _git_commit(root: Path) -> str | None:
    """$SSL_VIT_GIT_COMMIT where set (a lent GPU machine's copy of the tree may carry a stale
    .git: it reported the session's first HEAD, not the commit that travelled), else HEAD."""
    if os.environ.get("SSL_VIT_GIT_COMMIT"):
        return os.environ["SSL_VIT_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
    except OSError:
        out = ""
    return out or None


def _metric_lines(run_dir: Path, output: dict) -> Path | None:
    """The run's metric lines: a sweep's are those of the value it chose."""
    chosen = output.get("chosen_run_dir")
    path = (Path(chosen) if chosen else run_dir) / "metrics.jsonl"
    return path if path.is_file() else None


def _read_output(step, root: Path) -> dict:
    path = root / step.output
    if path.suffix == ".json" and path.name != "objective.json":
        return json.loads(path.read_text())
    # a pretraining: its in-training results (supervised) and its last metric line
    run = root / step.run_dir
    lines = (run / "metrics.jsonl").read_text().splitlines()
    out = {"last_metrics": json.loads(lines[-1]) if lines else None}
    if (run / "results.json").is_file():
        out.update(json.loads((run / "results.json").read_text()))
    return out


def _needs(step, root: Path) -> dict:
    results = root / step.result.parents[step.name.count("/")]
    needs = {}
    for need in step.needs:
        path = results / f"{need}.json"
        res = json.loads(path.read_text()) if path.is_file() else {}
        needs[need] = res.get("result_id") or res.get("finished")
    return needs


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(script and --flags with their values, key=value config overrides)."""
    head, overrides, i = [argv[0]], [], 1
    while i < len(argv):
        if argv[i].startswith("--"):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            head += argv[i : i + 1 + has_value]
            i += 1 + has_value
        else:
            overrides.append(argv[i])
            i += 1
    return head, overrides


def recipe(step, root: Path) -> dict:
    """What a result is valid for: what the step trains or evaluates, and the results of the
    steps it reads (a rerun pretraining makes its evaluations stale).

    A training counts by its resolved config (the preset with the command's overrides applied)
    and the rest of its command: a preset's comments, or a value moved into the preset that the
    command already sets, change nothing; any value that reaches training does. Any other step
    counts by its command line."""
    argv = step.args()
    if "--config" not in argv:
        return {"command": shlex_join(argv), "needs": _needs(step, root)}
    head, overrides = _split_command(argv)
    config = head[head.index("--config") + 1]
    del head[head.index("--config") : head.index("--config") + 2]
    resolved = load_config(str(root / config), overrides).to_dict()
    return {"script": shlex_join(head), "config": json.loads(json.dumps(resolved)),
            "needs": _needs(step, root)}  # fmt: skip


def _recipe_by_files(step, root: Path) -> dict:
    """The recipe results were written with before configs were resolved: the command line
    and its config files' sha256."""
    argv = step.args()
    configs = {a: sha256_file(root / a) for i, a in enumerate(argv) if argv[i - 1] == "--config"}
    return {"command": shlex_join(argv), "configs": configs, "needs": _needs(step, root)}


def state(step, root: Path) -> str:
    """done (a result for this recipe), stale (a result for another one) or todo."""
    path = root / step.result
    if not path.is_file():
        return "todo"
    res = json.loads(path.read_text())
    try:
        now = recipe(step, root)
    except FileNotFoundError:  # reads a result that is not there yet (seed 0's lr)
        return "stale"
    if "recipe" not in res:  # written before recipes were kept: the command and the times
        results = root / step.result.parents[step.name.count("/")]
        done = [json.loads(p.read_text())["finished"] for n in step.needs
                if (p := results / f"{n}.json").is_file()]  # fmt: skip
        newer = [ts for ts in done if ts > res["finished"]]
        command = shlex_join(step.args())
        return "done" if res["command"] == command and not newer else "stale"
    if "configs" in res["recipe"]:  # written with config files by sha256
        return "done" if res["recipe"] == _recipe_by_files(step, root) else "stale"
    return "done" if _settings(res["recipe"]) == _settings(now) else "stale"


def _settings(recipe: dict) -> dict:
    """A recipe less what changes how a training executes but not what it trains."""
    if "config" not in recipe:  # an evaluation: its command line
        return recipe
    return {**recipe, "config": training_settings(recipe["config"])}


def _upgrade(step, root: Path) -> None:
    """A done result written with an older recipe form gets today's (same step, same files)."""
    path = root / step.result
    res = json.loads(path.read_text())
    if res.get("recipe", {}).get("config") is None:
        res["recipe"] = recipe(step, root)
        atomic_write_text(path, json.dumps(res, indent=2) + "\n")


def _set_aside(step, root: Path) -> None:
    """A stale step's run directory (or output) moves aside, so the rerun starts afresh. A
    sweep's keeps its run directory: the sweep itself retrains each value whose settings
    changed and keeps the finished ones (a grown grid trains only its new values)."""
    sweep = step.run_dir is not None and "--sweep" in step.args()
    old = root / (step.output if sweep or step.run_dir is None else step.run_dir)
    if old.exists():
        dest = old.with_name(f"{old.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
        old.rename(dest)
        print(f"[study] {step.name}: stale result; {old} moved to {dest}", flush=True)


def _has_checkpoints(step, root: Path) -> bool:
    """Whether the step's training left checkpoints before this run (it resumes from them)."""
    run = root / step.run_dir if step.run_dir is not None else None
    return run is not None and any(p.is_dir() and any(p.iterdir())
                                   for p in run.rglob("checkpoints"))  # fmt: skip


def record(
    step, root: Path, seconds: float | None, resumed: bool = False, rebuilt: dict | None = None
) -> dict:
    """Write the step's result (and metric lines) under results/study/. `seconds` is the wall
    time of this run of the command: of its last leg only where it `resumed`. `rebuilt`: the
    steps it read whose export was rebuilt (their result kept, their weights a new run's)."""
    output = _read_output(step, root)
    run_id = output.get("mlflow_run_id")
    if run_id is None and step.run_dir and (root / step.run_dir / "mlflow_run_id").is_file():
        run_id = (root / step.run_dir / "mlflow_run_id").read_text().strip()
    result = {
        "step": step.name,
        "command": shlex_join(step.args()),
        "recipe": recipe(step, root),
        "seconds": seconds,
        "resumed": resumed,
        **({"rebuilt_needs": rebuilt} if rebuilt else {}),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "result_id": uuid.uuid4().hex,  # what the results of steps that read this one name
        "git_commit": _git_commit(root),
        "machine": describe_machine(),
        "mlflow_run_id": run_id,
        "result": output,
    }
    dest = root / step.result
    dest.parent.mkdir(parents=True, exist_ok=True)
    if step.run_dir is not None:
        lines = _metric_lines(root / step.run_dir, output)
        if lines is not None:
            tmp = dest.with_suffix(".metrics.jsonl.tmp")
            shutil.copyfile(lines, tmp)
            tmp.replace(dest.with_suffix(".metrics.jsonl"))
    for name in step.figures:  # e.g. results/study/inspect_mpp.attention_distance.png
        src = root / step.output.parent / name
        if src.is_file():
            fig = dest.parent / f"{dest.stem}.{name}"
            shutil.copyfile(src, fig.with_suffix(".tmp"))
            fig.with_suffix(".tmp").replace(fig)
    atomic_write_text(dest, json.dumps(result, indent=2) + "\n")
    return result


def shlex_join(argv: list[str]) -> str:
    return shlex.join(["python", *argv])


def _execute(step, root: Path, study: Path, parents, keep_result: bool = False) -> int:
    """Run the step's command; record its result unless `keep_result` (a rebuilt export)."""
    log = root / study / "logs" / f"{step.name.replace('/', '-')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = step.args()
    print(f"[study] {step.name}: {shlex_join(argv)}  (log: {log})", flush=True)
    resumed = _has_checkpoints(step, root)
    t0 = time.time()
    with open(log, "a") as f:
        env = study_mlflow.parent_env(parents, step.name)  # the step's run nests under it
        rc = subprocess.call([sys.executable, *argv], cwd=root, stdout=f, stderr=f, env=env)
    seconds = time.time() - t0
    if rc != 0:
        print(f"[study] {step.name} failed (exit {rc}); see {log}", flush=True)
        return rc
    marker = _rebuilt_marker(step.name, root, study)
    if keep_result:
        # Training on a CPU is not bitwise repeatable: the rebuilt weights are a new sample of
        # the same recipe. The results of the steps that read them say so (report: every step).
        print(f"[study] {step.name}: export rebuilt; its result stands", flush=True)
        run_id = root / step.run_dir / "mlflow_run_id" if step.run_dir else None
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(marker, json.dumps({
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "mlflow_run_id": run_id.read_text().strip() if run_id and run_id.is_file() else None,
        }) + "\n")  # fmt: skip
        return 0
    marker.unlink(missing_ok=True)  # a fresh result: its export is this run's
    record(step, root, seconds, resumed, rebuilt_needs(step, root, study))
    study_mlflow.log_step(parents, step.name, root / step.output)
    return 0


def _rebuilt_marker(name: str, root: Path, study: Path) -> Path:
    return root / study / "rebuilt" / f"{name.replace('/', '-')}.json"


def rebuilt_needs(step, root: Path, study: Path) -> dict:
    """The steps `step` reads whose export on this machine is a rebuild (what its result says)."""
    return {need: json.loads(p.read_text()) for need in step.needs
            if (p := _rebuilt_marker(need, root, study)).is_file()}  # fmt: skip


def _ensure(step, by_name: dict, root: Path, study: Path, parents) -> int:
    """Run the steps whose exports `step` reads, where those exports are gone (a new machine).
    A rebuilt export is a cache of its step: the step's result (and so every result that names
    it) stands when its recipe is unchanged."""
    for need in step.needs:
        dep = by_name[need]
        if not (root / dep.output).is_file():
            print(f"[study] {step.name} needs {need}'s export: running {need} again", flush=True)
            keep = state(dep, root) == "done"
            rc = _ensure(dep, by_name, root, study, parents) or _execute(
                dep, root, study, parents, keep_result=keep
            )
            if rc:
                return rc
    return 0


def run(steps: list, root: Path, study: Path, only: list[str] | None = None) -> int:
    by_name = {s.name: s for s in steps}
    unknown = set(only or ()) - set(by_name)
    if unknown:
        print(f"study.py: no step named {sorted(unknown)}; see `study.py status`", file=sys.stderr)
        return 2
    parents = study_mlflow.parents(root / study, root)  # one MLflow parent run per method
    for step in steps:
        now = state(step, root)
        if now == "done" and "--config" in step.args():
            _upgrade(step, root)
        if now == "done" or (only and step.name not in only) or (step.gpu and not only):
            continue
        if now == "stale":
            _set_aside(step, root)
        rc = _ensure(step, by_name, root, study, parents)
        if not rc and (root / step.output).is_file():  # ran before, not recorded: record
            record(step, root, None, rebuilt=rebuilt_needs(step, root, study))
            continue
        rc = rc or _execute(step, root, study, parents)
        if rc:
            return rc
    done = "the steps asked for" if only else "all steps"
    print(f"[study] {done} done; python evals/study.py report", flush=True)
    return 0
