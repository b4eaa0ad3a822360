"""ssl_vit.engine.launches: each launch of a run directory on record, with what it changed.

The MLflow side (tags, artifacts, params with a store up and down) is in test_tracking.py, and
two real training launches in test_train_e2e.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from ssl_vit.config import load_config, save_config
from ssl_vit.engine import launches
from ssl_vit.engine.launches import UNSET, changes, describe


def _cfg(run_dir: Path, *extra: str):
    return load_config(None, ["train.steps=10", f"run.dir={run_dir}", *extra])


def test_changes_name_each_flattened_key_old_and_new() -> None:
    old = {"optim": {"lr": 0.002, "betas": [0.9, 0.999]}, "train": {"deepspeed": {}}}
    new = {"optim": {"lr": 0.001, "betas": [0.9, 0.999]}, "train": {"deepspeed": {"x": 1}}}
    assert changes(old, new) == {
        "optim.lr": {"old": 0.002, "new": 0.001},
        "train.deepspeed.x": {"old": UNSET, "new": 1},  # as the params name it
        "train.deepspeed": {"old": {}, "new": UNSET},
    }
    assert changes(new, new) == {}
    assert changes({"a": 1}, {"a": 1.0}) == {"a": {"old": 1, "new": 1.0}}  # "1" -> "1.0": a param


def test_describe_cuts_after_a_whole_change_and_says_how_many_more() -> None:
    many = {f"k{i}": {"old": i, "new": i + 1} for i in range(100)}
    text = describe(many, "launches/launch-3.yaml", limit=100)
    assert len(text) <= 100 and text.startswith("k0: 0 -> 1; k1: 1 -> 2;"), text
    kept = text.split(" (+")[0].split("; ")
    assert all(part.count(" -> ") == 1 for part in kept)  # no change cut in half
    assert text.endswith(f"(+{100 - len(kept)} more in launches/launch-3.yaml)"), text
    few = {"optim.lr": {"old": 0.002, "new": 0.001}, "train.steps": {"old": 8, "new": 12}}
    assert describe(few, "f") == "optim.lr: 0.002 -> 0.001; train.steps: 8 -> 12"
    huge = {"train.deepspeed": {"old": {}, "new": {"x": "y" * 500}}}
    assert len(describe(huge, "f")) < 120  # one long value is shortened, not the whole list


def test_each_launch_is_numbered_and_keeps_the_config_it_replaced(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    first = launches.begin(run, _cfg(run), "# mpp_pretrain.py a=1")
    assert first.number == 1 and first.changed == {} and first.logged_params(True, {}) is None
    first.finish({"world_size": 1}, step=0)
    second = launches.begin(run, _cfg(run, "optim.lr=1e-4", "train.steps=20"), "# again")
    assert second.number == 2
    assert second.changed == {
        "optim.lr": {"old": 0.0002, "new": 0.0001},
        "train.steps": {"old": 10, "new": 20},
    }
    second.finish({"world_size": 2}, step=10)  # resumed on two ranks
    assert second.changed["derived.world_size"] == {"old": 1, "new": 2}
    # config.yaml is this launch's; the one it replaced stays in launch-1.yaml
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == 0.0001
    kept = yaml.safe_load((run / "launches" / "launch-1.yaml").read_text())
    assert kept["config"]["optim"]["lr"] == 0.0002 and kept["mlflow_params"] is True
    record = yaml.safe_load(second.path.read_text())
    assert (record["launch"], record["step"], record["command"]) == (2, 10, "again")
    assert record["changed"]["optim.lr"] == {"old": 0.0002, "new": 0.0001}
    # launch 1 logged every param: a third launch logs none of those again
    third = launches.begin(run, _cfg(run, "optim.lr=1e-4", "train.steps=20"), "")
    assert third.number == 3 and third.changed == {}
    logged = third.logged_params(False, {"world_size": 2, "micro": 8})
    assert logged is not None and {"optim.lr", "derived.world_size"} <= logged
    assert "derived.micro" not in logged  # new: this launch logs it
    assert "config as at launch 2" in third.summary()


def test_a_launch_that_never_reached_the_tracker_logs_no_params(tmp_path: Path) -> None:
    """Launch 1 failed before its tracker opened (no `finish`): launch 2 logs the params."""
    run = tmp_path / "run"
    run.mkdir()
    launches.begin(run, _cfg(run), "")
    second = launches.begin(run, _cfg(run, "optim.lr=1e-4"), "")
    assert second.number == 2 and second.logged_params(True, {}) is None


def test_a_run_directory_from_before_the_records_gets_its_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    save_config(_cfg(run), run / "config.yaml", "# mpp_pretrain.py")  # an older version's run
    later = launches.begin(run, _cfg(run, "optim.lr=1e-4"), "")
    assert later.number == 2 and list(later.changed) == ["optim.lr"]
    first = yaml.safe_load((run / "launches" / "launch-1.yaml").read_text())
    assert first["launch"] == 1 and first["config"]["optim"]["lr"] == 0.0002
    assert later.logged_params(True, {}) is None  # its params may never have been logged
    logged = later.logged_params(False, {"world_size": 1})  # it had a checkpoint: they were
    assert logged is not None and {"optim.lr", "derived.world_size"} <= logged
