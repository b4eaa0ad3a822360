"""Running the study's steps: skip what has a result, rerun a missing export first, record.

A step's result (results/<step>.json beside this file) holds the command, its wall time, the
machine, the git commit, the MLflow run id, the weights it started from (a fine-tune's
model.init_from, an evaluation's --backbone: path, sha256 of the weights file, the pretraining's
MLflow run) and the JSON the step wrote (for a pretraining: its last metric line); a training
step's metric lines are copied beside it (<step>.metrics.jsonl) for the report's curves. The
file is written atomically, last: a step with a result is finished.

In MLflow each method is a parent run (experiment `ssl-vit-study`) with its steps nested under
it: a training script gets the config override `tracking.parent_run_id=<id>`, an evaluator the
flag `--parent-run-id <id>`. Neither is part of the step's recorded command (the command is the
step's recipe; the parent is where this machine's store files it). The parents' ids stay in
runs/study/mlflow_parents.json, on the machine whose store holds them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ssl_vit.config import load_config, training_settings
from ssl_vit.io import atomic_write_text, sha256_file
from ssl_vit.perf import describe_machine
from studies.mpp_fashion_mnist.steps import RESULTS

log = logging.getLogger("study")

EXPERIMENT = "ssl-vit-study"
PARENTS_FILE = "mlflow_parents.json"  # in runs/study/: method -> parent run id
# Evaluators whose command line takes --parent-run-id (the evaluation CLI's common flags).
FLAG_EVALUATORS = ("evals/knn.py", "evals/linear_probe.py", "evals/fewshot.py")
HEADLINE = {  # step kind -> (key in its output JSON, metric name on the parent)
    "probe": [("probe_top1", "probe_top1")],
    "knn": [("knn_top1@k=20", "knn_top1_k20")],
    "fewshot": [(f"fewshot_{n}shot_mean", f"fewshot_{n}shot") for n in (1, 5, 10, 25)],
}


class ParentRuns:
    """One MLflow parent run per method, its id kept in a JSON file so a rerun reuses it.
    Best effort: with the store down the study runs on, its steps not nested."""

    def __init__(self, path: Path, tracking_uri: str) -> None:
        self.path, self.uri = path, tracking_uri
        self.runs: dict[str, dict[str, str]] = (
            json.loads(path.read_text()) if path.is_file() else {}
        )

    def _client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def run_id(self, name: str) -> str | None:
        """The parent run of method `name`, created on first use; None when the store is down."""
        if name in self.runs:
            return self.runs[name]["run_id"]
        try:
            client = self._client()
            exp = client.get_experiment_by_name(EXPERIMENT)
            exp_id = exp.experiment_id if exp else client.create_experiment(EXPERIMENT)
            tags = {"study": EXPERIMENT, "study.method": name}
            run = client.create_run(exp_id, run_name=name, tags=tags)
        except Exception as e:  # the study goes on without grouping
            log.warning("MLflow store %s: no parent run for %s (%s)", self.uri, name, e)
            return None
        self.runs[name] = {"run_id": run.info.run_id, "experiment_id": exp_id}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.runs, indent=2) + "\n")
        return run.info.run_id

    def log_metrics(self, name: str, metrics: dict[str, float]) -> None:
        """Headline numbers of a finished step on its parent, for the UI's comparison view."""
        if name not in self.runs or not metrics:
            return
        from mlflow.entities import Metric

        try:
            now = int(time.time() * 1000)
            rows = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
            self._client().log_batch(self.runs[name]["run_id"], metrics=rows)
        except Exception as e:
            log.warning("MLflow store %s: metrics of %s not logged (%s)", self.uri, name, e)

    def log_artifacts(self, name: str, paths: list[Path]) -> None:
        """Files (figures) on the parent run of `name` (best effort, like the metrics)."""
        if name not in self.runs:
            return
        try:
            client = self._client()
            for path in paths:
                client.log_artifact(self.runs[name]["run_id"], str(path))
        except Exception as e:
            log.warning("MLflow store %s: artifacts of %s not logged (%s)", self.uri, name, e)


