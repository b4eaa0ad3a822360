"""The study runner and its report: a step with a committed result is never rerun, a missing
export is rebuilt first, results carry what a reader needs (the weights a step started from
included), steps nest under their method's MLflow parent through the product's own arguments,
and the report's statistics follow from the result files (real subprocesses and a real MLflow
SQLite store)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from studies.mpp_fashion_mnist import records, report, run, stats, steps, tables
from studies.mpp_fashion_mnist.records import Results

ROOT = Path(__file__).resolve().parents[3]
RES = steps.RESULTS  # where a step's result lands, relative to the root it runs from

WRITE = "import json, sys, pathlib; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); p.write_text(json.dumps({'metrics': {'v': 1}})); open(sys.argv[2], 'a').write('x')"  # noqa: E501


def _step(name: str, tmp: Path, needs: tuple[str, ...] = ()) -> steps.Step:
    out = Path("runs/study") / name / "out.json"
    argv = ["-c", WRITE, str(tmp / out), str(tmp / "calls" / name.replace("/", "-"))]
    return steps.Step(name, argv, out, needs)


def _calls(tmp: Path, name: str) -> int:
    path = tmp / "calls" / name
    return len(path.read_text()) if path.is_file() else 0


def test_runner_skips_results_and_rebuilds_missing_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "calls").mkdir()
    steps = [
        _step("pre", tmp_path),
        _step("pre_e1/knn", tmp_path, ("pre",)),
        _step("pre_e2/knn", tmp_path, ("pre",)),
    ]
    assert run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 1 and _calls(tmp_path, "pre_e1-knn") == 1
    pre_result = (tmp_path / f"{RES}/pre.json").read_text()
    res = json.loads((tmp_path / f"{RES}/pre_e1/knn.json").read_text())
    assert res["result"] == {"metrics": {"v": 1}} and res["seconds"] > 0
    assert res["command"].startswith("python -c") and res["machine"]
    # Everything has a result: a rerun runs nothing.
    assert run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 1 and _calls(tmp_path, "pre_e1-knn") == 1
    # A new machine: results committed, runs/ gone, one result missing. Only that step runs,
    # after the step whose export it reads.
    for p in (tmp_path / "runs").rglob("*.json"):
        p.unlink()
    (tmp_path / f"{RES}/pre_e1/knn.json").unlink()
    assert run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 2 and _calls(tmp_path, "pre_e1-knn") == 2
    # The rebuilt export is a cache: the pretraining's result, and so the result of the other
    # step that reads it, stand.
    assert (tmp_path / f"{RES}/pre.json").read_text() == pre_result
    assert [run.state(s, tmp_path) for s in steps] == ["done"] * 3
    assert _calls(tmp_path, "pre_e2-knn") == 1
    # ...but the step that read the rebuilt weights (not bitwise the first run's) says so.
    res = json.loads((tmp_path / f"{RES}/pre_e1/knn.json").read_text())
    assert list(res["rebuilt_needs"]) == ["pre"] and res["rebuilt_needs"]["pre"]["finished"]
    assert "rebuilt_needs" not in json.loads((tmp_path / f"{RES}/pre_e2/knn.json").read_text())
    # Output there but no result (stopped between the two): recorded without rerunning.
    (tmp_path / f"{RES}/pre_e1/knn.json").unlink()
    assert run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre_e1-knn") == 2
    assert (tmp_path / f"{RES}/pre_e1/knn.json").is_file()
    # A changed recipe (here: the pretraining's command) makes its result stale, and so the
    # results of the steps that read its export: both rerun, the old output is kept aside.
    steps[0].argv.append("changed")
    assert [run.state(s, tmp_path) for s in steps] == ["stale", "done", "done"]
    assert run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 3 and _calls(tmp_path, "pre_e1-knn") == 3
    assert [run.state(s, tmp_path) for s in steps] == ["done"] * 3
    assert len(list((tmp_path / "runs/study/pre").glob("out.json.stale-*"))) == 1
    # A fresh pretraining result: its export is no longer a rebuild.
    assert "rebuilt_needs" not in json.loads((tmp_path / f"{RES}/pre_e1/knn.json").read_text())


def test_a_stale_sweep_keeps_its_run_directory(tmp_path, monkeypatch):
    """The sweep judges its own values (a grown grid trains only the new ones): the study
    moves aside only the sweep's results file, never the finished values' runs."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "calls").mkdir()
    sweep = _step("sw", tmp_path)
    sweep.argv += ["--sweep", "optim.lr=0.01,0.03"]
    sweep.run_dir = Path("runs/study/sw")
    assert run.run([sweep], tmp_path, Path("runs/study")) == 0
    (tmp_path / "runs/study/sw/optim.lr=0.01").mkdir()
    sweep.argv[-1] = "optim.lr=0.01,0.03,0.06"
    assert run.state(sweep, tmp_path) == "stale"
    assert run.run([sweep], tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "sw") == 2 and run.state(sweep, tmp_path) == "done"
    assert (tmp_path / "runs/study/sw/optim.lr=0.01").is_dir()
    assert len(list((tmp_path / "runs/study/sw").glob("out.json.stale-*"))) == 1


