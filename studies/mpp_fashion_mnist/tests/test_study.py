"""The study runner and its report: a step with a committed result is never rerun, a missing
export is rebuilt first, results carry what a reader needs, and the report's statistics and
goal checks follow from the result files (real subprocesses and a real MLflow SQLite store)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

sys.path.insert(0, str(ROOT / "evals"))

import study  # noqa: E402
import study_mlflow  # noqa: E402
import study_report  # noqa: E402
import study_run  # noqa: E402
import study_steps  # noqa: E402
from study_results import Results  # noqa: E402

WRITE = "import json, sys, pathlib; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); p.write_text(json.dumps({'metrics': {'v': 1}})); open(sys.argv[2], 'a').write('x')"  # noqa: E501


def _step(name: str, tmp: Path, needs: tuple[str, ...] = ()) -> study.Step:
    out = Path("runs/study") / name / "out.json"
    argv = ["-c", WRITE, str(tmp / out), str(tmp / "calls" / name.replace("/", "-"))]
    return study.Step(name, argv, out, needs)


def _calls(tmp: Path, name: str) -> int:
    path = tmp / "calls" / name
    return len(path.read_text()) if path.is_file() else 0


def test_runner_skips_results_and_rebuilds_missing_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "calls").mkdir()
    steps = [_step("pre", tmp_path), _step("pre_e1/knn", tmp_path, ("pre",)),
             _step("pre_e2/knn", tmp_path, ("pre",))]  # fmt: skip
    assert study_run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 1 and _calls(tmp_path, "pre_e1-knn") == 1
    pre_result = (tmp_path / "results/study/pre.json").read_text()
    res = json.loads((tmp_path / "results/study/pre_e1/knn.json").read_text())
    assert res["result"] == {"metrics": {"v": 1}} and res["seconds"] > 0
    assert res["command"].startswith("python -c") and res["machine"]
    # Everything has a result: a rerun runs nothing.
    assert study_run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 1 and _calls(tmp_path, "pre_e1-knn") == 1
    # A new machine: results committed, runs/ gone, one result missing. Only that step runs,
    # after the step whose export it reads.
    for p in (tmp_path / "runs").rglob("*.json"):
        p.unlink()
    (tmp_path / "results/study/pre_e1/knn.json").unlink()
    assert study_run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 2 and _calls(tmp_path, "pre_e1-knn") == 2
    # The rebuilt export is a cache: the pretraining's result, and so the result of the other
    # step that reads it, stand.
    assert (tmp_path / "results/study/pre.json").read_text() == pre_result
    assert [study_run.state(s, tmp_path) for s in steps] == ["done"] * 3
    assert _calls(tmp_path, "pre_e2-knn") == 1
    # ...but the step that read the rebuilt weights (not bitwise the first run's) says so.
    res = json.loads((tmp_path / "results/study/pre_e1/knn.json").read_text())
    assert list(res["rebuilt_needs"]) == ["pre"] and res["rebuilt_needs"]["pre"]["finished"]
    assert "rebuilt_needs" not in json.loads(
        (tmp_path / "results/study/pre_e2/knn.json").read_text()
    )
    # Output there but no result (stopped between the two): recorded without rerunning.
    (tmp_path / "results/study/pre_e1/knn.json").unlink()
    assert study_run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre_e1-knn") == 2
    assert (tmp_path / "results/study/pre_e1/knn.json").is_file()
    # A changed recipe (here: the pretraining's command) makes its result stale, and so the
    # results of the steps that read its export: both rerun, the old output is kept aside.
    steps[0].argv.append("changed")
    assert [study_run.state(s, tmp_path) for s in steps] == ["stale", "done", "done"]
    assert study_run.run(steps, tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "pre") == 3 and _calls(tmp_path, "pre_e1-knn") == 3
    assert [study_run.state(s, tmp_path) for s in steps] == ["done"] * 3
    assert len(list((tmp_path / "runs/study/pre").glob("out.json.stale-*"))) == 1
    # A fresh pretraining result: its export is no longer a rebuild.
    assert "rebuilt_needs" not in json.loads(
        (tmp_path / "results/study/pre_e1/knn.json").read_text()
    )


def test_a_stale_sweep_keeps_its_run_directory(tmp_path, monkeypatch):
    """The sweep judges its own values (a grown grid trains only the new ones): the study
    moves aside only the sweep's results file, never the finished values' runs."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "calls").mkdir()
    sweep = _step("sw", tmp_path)
    sweep.argv += ["--sweep", "optim.lr=0.01,0.03"]
    sweep.run_dir = Path("runs/study/sw")
    assert study_run.run([sweep], tmp_path, Path("runs/study")) == 0
    (tmp_path / "runs/study/sw/optim.lr=0.01").mkdir()
    sweep.argv[-1] = "optim.lr=0.01,0.03,0.06"
    assert study_run.state(sweep, tmp_path) == "stale"
    assert study_run.run([sweep], tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "sw") == 2 and study_run.state(sweep, tmp_path) == "done"
    assert (tmp_path / "runs/study/sw/optim.lr=0.01").is_dir()
    assert len(list((tmp_path / "runs/study/sw").glob("out.json.stale-*"))) == 1