def open_parents(study: Path, root: Path) -> ParentRuns:
    """The study's parent runs, in the store the steps log to (they run from `root`)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    return ParentRuns(root / study / PARENTS_FILE, uri)


def method_of(step_name: str) -> str:
    """mpp, mpp_e2/probe, ft_mpp_s1, inspect_mpp -> mpp; scratch_s0, ft_scratch -> scratch."""
    top = step_name.split("/")[0]
    for prefix in ("ft_", "inspect_"):
        top = top.removeprefix(prefix)
    return re.sub(r"_[es]\d+$", "", top)


def nested(argv: list[str], parent_run_id: str | None) -> list[str]:
    """The command that files the step's MLflow run under `parent_run_id`: a training script
    (it reads a config) gets `tracking.parent_run_id=<id>` beside its other overrides, an
    evaluator of FLAG_EVALUATORS `--parent-run-id <id>`; any other command runs as it is."""
    if not parent_run_id:
        return argv
    if "--config" in argv:
        at = argv.index("--config") + 2
        return [*argv[:at], f"tracking.parent_run_id={parent_run_id}", *argv[at:]]
    if argv and argv[0] in FLAG_EVALUATORS:
        return [*argv, "--parent-run-id", parent_run_id]
    return argv


def log_step(runs: ParentRuns, step_name: str, output: Path) -> None:
    """Copy a finished step's headline numbers onto its method's parent run."""
    if not output.is_file() or output.suffix != ".json":
        return
    res = json.loads(output.read_text())
    kind = step_name.split("/")[1] if "/" in step_name else ""
    metrics = {}
    for key, name in HEADLINE.get(kind, []):
        if key in res.get("metrics", {}):
            metrics[name] = res["metrics"][key]
    if res.get("selected_top1") is not None:  # a training run's results.json
        metrics["finetune_top1"] = res["selected_top1"]
    runs.log_metrics(method_of(step_name), metrics)


def _git_commit(root: Path) -> str | None:
    """$STUDY_GIT_COMMIT where set (a copy of the tree whose .git is not the commit that was
    copied), else HEAD."""
    if os.environ.get("STUDY_GIT_COMMIT"):
        return os.environ["STUDY_GIT_COMMIT"]
    try:
        cmd = ["git", "rev-parse", "HEAD"]
        out = subprocess.run(cmd, cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        out = ""
    return out or None


def start_of(argv: list[str]) -> str | None:
    """The weights a step starts from: a fine-tune's model.init_from, an evaluation's
    --backbone (a path relative to the repository, as in the command); None: from scratch."""
    for i, arg in enumerate(argv):
        if arg.startswith("model.init_from="):
            return arg.split("=", 1)[1]
        if arg == "--backbone" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def started_from(
    argv: list[str], root: Path, needs: tuple[str, ...] = (), results: Path = RESULTS
) -> dict | None:
    """What `start_of` names, as found on this machine: the sha256 of its weights file (the
    evaluators' backbone_id), the MLflow run of the pretraining that wrote it and the result id
    of that pretraining's step (the first of `needs`, when its result is recorded in `results`)."""
    src = start_of(argv)
    if src is None:
        return None
    path = root / src
    weights = next(
        (
            p
            for p in (path / "backbone.safetensors", path / "export" / "backbone.safetensors")
            if p.is_file()
        ),
        None,
    )
    rid = None
    if weights is not None and (weights.parent.parent / "mlflow_run_id").is_file():
        rid = (weights.parent.parent / "mlflow_run_id").read_text().strip() or None
    sha = "sha256:" + sha256_file(weights) if weights is not None else None
    made = root / results / f"{needs[0]}.json" if needs else None
    result_id = json.loads(made.read_text()).get("result_id") if made and made.is_file() else None
    return {"path": src, "sha256": sha, "mlflow_run_id": rid, "result_id": result_id}


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


def portable(value, root: Path):
    """`value` (a step's output) with this machine's absolute paths made relative to the
    repository: under `root`, or under the target of one of its top-level links (`shards`
    pointing at a shared shard set). Results are committed; a path of one machine means nothing
    on the next."""
    root = root.resolve()
    prefixes = [(str(p.resolve()), p.name) for p in root.iterdir() if p.is_symlink()]
    prefixes.append((str(root), ""))

    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str):
            for prefix, short in prefixes:
                if v == prefix or v.startswith(prefix + "/"):
                    rest = v[len(prefix) + 1 :]
                    return f"{short}/{rest}".strip("/") if short else rest or "."
        return v

    return walk(value)


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
    return {
        "script": shlex_join(head),
        "config": json.loads(json.dumps(resolved)),
        "needs": _needs(step, root),
    }


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
        done = [
            json.loads(p.read_text())["finished"]
            for n in step.needs
            if (p := results / f"{n}.json").is_file()
        ]
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
    return run is not None and any(
        p.is_dir() and any(p.iterdir()) for p in run.rglob("checkpoints")
    )