def test_a_failed_step_leaves_no_result_and_stops_the_study(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    bad = steps.Step("bad", ["-c", "raise SystemExit(3)"], Path("runs/study/bad/out.json"))
    later = _step("later", tmp_path)
    (tmp_path / "calls").mkdir()
    assert run.run([bad, later], tmp_path, Path("runs/study")) == 3
    assert not (tmp_path / f"{RES}/bad.json").exists() and _calls(tmp_path, "later") == 0


def test_a_resumed_step_says_its_time_is_the_last_leg(tmp_path, monkeypatch):
    """A training that resumed from its checkpoints (a stopped run) records
    only its last leg's wall time: the result and the report's step table say so. The commit
    a copied tree names in $STUDY_GIT_COMMIT wins over what its .git says."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("STUDY_GIT_COMMIT", "c0ffee" * 6 + "c0ff")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)  # a .git whose HEAD is another commit
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "stale"], check=True)
    (tmp_path / "calls").mkdir()
    fresh, resumed = _step("fresh", tmp_path), _step("again", tmp_path)
    for step in (fresh, resumed):
        step.run_dir = Path("runs/study") / step.name
    (tmp_path / "runs/study/fresh/checkpoints").mkdir(parents=True)  # empty: nothing to resume
    (tmp_path / "runs/study/again/checkpoints/step00000050").mkdir(parents=True)
    assert run.run([fresh, resumed], tmp_path, Path("runs/study")) == 0
    got = {n: json.loads((tmp_path / f"{RES}/{n}.json").read_text()) for n in ("fresh", "again")}
    assert [got[n]["resumed"] for n in ("fresh", "again")] == [False, True]
    assert {g["git_commit"] for g in got.values()} == {"c0ffee" * 6 + "c0ff"}
    table = "\n".join(tables.steps_table(Results(tmp_path / RES), [fresh, resumed]))
    assert table.count("its last leg") == 1 and "| again |" in table.split("its last leg")[0]


TRAIN = """import argparse, json, pathlib
p = argparse.ArgumentParser(); p.add_argument("--out"); p.add_argument("--calls")
a, _ = p.parse_known_args()
pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
pathlib.Path(a.out).write_text(json.dumps({"metrics": {"v": 1}})); open(a.calls, "a").write("x")
"""


def test_a_training_counts_by_its_resolved_config(tmp_path, monkeypatch):
    """Comments, a preset taking the value the command already sets, or a setting of how it
    executes (train.compile) leave a training's result valid; a value that reaches training
    makes it stale. Older results (config files by sha256) are upgraded in place while their
    files are unchanged."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "calls").mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    preset = tmp_path / "preset.yaml"
    text = (ROOT / "configs/fmnist_vit_tiny_supervised.yaml").read_text()
    text = re.sub(r"crop_scale: \[.*\]", "crop_scale: [0.35, 1.0]", text)  # the old crop
    preset.write_text(text)
    out = Path("runs/study/t/out.json")
    argv = [
        "train.py",
        "--out",
        str(tmp_path / out),
        "--calls",
        str(tmp_path / "calls/t"),
        "--config",
        "preset.yaml",
        "data.crop_scale=[1.0,1.0]",
        "train.epochs=2",
    ]
    step = steps.Step("t", argv, out)
    assert run.run([step], tmp_path, Path("runs/study")) == 0
    res = tmp_path / f"{RES}/t.json"
    written = json.loads(res.read_text())
    assert written["recipe"]["config"]["data"]["crop_scale"] == [1.0, 1.0]
    # An older result (the command and the config file's sha256) is upgraded, not rerun.
    written["recipe"] = run._recipe_by_files(step, tmp_path)
    res.write_text(json.dumps(written))
    assert run.state(step, tmp_path) == "done"
    assert run.run([step], tmp_path, Path("runs/study")) == 0
    assert "config" in json.loads(res.read_text())["recipe"] and _calls(tmp_path, "t") == 1
    # The preset takes the crop the command sets, and a comment: still done.
    preset.write_text(
        "# flips only: chosen on held-out\n"
        + text.replace("crop_scale: [0.35, 1.0]", "crop_scale: [1.0, 1.0]")
    )
    assert "crop_scale: [1.0, 1.0]" in preset.read_text()
    assert run.state(step, tmp_path) == "done"
    # How it executes, not what it trains (torch.compile): still done.
    preset.write_text(preset.read_text().replace("compile: auto", "compile: false"))
    assert "compile: false" in preset.read_text()
    assert run.state(step, tmp_path) == "done"
    # A result written before a config key existed (data.translate) trained at its default.
    written = json.loads(res.read_text())
    del written["recipe"]["config"]["data"]["translate"]
    res.write_text(json.dumps(written))
    assert run.state(step, tmp_path) == "done"
    step.argv = [*argv, "data.translate=2"]  # the new key at another value: stale
    assert run.state(step, tmp_path) == "stale"
    step.argv = argv
    # A value that reaches training: stale, and it reruns.
    preset.write_text(preset.read_text().replace("global_batch: 256", "global_batch: 128"))
    assert run.state(step, tmp_path) == "stale"
    assert run.run([step], tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "t") == 2


def test_plan_seeds_reuse_the_lr_seed_0_chose(tmp_path, monkeypatch):
    names = [s.name for s in steps.plan()]
    assert len(names) == len(set(names))
    for arm in ("ft_mpp", "ft_supervised", "scratch"):
        assert all(f"{arm}_s{s}" in names for s in steps.SEEDS)
    sweep = next(s for s in steps.plan() if s.name == "ft_mpp_s0")
    assert "--sweep" in sweep.args() and "run.seed=0" in sweep.args()
    monkeypatch.setattr(steps, "ROOT", tmp_path)
    res = tmp_path / RES
    res.mkdir(parents=True)

    def write(name: str, result: dict) -> None:
        (res / f"{name}.json").parent.mkdir(parents=True, exist_ok=True)
        (res / f"{name}.json").write_text(json.dumps({"result": result}))

    write("ft_mpp_s0", {"chosen": {"optim.lr": 0.03}})
    seed1 = next(s for s in steps.plan() if s.name == "ft_mpp_s1")
    assert "optim.lr=0.03" in seed1.args() and "--sweep" not in seed1.args()
    # The crop every training step uses is the augmentation recipe that won on held-out.
    assert steps.chosen_augmentation() == []  # the presets' own until all three have results
    for name, held in zip(steps.AUGMENTATIONS, (0.70, 0.80, 0.75), strict=True):
        write(name, {"selection_best_top1": held})
    won = steps.RECIPES["recipe_p7_flip"]
    pre = next(s for s in steps.plan() if s.name == "mpp")
    assert steps.chosen_augmentation() == won and pre.args()[-len(won) :] == won
    # The label-scarce seeds reuse the lr their share's seed 0 chose, on the same share.
    write("ft_mpp_labels1_s0", {"chosen": {"optim.lr": 0.01}})
    few = {s.name: s for s in steps.plan() if "labels1_" in s.name}
    assert "--sweep" in few["ft_mpp_labels1_s0"].args()
    assert {"optim.lr=0.01", "data.train_fraction=0.01"} <= set(few["ft_mpp_labels1_s2"].args())
    assert "data.train_fraction=0.01" in few["scratch_labels1_s1"].args()
    assert run.method_of("ft_mpp_s1") == run.method_of("mpp_e2/knn") == "mpp"
    assert run.method_of("scratch_s2") == "scratch"


def test_next_runs_make_the_sweep_directories_and_reuse_its_choice(tmp_path, monkeypatch):
    """From scratch's lr per share: one run directory per lr, seed 0; seeds 1-2 take the lr
    that scored best on held-out. MPP pretraining seeds 1-2 fine-tune at the main sweep's lr."""
    plan = {s.name: s for s in steps.plan()}
    budgets = {
        "1": ("825", "165", "0.01"),
        "10": ("80", "176", "0.1"),
        "30": ("27", "183", "0.3"),
        "100": ("8", "0", "1.0"),
    }
    for share, (epochs, every, fraction) in budgets.items():
        for lr in steps.SCRATCH_LRS:
            step = plan[f"scratch_sweep/labels{share}/lr={lr}"]
            args = step.args()
            assert str(step.run_dir) == f"runs/study/scratch_sweep/labels{share}/lr={lr}"
            assert args[0] == "pipelines/supervised_pretrain.py"
            assert {
                f"train.epochs={epochs}",
                f"run.eval_every={every}",
                "run.seed=0",
                f"data.train_fraction={fraction}",
                f"optim.lr={lr}",
                f"run.dir={step.run_dir}",
            } <= set(args)
    monkeypatch.setattr(steps, "ROOT", tmp_path)
    for lr, held in zip(steps.SCRATCH_LRS, (0.80, 0.84, 0.84, 0.83), strict=True):
        path = tmp_path / RES / f"scratch_sweep/labels10/lr={lr}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"result": {"selection_best_top1": held}}))
    seed2 = plan["scratch_sweep/labels10/chosen_s2"].args()
    assert "optim.lr=1e-3" in seed2 and "run.seed=2" in seed2  # a tie: the first lr
    (tmp_path / RES / "ft_mpp_s0.json").write_text(
        json.dumps({"result": {"chosen": {"optim.lr": 0.03}}})
    )
    assert {"run.seed=1"} <= set(plan["mpp_seed1"].args())
    ft = plan["ft_mpp_seed1_s1"].args()
    assert {"model.init_from=runs/study/mpp_seed1", "optim.lr=0.03", "run.seed=1"} <= set(ft)


def test_steps_nest_under_their_parent_through_the_products_arguments():
    """A training script gets the config override, an evaluator of the common CLI the flag;
    others run unchanged, and without a parent nothing is added."""
    plan = {s.name: s for s in steps.plan()}
    train = plan["recipe_p7"].args()
    nested = run.nested(train, "abc")
    at = nested.index("--config") + 2
    assert nested[at] == "tracking.parent_run_id=abc" and nested[:at] + nested[at + 1 :] == train
    knn = plan["mpp_e6/knn"].args()
    assert run.nested(knn, "abc") == [*knn, "--parent-run-id", "abc"]
    dynamic = plan["cascade/dynamic"].args()
    assert run.nested(dynamic, "abc") == dynamic and run.nested(knn, None) == knn


def test_parent_runs_group_steps_by_method(tmp_path, monkeypatch):
    """One parent per method in a real SQLite store, reused on rerun; a step's headline numbers
    land on its method's parent."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    parents = run.open_parents(Path("runs/study"), tmp_path)
    ids = {parents.run_id(run.method_of(n)) for n in ("mpp50", "mpp50/knn", "ft_mpp50")}
    assert len(ids) == 1 and None not in ids
    pid = ids.pop()
    assert parents.run_id(run.method_of("ft_scratch")) != pid
    again = run.open_parents(Path("runs/study"), tmp_path)  # the ids file, reused
    assert again.run_id("mpp50") == pid
    out = tmp_path / "knn.json"
    out.write_text(json.dumps({"metrics": {"knn_top1@k=20": 0.75, "knn_top1@k=10": 0.7}}))
    run.log_step(again, "mpp50/knn", out)
    assert MlflowClient(uri).get_run(pid).data.metrics == {"knn_top1_k20": 0.75}


def test_welch_matches_a_textbook_example():
    """Welch's t-test, Wikipedia's "Welch's t-test" example 1: t = -2.46, df = 24.99,
    p = 0.021 (and scipy's ttest_ind(equal_var=False) to many digits)."""
    a1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
    a2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]
    w = stats.welch(a1, a2)
    assert round(w.t, 2) == -2.46 and round(w.df, 2) == 24.99 and round(w.p, 3) == 0.021
    assert w.p == pytest.approx(0.021378001462866992, rel=1e-9)
    assert (w.low, w.high) == pytest.approx((-3.984096267140929, -0.3492370661924069), rel=1e-9)
    assert stats.t_quantile(0.975, 4) == pytest.approx(2.7764451051977934, rel=1e-9)
    with pytest.raises(ValueError, match="2\\+ values per sample"):
        stats.welch([1.0], [1.0, 2.0])


WEIGHTS = {"path": "runs/study/mpp", "sha256": "sha256:" + "cd" * 32, "mlflow_run_id": "p" * 32}


def _write(root: Path, name: str, result: dict, **extra) -> None:
    """A result as the runner writes it; a fine-tune (the default command) records the weights
    it started from unless `started_from=None` says it predates that."""
    path = root / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    res = {
        "result": result,
        "machine": "m; 2 cores; 8 GiB RAM; no GPU",
        "git_commit": "c" * 40,
        "command": "python evals/finetune.py model.init_from=runs/study/mpp",
        **extra,
    }
    if "init_from" in res["command"] and "started_from" not in extra:
        res["started_from"] = WEIGHTS
    path.write_text(json.dumps(res))


def test_report_shows_only_results_that_record_their_weights(tmp_path):
    """A result that started from a pretraining without recording its weights is in no row and
    is named instead; the gap is Welch's; frozen features of one set of weights show once; the
    report rebuilds byte for byte."""
    res = tmp_path / RES
    for s, v in enumerate((0.90, 0.92, 0.94)):
        _write(res, f"ft_mpp_seed{s}_s{s}", {"selected_top1": v})
        _write(res, f"scratch_s{s}", {"selected_top1": v - 0.05}, command="python x.py")
    # written before the runner recorded weights, one of them after a rebuilt pretraining
    sweep = {
        "sweep": {"key": "optim.lr", "values": [0.01]},
        "chosen": {"optim.lr": 0.01},
        "selection_best_top1": 0.91,
        "runs": [{"value": 0.01, "selection_best_top1": 0.91}],
    }
    _write(res, "ft_mpp_s0", {**sweep, "selected_top1": 0.991}, started_from=None)
    rebuilt = {"mpp": {"mlflow_run_id": "r" * 32}}
    _write(
        res, tables.LONG_ARMS[0], {"selected_top1": 0.992}, started_from=None, rebuilt_needs=rebuilt
    )
    _write(res, tables.LONG_ARMS[1], {"selected_top1": 0.88}, command="python x.py")
    for ev in ("mpp_e2", "mpp_long_e2"):  # one set of weights under two names
        for kind in ("knn", "probe"):
            params = {"backbone_id": "sha256:" + "ab" * 32}
            _write(
                res,
                f"{ev}/{kind}",
                {
                    "metrics": {records.KNN: 0.7, records.PROBE: 0.8},
                    "params": params,
                    "pretrain_run_id": "p" * 32,
                },
                command=f"python evals/knn.py --backbone runs/study/{ev[:-3]}/export_epoch2",
            )
    out = report.write_report([], tmp_path)
    text = out.read_text()
    w = stats.welch([0.90, 0.92, 0.94], [0.85, 0.87, 0.89])
    assert f"+5.00 [{100 * w.low:+.2f}, {100 * w.high:+.2f}], p={w.p:.2g}" in text
    assert "99.10" not in text and "99.20" not in text and "weights not recorded" not in text
    assert "| 16 + 4 (seed 0) |" not in text  # its fine-tune is hidden: no row
    assert len(re.findall(r"sha256 abababababab", text)) == 1
    assert "(6-epoch run); the same weights: MPP after 2 epochs (16-epoch run)" in text
    assert "95% CI of MPP minus from scratch lies above 0" in text and "| pending |" not in text
    first = out.read_bytes()
    assert report.write_report([], tmp_path).read_bytes() == first
    plan = [steps.Step(n, [], Path(n)) for n in ("ft_mpp_s0", tables.LONG_ARMS[0], "scratch_s0")]
    said = "\n".join(report.hidden_results(Results(res), plan))
    assert (
        said.startswith("\n2 results are in no table")
        and "`ft_mpp_s0`, `ft_mpp_long_seed0_s0`" in said
    )
    # the same step, rerun so that it records its weights, has its row
    _write(res, tables.LONG_ARMS[0], {"selected_top1": 0.89})
    assert (
        "| 16 + 4 (seed 0) | mpp (run pppppppp; sha256 cdcdcdcdcdcd) | 89.0 | 88.0 | +1.00 |"
        in ("\n".join(tables.longer_schedule(Results(res))))
    )
    # one label cannot hold two sets of weights
    a, b = records.Start("mpp", "x", "sha256:1"), records.Start("mpp", "y", "sha256:2")
    with pytest.raises(ValueError, match="different pretrainings"):
        records.one_start("MPP after 6 epochs", [a, b])


def test_a_result_records_the_weights_it_started_from(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    export = tmp_path / "runs/study/pre/export"
    export.mkdir(parents=True)
    (export / "backbone.safetensors").write_bytes(b"weights")
    (export.parent / "mlflow_run_id").write_text("prerun\n")
    (tmp_path / "calls").mkdir()
    step = _step("ev/knn", tmp_path)
    step.argv += ["--backbone", "runs/study/pre"]
    assert run.run([step], tmp_path, Path("runs/study")) == 0
    got = json.loads((tmp_path / RES / "ev/knn.json").read_text())["started_from"]
    import hashlib

    sha = "sha256:" + hashlib.sha256(b"weights").hexdigest()
    want = {"path": "runs/study/pre", "sha256": sha, "mlflow_run_id": "prerun", "result_id": None}
    assert got == want
    # with the pretraining step's result recorded, its result id too
    (tmp_path / RES / "pre.json").write_text(json.dumps({"result_id": "r1", "result": {}}))
    assert run.started_from(step.args(), tmp_path, ("pre",)) == {**want, "result_id": "r1"}


def test_a_result_holds_no_path_of_this_machine(tmp_path):
    """Absolute paths in a step's output become relative to the repository, also under a
    top-level link's target (a shard set shared between copies of the tree)."""
    shared = tmp_path / "elsewhere" / "shards"
    (shared / "fmnist").mkdir(parents=True)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "shards").symlink_to(shared)
    output = {
        "params": {"data": str((shared / "fmnist").resolve()), "keep": "/opt/x"},
        "runs": [str(tree.resolve() / "runs/study/a"), str(tree.resolve())],
    }
    assert run.portable(output, tree) == {
        "params": {"data": "shards/fmnist", "keep": "/opt/x"},
        "runs": ["runs/study/a", "."],
    }


def test_image_passes_sum_the_methods_steps_against_from_scratch(tmp_path):
    for step, seen in (("mpp", 350_000), ("ft_a", 117_000), ("scratch_a", 422_000)):
        lines = [{"step": 1, "train/samples_seen": 1000}, {"step": 9, "train/samples_seen": seen}]
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (tmp_path / f"{step}.metrics.jsonl").write_text(text)
    r = Results(tmp_path)
    assert tables.image_passes(r, ["mpp", "ft_a"], "scratch_a") == "467k; 422k (MPP +11%)"
    assert tables.image_passes(r, ["mpp", "ft_missing"], "scratch_a") == "-"


def test_scratch_lr_grid_chooses_on_held_out_once_the_grid_is_done(tmp_path):
    held = {"5e-4": 0.735, "1e-3": 0.730, "2e-3": 0.731, "4e-3": 0.72}
    for lr in ("5e-4", "2e-3", "4e-3"):
        name = steps.scratch_lr_step(0.01, lr).name
        _write(
            tmp_path, name, {"selection_best_top1": held[lr], "selected_top1": 0.7 + held[lr] / 10}
        )
    r = Results(tmp_path)
    assert "| 1% | 5e-4: 73.50, 1e-3: -, 2e-3: 73.10, 4e-3: 72.00 | grid unfinished |" in "\n".join(
        tables.scratch_lr_grid(r)
    )
    name = steps.scratch_lr_step(0.01, "1e-3").name
    _write(tmp_path, name, {"selection_best_top1": held["1e-3"], "selected_top1": 0.9})
    text = "\n".join(tables.scratch_lr_grid(r))  # the test split never chooses: 1e-3 loses
    assert "| 5e-4 (test top-1 77.35) |" in text
    assert "The choice is at an edge of the grid at 1% (5e-4)" in text


def test_seeds_table_tests_three_pretrainings_against_the_tuned_arm(tmp_path):
    """A share shows once all three pretrainings are fine-tuned; from scratch's arm is its grid's
    held-out choice (seed 0) and that lr's seeds 1-2, tested with Welch's t."""
    r = Results(tmp_path)
    _write(tmp_path, "ft_mpp_seed1_labels1_s1", {"selected_top1": 0.74})
    _write(tmp_path, "ft_mpp_seed2_labels1_s2", {"selected_top1": 0.73})
    # seed 0 without the weights it started from does not count
    _write(tmp_path, "ft_mpp_seed0_labels1_s0", {"selected_top1": 0.75}, started_from=None)
    assert tables.seeds_table(r, tables.arms()) == []  # two pretrainings of three: no row
    _write(tmp_path, "ft_mpp_seed0_labels1_s0", {"selected_top1": 0.75})
    held = {"5e-4": 0.70, "1e-3": 0.72, "2e-3": 0.72, "4e-3": 0.71}  # a tie: the first wins
    for lr, h in held.items():
        _write(tmp_path, steps.scratch_lr_step(0.01, lr).name, {"selection_best_top1": h})
    assert tables.tuned_scratch(r, 0.01) == ("1e-3", [steps.scratch_lr_step(0.01, "1e-3").name])
    _write(
        tmp_path,
        steps.scratch_lr_step(0.01, "1e-3").name,
        {"selection_best_top1": 0.72, "selected_top1": 0.70},
    )
    for s, v in ((1, 0.71), (2, 0.72)):
        config = {"config": {"optim": {"lr": 0.001 if s == 1 else 0.002}}}
        _write(tmp_path, steps.scratch_lr_seed(0.01, s).name, {"selected_top1": v}, recipe=config)
    # seed 2 trained at another lr (a choice the grid has since changed): not in the arm
    assert tables.tuned_scratch(r, 0.01)[1][1:] == [steps.scratch_lr_seed(0.01, 1).name]
    config = {"config": {"optim": {"lr": 0.001}}}
    _write(tmp_path, steps.scratch_lr_seed(0.01, 2).name, {"selected_top1": 0.72}, recipe=config)
    text = "\n".join(tables.seeds_table(r, tables.arms()))
    w = stats.welch([0.75, 0.74, 0.73], [0.70, 0.71, 0.72])
    assert (
        f"| 71.00 ± 1.00 (n=3) at lr 1e-3 | +3.00 [{100 * w.low:+.2f}, {100 * w.high:+.2f}]" in text
    )
    assert "| 10% |" not in text
    head = "\n".join(tables.headline(r))
    assert f"- 1% of the labels: +3.00 points [{100 * w.low:+.2f}" in head
    assert "Not yet answered at 10%, 30%, 100% of the labels" in head
    assert "ahead (the goal: the interval above 0) at 1% of the labels; behind at no share" in head
    assert "| 74.00 ± 1.00 (n=3): 75.00, 74.00, 73.00 |" in text


def test_gpu_track_follows_issue_38s_rules(tmp_path):
    """On the GPU track: seeds 0-2 pretrain MPP again and fine-tune it once; from scratch gets
    the grid at the GPU budget; a preset-lr seed stands in for the tuned arm only when the grid
    chose the preset's lr, and the GPU row waits for all three pretrainings."""
    gpu = {s.name: s for s in steps.gpu_seed_runs()}
    assert all(s.gpu for s in gpu.values())
    ft = gpu["ft_mpp_hybrid_gpu_seed2_s2"]
    assert ft.needs == ("mpp_hybrid_gpu_seed2",)
    grid = " ".join(gpu["scratch_sweep/hybrid_gpu/lr=4e-3"].args())
    assert f"train.epochs={steps.GPU_SCRATCH_EPOCHS}" in grid and "model.img_size=32" in grid
    assert "run.seed=1" in " ".join(gpu["mpp_hybrid_gpu_seed1"].args())
    # the CPU study's runner leaves them alone unless named
    assert not any(s.gpu for s in steps.next_runs())

    r = Results(tmp_path)
    for s, v in zip(tables.GPU_FT[:2], (0.91, 0.92), strict=True):
        _write(tmp_path, s, {"selected_top1": v})
    held = {"5e-4": 0.90, "1e-3": 0.93, "2e-3": 0.92, "4e-3": 0.91}
    for lr, h in held.items():
        result = {"selection_best_top1": h, "selected_top1": h - 0.01}
        _write(tmp_path, steps.scratch_lr_step(steps.GPU_SWEEP, lr).name, result)
    preset = {"config": {"optim": {"lr": 0.001}}}
    for s in tables.GPU_SCRATCH:
        _write(tmp_path, s, {"selected_top1": 0.915}, recipe=preset)
    lr, tuned = tables.tuned_scratch(r, steps.GPU_SWEEP, stand_ins=tables.GPU_SCRATCH[1:])
    assert (lr, tuned[1:]) == ("1e-3", tables.GPU_SCRATCH[1:])
    assert "Issue 38's rules" not in "\n".join(tables.gpu_tables(r))
    _write(tmp_path, tables.GPU_FT[2], {"selected_top1": 0.93})
    assert "| 100% | 92.00 ± 1.00 (n=3)" in "\n".join(tables.gpu_tables(r))
    # the grid now chooses 2e-3: the preset-lr seeds no longer count
    result = {"selection_best_top1": 0.95, "selected_top1": 0.94}
    _write(tmp_path, steps.scratch_lr_step(steps.GPU_SWEEP, "2e-3").name, result)
    lr, tuned = tables.tuned_scratch(r, steps.GPU_SWEEP, stand_ins=tables.GPU_SCRATCH[1:])
    assert (lr, tuned) == ("2e-3", [steps.scratch_lr_step(steps.GPU_SWEEP, "2e-3").name])


def test_provenance_reruns_repeat_their_first_runs():
    """Each rerun is its first run's command but for the run directory, the pretraining it
    reads, its exports and an explicit seed 0; a fine-tune takes the lr its first run's sweep
    chose instead of sweeping again."""
    plan = {s.name: s for s in steps.plan()}
    varying = ("run.dir=", "model.init_from=", "run.export_epochs=", "run.seed=", "optim.lr=")

    def fixed(name: str) -> list[str]:
        args = [a for a in plan[name].args() if not a.startswith(varying)]
        return [a.replace("_seed0", "") for a in args if a != "--sweep"]  # paths: the first run's

    first = {
        "ft_mpp_seed0_longft_s0": "ft_mpp_longft_s0",
        "ft_mpp_seed0_longft12_s0": "ft_mpp_longft12_s0",
        "mpp_long_seed0": "mpp_long",
        "ft_mpp_long_seed0_s0": "ft_mpp_long_s0",
        "mpp_hybrid_seed0": "mpp_hybrid",
        "ft_mpp_hybrid_seed0_s0": "ft_mpp_hybrid_s0",
        "mixer_seed0": "mixer",
        "ft_mixer_seed0_s0": "ft_mixer_s0",
        "inspect_mpp_seed0": "inspect_mpp",
        "cascade_no_relation_reuse_mpp_seed0": "cascade_no_relation_reuse",
        "ft_mpp_long_seed0_42px": "ft_mpp_long_42px",
        "ft_recipe_layer_decay_mpp_seed0": "ft_recipe_layer_decay",
        "mpp_p4_seed0": "mpp_p4",
    }
    reruns = {s.name: s for s in steps.provenance_reruns()}
    assert set(first) <= set(reruns)
    for rerun, original in first.items():
        assert fixed(rerun) == fixed(original), rerun
        assert all(n in reruns or n == "mpp_seed0" for n in reruns[rerun].needs), rerun
    lr = [a for a in plan["ft_mixer_seed0_s0"].args() if a.startswith("optim.lr=")]
    assert lr == [f"optim.lr={steps.chosen_lr('ft_mixer_s0')}"]


def test_the_run_count_covers_the_gpu_steps_it_lists(tmp_path):
    """The status sentence counts the GPU track's steps with the CPU ones: all CPU steps done
    and GPU steps left never reads as everything run."""
    cpu, gpu = ["a", "b"], ["g1", "g2", "g3"]
    for name in ("a", "b", "g2"):
        _write(tmp_path, name, {"selected_top1": 0.9})
    text = report.run_count(Results(tmp_path), cpu, gpu)
    assert text.startswith("3 of these 5 steps have run: 2 of the 2 CPU steps and 1 of the 3 ")
    assert text.endswith("Not run yet: g1 (GPU), g3 (GPU).")
    plan_text = "\n".join(report.issue38_plan(Results(tmp_path)))
    total = len(steps.next_runs()) + len(steps.gpu_seed_runs())
    assert f"0 of these {total} steps have run" in plan_text


def test_mpps_lr_on_its_grids_edge_is_said(tmp_path):
    """MPP's sweep per share is shown with its held-out scores; a choice on the grid's edge is
    named, beside the note that from scratch's grid grew and MPP's did not."""
    runs = [
        {"value": v, "selection_best_top1": h}
        for v, h in ((0.003, 0.70), (0.01, 0.71), (0.03, 0.72), (0.06, 0.73))
    ]
    sweep = {"runs": runs, "sweep": {"key": "optim.lr"}, "chosen": {"optim.lr": 0.06}}
    _write(tmp_path, tables.mpp_sweep_step(0.1), sweep)
    rows, edges = tables.mpp_lr_rows(Results(tmp_path))
    assert edges == ["10% (0.06, its highest)"]
    held = "0.003: 70.00, 0.01: 71.00, 0.03: 72.00, 0.06: 73.00"
    assert rows[0].startswith(f"| 10% | {held} | 0.06 |")
    assert "MPP's grid was never widened" in "\n".join(tables.mpp_lr_lines(Results(tmp_path)))


def test_the_100_percent_headline_says_its_fine_tune_is_short(tmp_path):
    """The 100% row's note: a 2-epoch fine-tune; the longer fine-tunes' gaps, where shown."""
    r = Results(tmp_path)
    assert "fine-tunes for 2 epochs only" in tables.longer_finetune_note(r, -0.02)
    assert "Fine-tuned longer" not in tables.longer_finetune_note(r, -0.02)
    for (_, ft, base), (a, b) in zip(tables.FT_LONG, ((0.88, 0.885), (0.89, 0.891)), strict=True):
        _write(tmp_path, ft, {"selected_top1": a})
        _write(tmp_path, base, {"selected_top1": b}, command="python x.py")
    note = tables.longer_finetune_note(r, -0.02)
    assert "seed 0's pretraining narrows the gap (-2.00 here" in note
    assert "6 + 12 against 18: MPP 89.00, from scratch 89.10 (-0.10)" in note