def test_a_failed_step_leaves_no_result_and_stops_the_study(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    bad = study.Step("bad", ["-c", "raise SystemExit(3)"], Path("runs/study/bad/out.json"))
    later = _step("later", tmp_path)
    (tmp_path / "calls").mkdir()
    assert study_run.run([bad, later], tmp_path, Path("runs/study")) == 3
    assert not (tmp_path / "results/study/bad.json").exists() and _calls(tmp_path, "later") == 0


def test_a_resumed_step_says_its_time_is_the_last_leg(tmp_path, monkeypatch):
    """A training that resumed from its checkpoints (a stopped lease, a new session) records
    only its last leg's wall time: the result and the report's step table say so. The commit
    a copied tree names in $SSL_VIT_GIT_COMMIT wins over what its .git says."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("SSL_VIT_GIT_COMMIT", "c0ffee" * 6 + "c0ff")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)  # a .git whose HEAD is another commit
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "stale"], check=True)
    (tmp_path / "calls").mkdir()
    fresh, resumed = _step("fresh", tmp_path), _step("again", tmp_path)
    for step in (fresh, resumed):
        step.run_dir = Path("runs/study") / step.name
    (tmp_path / "runs/study/fresh/checkpoints").mkdir(parents=True)  # empty: nothing to resume
    (tmp_path / "runs/study/again/checkpoints/step00000050").mkdir(parents=True)
    assert study_run.run([fresh, resumed], tmp_path, Path("runs/study")) == 0
    got = {n: json.loads((tmp_path / f"results/study/{n}.json").read_text())
           for n in ("fresh", "again")}  # fmt: skip
    assert [got[n]["resumed"] for n in ("fresh", "again")] == [False, True]
    assert {g["git_commit"] for g in got.values()} == {"c0ffee" * 6 + "c0ff"}
    table = "\n".join(study_report.steps_table(Results(tmp_path / "results/study"),
                                               [fresh, resumed]))  # fmt: skip
    assert table.count("its last leg") == 1 and "| again |" in table.split("its last leg")[0]


def test_plan_seeds_reuse_the_lr_seed_0_chose(tmp_path, monkeypatch):
    names = [s.name for s in study.plan()]
    assert len(names) == len(set(names))
    for arm in ("ft_mpp", "ft_supervised", "scratch"):
        assert all(f"{arm}_s{s}" in names for s in study.SEEDS)
    sweep = next(s for s in study.plan() if s.name == "ft_mpp_s0")
    assert "--sweep" in sweep.args() and "run.seed=0" in sweep.args()
    monkeypatch.setattr(study_steps, "RESULTS", tmp_path)
    (tmp_path / "ft_mpp_s0.json").write_text(json.dumps({"result": {"chosen": {"optim.lr": 0.03}}}))
    seed1 = next(s for s in study.plan() if s.name == "ft_mpp_s1")
    assert "optim.lr=0.03" in seed1.args() and "--sweep" not in seed1.args()
    # The crop every training step uses is the augmentation recipe that won on held-out.
    assert study_steps.chosen_augmentation() == []  # the presets' own until all three have results
    for name, held in zip(study.AUGMENTATIONS, (0.70, 0.80, 0.75), strict=True):
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"result": {"selection_best_top1": held}})
        )
    won = study.RECIPES["recipe_p7_flip"]
    pre = next(s for s in study.plan() if s.name == "mpp")
    assert study_steps.chosen_augmentation() == won and pre.args()[-len(won) :] == won
    # The label-scarce seeds reuse the lr their share's seed 0 chose, on the same share.
    (tmp_path / "ft_mpp_labels1_s0.json").write_text(
        json.dumps({"result": {"chosen": {"optim.lr": 0.01}}})
    )
    few = {s.name: s for s in study.plan() if "labels1_" in s.name}
    assert "--sweep" in few["ft_mpp_labels1_s0"].args()
    assert {"optim.lr=0.01", "data.train_fraction=0.01"} <= set(few["ft_mpp_labels1_s2"].args())
    assert "data.train_fraction=0.01" in few["scratch_labels1_s1"].args()
    assert study_mlflow.method_of("ft_mpp_s1") == study_mlflow.method_of("mpp_e2/knn") == "mpp"
    assert study_mlflow.method_of("scratch_s2") == "scratch"


def _write(root: Path, name: str, result: dict, **extra) -> None:
    path = root / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    res = {"result": result, "machine": "m", "command": "c", "seconds": 60, **extra}
    path.write_text(json.dumps(res))


def test_report_statistics_and_goals_follow_the_results(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    res = tmp_path / "results/study"
    sweep = {"sweep": {"key": "optim.lr", "values": [0.01, 0.03]}, "chosen": {"optim.lr": 0.01},
             "selected_top1": 0.90, "selection_best_top1": 0.91,
             "runs": [{"value": 0.01, "selection_best_top1": 0.91},
                      {"value": 0.03, "selection_best_top1": 0.89}]}  # fmt: skip
    _write(res, "ft_mpp_s0", sweep)
    _write(res, "ft_mpp_s1", {"selected_top1": 0.92})
    _write(res, "ft_mpp_s2", {"selected_top1": 0.94})
    for s, v in enumerate((0.88, 0.885, 0.89)):
        _write(res, f"scratch_s{s}", {"selected_top1": v})
    for e, v in ((0, None), (1, 0.70), (2, 0.75), (4, 0.80), (6, 0.85)):
        name = "random" if e == 0 else f"mpp_e{e}"
        acc = 0.60 if v is None else v
        _write(res, f"{name}/knn", {"metrics": {study_report.KNN: acc}})
        _write(res, f"{name}/probe", {"metrics": {study_report.PROBE: acc + 0.01}})
    # The longer schedule: one seed of each, its own snapshots (study.LONG_SNAPSHOTS).
    _write(res, "ft_mpp_long_s0", {**sweep, "selected_top1": 0.905})
    _write(res, "scratch_long_s0", {"selected_top1": 0.89})
    for e, v in ((2, 0.72), (4, 0.78), (8, 0.84), (16, 0.86)):
        _write(res, f"mpp_long_e{e}/knn", {"metrics": {study_report.KNN: v}})
    accs = (0.5, 0.4, 0.6, 0.7)
    few = {f"fewshot_{n}shot_mean": a for n, a in zip((1, 5, 10, 25), accs, strict=True)}
    _write(res, "pixels/fewshot", {"metrics": few})
    speed = {"ratio": 0.905, "ratio_per_round": [0.88, 0.905, 0.93], "compile_mode": "trial",
             "plain_images_per_s": 900.0, "pipeline_eager": {"train/images_per_s": 790.0},
             "pipeline_compiled": {"train/images_per_s": 814.5},
             "ratio_like_for_like": [0.87, 0.86]}  # fmt: skip
    _write(res, "speed", speed)
    decay = {"sweep": {"key": "optim.layer_decay", "values": [0.65, 0.75]},
             "chosen": {"optim.layer_decay": 0.75}, "selected_top1": 0.89,
             "selection_best_top1": 0.905,
             "runs": [{"value": 0.65, "selection_best_top1": 0.9},
                      {"value": 0.75, "selection_best_top1": 0.905}]}  # fmt: skip
    _write(res, "ft_recipe_layer_decay", decay)
    out = tmp_path / "RESULTS.md"
    study_report.write_report([], Path("results/study"), out, "budget", Path("runs/study"),
                              (1, 2, 4, 6), (0, 1, 2))  # fmt: skip
    text = out.read_text()
    assert "| 92.00 ± 2.00 (n=3) | 90.00, 92.00, 94.00 | 0.01 (held-out top-1 0.01: 91.00" in text
    assert "| MPP minus from scratch | >= +1.0 and > 2 std | +3.50 (2 std = 4.00) | no |" in text
    assert "| MPP fine-tuned, mean of seeds | >= 93.0 | 92.00 | no |" in text
    # rising and 10+ above random, but below the 87 goal
    assert "6 ep 85.0; random 60.0 | no |" in text
    assert "| 50.0 / 40.0 / 60.0 / 70.0 | no |" in text  # few-shot falls from 1 to 5 shots
    # a fine-tuning recipe with a sweep of its own: its key's choice, at the lr sweep's choice
    assert ("| ft_recipe_layer_decay | `--sweep=optim.layer_decay=0.65,0.75,0.85` at the sweep's "
            "`optim.lr=0.01`; chose 0.75 (held-out top-1 0.65: 90.00, 0.75: 90.50) | 90.5 | "
            "89.0 |") in text  # fmt: skip
    assert (
        "| >= 0.9x | 0.91x (median of rounds 0.88, 0.91, 0.93; as a full run trains: the "
        "faster of the two (auto's trial); pipeline 790 eager, 814 compiled vs plain 900 "
        "images/s, fp32); like for like: 0.87x eager, 0.86x both compiled | yes |"
    ) in text
    # What the curves say: computed from the snapshots (85.0 at 6 epochs, +2.5 per epoch).
    reading = (
        "- MPP frozen kNN (k=20) (6-epoch run): +2.50 points per epoch from 2 to 4 "
        "epochs, +2.50 from 4 to 6; 2.0 short of 87: 1 more epochs at the latest rate"
    )
    assert reading in text
    # the longer schedule: its row beside the shorter budget's seed 0, its goals, its reading
    assert "| 6 + 2 (seed 0) | 90.0 | 88.0 | +2.00 | 0.01 (held-out" in text
    assert "| 16 + 4 (seed 0) | 90.5 | 89.0 | +1.50 | 0.01 (held-out" in text
    assert "| MPP fine-tuned, longer schedule (1 seed) | >= 93.0 | 90.50 | no |" in text
    # +1.50 clears +1.0 but not twice the shorter budget's largest std (2 x 2.00)
    assert ("longer schedule (1 seed) | >= +1.0 and > 2 std (the shorter budget's) | +1.50 "
            "(2 std = 4.00) | no |") in text  # fmt: skip
    assert "2 ep 72.0, 4 ep 78.0, 8 ep 84.0, 16 ep 86.0; random 60.0 | no |" in text
    assert ("- MPP frozen kNN (k=20) at the end of each run: 85.0 after 6 epochs, 86.0 after 16 "
            "(+1.0 points for 2.7x the pretraining).") in text  # fmt: skip
    assert (res / "pretraining_curve.png").stat().st_size > 1000
    assert "](results/study/pretraining_curve.png)" in text
    # The figures went to the MPP parent run of this study's folder (not the cwd's).
    assert "mpp" in json.loads((tmp_path / "runs/study/mlflow_parents.json").read_text())
    # Seeds 1 and 2 of the longer schedule: its rows in the main table, and its gap judged by
    # its own spread.
    for seed, (ft, base) in enumerate(((0.915, 0.895), (0.91, 0.885)), start=1):
        _write(res, f"ft_mpp_long_s{seed}", {"selected_top1": ft})
        _write(res, f"scratch_long_s{seed}", {"selected_top1": base})
    # 10% of the labels, three seeds: a row of the label-scarce table, a goal row, the figure.
    for seed, (ft, base) in enumerate(((0.85, 0.82), (0.86, 0.83), (0.84, 0.81))):
        rebuilt = {"rebuilt_needs": {"mpp": {"finished": "t"}}} if seed == 2 else {}
        _write(res, f"ft_mpp_labels10_s{seed}", {**sweep, "selected_top1": ft}, **rebuilt)
        _write(res, f"scratch_labels10_s{seed}", {"selected_top1": base})
    study_report.write_report([], Path("results/study"), out, "budget", Path("runs/study"),
                              (1, 2, 4, 6), (0, 1, 2))  # fmt: skip
    text = out.read_text()
    assert "epochs, fine-tuned | 91.00 ± 0.50 (n=3) | 90.50, 91.50, 91.00 | 0.01" in text
    assert "| MPP fine-tuned, longer schedule (3 seeds) | >= 93.0 | 91.00 | no |" in text
    assert ("| MPP minus from scratch, longer schedule (3 seeds) | >= +1.0 and > 2 std | "
            "+2.00 (2 std = 1.00) | yes |") in text  # fmt: skip
    assert ("| 10% of the labels | 6 + 20; 80 | 85.00 ± 1.00 (n=3) | 82.00 ± 1.00 (n=3) | "
            "+3.00 (2.00) | 0.01 (held-out") in text  # fmt: skip
    assert ("| MPP minus from scratch, 10% of the labels (3 seeds) | >= +1.0 and > 2 std | "
            "+3.00 (2 std = 2.00) | yes |") in text  # fmt: skip
    assert (res / "labels.png").stat().st_size > 1000 and "](results/study/labels.png)" in text
    # seed 2 read a rerun of the pretraining: the table says so, and so does its step's row
    assert "\nft_mpp_labels10_s2 fine-tuned a rerun of the pretraining (a new machine" in text
    assert "| 30% of the labels | 6 + 7; 27 | pending | pending | - |" in text  # planned, not run


def test_reading_a_run_curve():
    """A loss still falling vs flat; a sweep's held-out history is that of its chosen value."""
    import study_reading

    falling = [{"train/loss": v} for v in (4, 3, 2, 1)]
    flat = [{"train/loss": v} for v in (4, 1, 1.0, 0.99)]
    assert study_reading.loss_fall(falling) == 0.5  # last quarter 1 vs the one before 2
    assert study_reading.loss_fall(flat) < study_reading.FLAT
    assert study_reading.loss_fall(falling[:3]) is None

    class R:
        def output(self, step):
            return {"chosen_run_dir": "b", "runs": [
                {"run_dir": "a", "history": [[1, 0.1, 0.1]]},
                {"run_dir": "b", "history": [[5, 0.8, 0.7], [10, 0.9, 0.8]]}]}  # fmt: skip

    assert study_reading.held_out_history(R(), "ft") == [(5, 0.8), (10, 0.9)]


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
    argv = ["train.py", "--out", str(tmp_path / out), "--calls", str(tmp_path / "calls/t"),
            "--config", "preset.yaml", "data.crop_scale=[1.0,1.0]", "train.epochs=2"]  # fmt: skip
    step = study.Step("t", argv, out)
    assert study_run.run([step], tmp_path, Path("runs/study")) == 0
    res = tmp_path / "results/study/t.json"
    written = json.loads(res.read_text())
    assert written["recipe"]["config"]["data"]["crop_scale"] == [1.0, 1.0]
    # An older result (the command and the config file's sha256) is upgraded, not rerun.
    written["recipe"] = study_run._recipe_by_files(step, tmp_path)
    res.write_text(json.dumps(written))
    assert study_run.state(step, tmp_path) == "done"
    assert study_run.run([step], tmp_path, Path("runs/study")) == 0
    assert "config" in json.loads(res.read_text())["recipe"] and _calls(tmp_path, "t") == 1
    # The preset takes the crop the command sets, and a comment: still done.
    preset.write_text("# flips only: chosen on held-out\n" + text.replace(
        "crop_scale: [0.35, 1.0]", "crop_scale: [1.0, 1.0]"))  # fmt: skip
    assert "crop_scale: [1.0, 1.0]" in preset.read_text()
    assert study_run.state(step, tmp_path) == "done"
    # How it executes, not what it trains (torch.compile): still done.
    preset.write_text(preset.read_text().replace("compile: auto", "compile: false"))
    assert "compile: false" in preset.read_text()
    assert study_run.state(step, tmp_path) == "done"
    # A result written before a config key existed (data.translate) trained at its default.
    written = json.loads(res.read_text())
    del written["recipe"]["config"]["data"]["translate"]
    res.write_text(json.dumps(written))
    assert study_run.state(step, tmp_path) == "done"
    step.argv = [*argv, "data.translate=2"]  # the new key at another value: stale
    assert study_run.state(step, tmp_path) == "stale"
    step.argv = argv
    # A value that reaches training: stale, and it reruns.
    preset.write_text(preset.read_text().replace("global_batch: 256", "global_batch: 128"))
    assert study_run.state(step, tmp_path) == "stale"
    assert study_run.run([step], tmp_path, Path("runs/study")) == 0
    assert _calls(tmp_path, "t") == 2