def record(
    step, root: Path, seconds: float | None, resumed: bool = False, rebuilt: dict | None = None
) -> dict:
    """Write the step's result (and metric lines). `seconds` is the wall time of this run of
    the command: of its last leg only where it `resumed`. `rebuilt`: the steps it read whose
    export was rebuilt (their result kept, their weights a new run's)."""
    output = portable(_read_output(step, root), root)
    run_id = output.get("mlflow_run_id")
    if run_id is None and step.run_dir and (root / step.run_dir / "mlflow_run_id").is_file():
        run_id = (root / step.run_dir / "mlflow_run_id").read_text().strip()
    argv = step.args()
    result = {
        "step": step.name,
        "command": shlex_join(argv),
        "recipe": recipe(step, root),
        "seconds": seconds,
        "resumed": resumed,
        **({"rebuilt_needs": rebuilt} if rebuilt else {}),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "result_id": uuid.uuid4().hex,  # what the results of steps that read this one name
        "git_commit": _git_commit(root),
        "machine": describe_machine(),
        "mlflow_run_id": run_id,
        "started_from": started_from(argv, root, step.needs, step.results),
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
    for name in step.figures:  # e.g. results/inspect_mpp.attention_distance.png
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
    command = nested(argv, parents.run_id(method_of(step.name)))  # filed under its method
    with open(log, "a") as f:
        rc = subprocess.call([sys.executable, *command], cwd=root, stdout=f, stderr=f)
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
        atomic_write_text(
            marker,
            json.dumps(
                {
                    "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "mlflow_run_id": run_id.read_text().strip()
                    if run_id and run_id.is_file()
                    else None,
                }
            )
            + "\n",
        )
        return 0
    marker.unlink(missing_ok=True)  # a fresh result: its export is this run's
    record(step, root, seconds, resumed, rebuilt_needs(step, root, study))
    log_step(parents, step.name, root / step.output)
    return 0


def _rebuilt_marker(name: str, root: Path, study: Path) -> Path:
    return root / study / "rebuilt" / f"{name.replace('/', '-')}.json"


def rebuilt_needs(step, root: Path, study: Path) -> dict:
    """The steps `step` reads whose export on this machine is a rebuild (what its result says)."""
    return {
        need: json.loads(p.read_text())
        for need in step.needs
        if (p := _rebuilt_marker(need, root, study)).is_file()
    }


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
    parents = open_parents(study, root)  # one MLflow parent run per method
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
    entry = Path(sys.argv[0]).resolve()  # the study's own study.py (each study has one)
    hint = entry.relative_to(root) if entry.is_relative_to(root) else entry
    print(f"[study] {done} done; python {hint} report", flush=True)
    return 0
