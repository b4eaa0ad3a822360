"""Tracker against real MLflow: a SQLite store, and a real `mlflow server` killed mid-run."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import MlflowServer, wait_until
from mlflow.tracking import MlflowClient

from ssl_vit.tracking import MAX_PARAM_LEN, Tracker, flatten, main


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_flatten_truncates() -> None:
    flat = flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": "x" * (MAX_PARAM_LEN + 10), "f": {}})
    assert flat == {"a.b.c": "1", "a.d": "[1, 2]", "e": "x" * MAX_PARAM_LEN, "f": "{}"}


def test_sqlite_store_and_resume_without_duplicates(
    tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")  # the default store, already migrated

    off = Tracker(enabled=False, experiment="x", spool_dir=tmp_path / "off")
    off.log_metrics({"loss": 1.0}, step=0)
    off.close()
    assert off.run_id is None and not (tmp_path / "off").exists()

    (tmp_path / "config.yaml").write_text("lr: 0.1\n")
    with Tracker(
        enabled=True, experiment="exp", run_name="first", tags={"stage": "pretrain"},
        spool_dir=tmp_path / "spool", system_metrics_interval=0.3,
    ) as first:  # fmt: skip
        run_id = first.run_id
        assert run_id is not None
        first.log_params({"optim": {"lr": 0.1, "betas": [0.9, 0.999]}, "arch": "vit_tiny"})
        for step in range(10):
            first.log_metrics({"loss": 10.0 - step, "lr": 0.1}, step=step)
        first.log_metrics({"loss": 99.0}, step=3)  # an old step in the same process: dropped
        # What a checkpoint waits for: every queued point in the store before the run ends.
        assert first.wait_sent()
        assert _steps(MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"), run_id, "loss") == list(
            range(10)
        )
        first.log_artifact(tmp_path / "config.yaml", artifact_path="config")
        first.set_tags({"note": "hello"})
        time.sleep(1.0)  # a few system-metric samples

    # Resume from a checkpoint at step 5: steps 5..9 are logged again, 10..14 are new.
    with Tracker(
        enabled=True, experiment="exp", run_id=run_id, spool_dir=tmp_path / "spool",
        system_metrics=False,
    ) as second:  # fmt: skip
        assert second.run_id == run_id
        second.log_params({"arch": "vit_small"})  # a changed value: MLflow refuses it
        for step in range(5, 15):
            second.log_metrics({"loss": 100.0 + step}, step=step)

    client = MlflowClient("sqlite:///mlflow.db")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.params == {"optim.lr": "0.1", "optim.betas": "[0.9, 0.999]", "arch": "vit_tiny"}
    assert run.data.tags["stage"] == "pretrain" and run.data.tags["note"] == "hello"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert _steps(client, run_id, "loss") == list(range(15))  # each step once
    assert history[3] == 7.0 and history[7] == 3.0 and history[12] == 112.0
    assert _steps(client, run_id, "lr") == list(range(10))
    assert [a.path for a in client.list_artifacts(run_id, "config")] == ["config/config.yaml"]
    assert any(k.startswith("system/") for k in run.data.metrics)
    exp = client.get_experiment_by_name("exp")
    assert len(client.search_runs([exp.experiment_id])) == 1  # resumed, not a new run
    rejected = (tmp_path / "spool" / "rejected.jsonl").read_text()
    assert "vit_small" in rejected  # kept and reported, not retried forever
    assert [p.name for p in (tmp_path / "spool").glob("*.jsonl")] == ["rejected.jsonl"]


@pytest.mark.slow
def test_server_outage_spools_and_recovers(
    tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")  # restored after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    db = tmp_path / "server.db"
    shutil.copy(mlflow_template, db)
    server = MlflowServer(tmp_path, db)
    spool = tmp_path / "spool"
    try:
        # 1. Server down at start: the constructor returns quickly without a run id.
        t0 = time.monotonic()
        tracker = Tracker(
            enabled=True, experiment="outage", run_name="r", tracking_uri=server.uri,
            spool_dir=spool, system_metrics=False, retry_interval=0.5,
        )  # fmt: skip
        assert time.monotonic() - t0 < 5 and tracker.run_id is None
        tracker.log_params({"a": {"b": 1}})
        for step in range(5):
            tracker.log_metrics({"loss": float(step)}, step=step)
        assert tracker.wait_sent()  # with the store down: every point in the spool on disk
        spooled = "".join(p.read_text() for p in spool.glob("*.jsonl"))
        assert all(f'"loss", {step}.0' in spooled for step in range(5)), spooled[-500:]

        # 2. The server comes up: the run is created and the spooled steps arrive.
        server.start()
        client = MlflowClient(server.uri)
        wait_until(lambda: tracker.run_id is not None, 20, "the run to be created")
        run_id = tracker.run_id
        wait_until(lambda: _steps(client, run_id, "loss") == list(range(5)), 20, "spooled steps")
        for step in range(5, 10):
            tracker.log_metrics({"loss": float(step)}, step=step)
        wait_until(lambda: _steps(client, run_id, "loss") == list(range(10)), 20, "live steps")

        # 3. Killed mid-run: logging neither raises nor blocks; the steps arrive after a restart.
        server.kill()
        t0 = time.monotonic()
        for step in range(10, 15):
            tracker.log_metrics({"loss": float(step)}, step=step)
        assert time.monotonic() - t0 < 0.5
        wait_until(lambda: any(spool.glob("*.jsonl")), 15, "events spooled, server down")
        server.start()
        wait_until(lambda: _steps(client, run_id, "loss") == list(range(15)), 30, "restarted")

        # 4. Down again until the end: close() is bounded, the spool keeps the rest, and the
        #    replay command pushes it (here straight into the server's backend store).
        server.kill()
        for step in range(15, 20):
            tracker.log_metrics({"loss": float(step)}, step=step)
        t0 = time.monotonic()
        tracker.close("FINISHED", timeout=10)
        assert time.monotonic() - t0 < 12
        assert len(list(spool.glob("*.jsonl"))) == 1
        assert main(["replay", str(spool), "--tracking-uri", f"sqlite:///{db}"]) == 0
        store = MlflowClient(f"sqlite:///{db}")
        assert _steps(store, run_id, "loss") == list(range(20))  # nothing lost, nothing twice
        run = store.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.params == {"a.b": "1"}
        assert not list(spool.glob("*.jsonl"))
        assert main(["replay", str(spool)]) == 0  # nothing left: a no-op
    finally:
        server.kill()


def _open_store_at_once(uri: str, barrier, results) -> None:
    """One of several processes opening one new SQLite store at the same moment."""
    import mlflow  # noqa: F401  (imported before the barrier: the opens line up)

    from ssl_vit.tracking.tracker import Store

    barrier.wait()
    try:
        store = Store(uri)
        exp = store.client.create_experiment(f"e-{os.getpid()}")
        store.client.create_run(exp)
        results.put("ok")
    except Exception as e:  # what a racing migration raises, sent back to the test
        results.put(f"{type(e).__name__}: {str(e)[:120]}")


def test_processes_creating_one_sqlite_store_at_once_all_get_it(tmp_path: Path) -> None:
    """Two jobs started together on a fresh machine create the default store at once: without
    the lock in store.open_client, 3 of 4 such processes failed here ("table ... already
    exists", "duplicate column name") and one migration was left half done."""
    ctx = multiprocessing.get_context("spawn")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_open_store_at_once, args=(uri, barrier, results))
             for _ in range(3)]  # fmt: skip
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["ok"] * 3
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments() if e.name != "Default"]
    assert len(client.search_runs(experiments)) == 3


def test_a_runs_metrics_file_and_its_other_points_both_replay(
    tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the store down for the whole run, the training rows come back from the run's
    metrics file and the points logged beside them (evaluations) from the record."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    db = tmp_path / "server.db"
    shutil.copy(mlflow_template, db)
    down = MlflowServer(tmp_path, db)  # never started: its port refuses connections
    spool, rows = tmp_path / "spool", tmp_path / "metrics.jsonl"
    tracker = Tracker(
        enabled=True, experiment="down", tracking_uri=down.uri, spool_dir=spool,
        metrics_file=rows, system_metrics=False, retry_interval=60,
    )  # fmt: skip
    for step in (10, 20):
        tracker.log_metrics({"train/loss": 1.0 / step}, step=step, in_file=True)
        rows.open("a").write(f'{{"step": {step}, "train/loss": {1.0 / step}}}\n')
    tracker.log_metrics({"eval/holdout_top1": 0.5}, step=20)  # not in the file
    tracker.close("FINISHED", timeout=5)
    assert main(["replay", str(spool), "--tracking-uri", f"sqlite:///{db}"]) == 0
    store = MlflowClient(f"sqlite:///{db}")
    (run,) = store.search_runs([store.get_experiment_by_name("down").experiment_id])
    assert _steps(store, run.info.run_id, "train/loss") == [10, 20]
    assert _steps(store, run.info.run_id, "eval/holdout_top1") == [20]


# One run directory, one MLflow run, whatever was down when. Each launch is driven as the
# trainer drives it: `open_run_tracker` (which reads RUN/mlflow_run_id and RUN/mlflow_run_key),
# a metrics.jsonl row and its point per logged step, an evaluation point that no metrics file
# holds, a tag, and the end. "Up" is a real SQLite store; "down" a port nothing listens on.


def _launch(run_dir: Path, uri: str, steps: list[int], launch: int, status: str = "FINISHED"):
    from ssl_vit.config import load_config, save_config
    from ssl_vit.engine.run_tracker import open_run_tracker

    cfg = load_config(None, ["train.steps=12", f"run.dir={run_dir}", f"tracking.uri={uri}",
                             "tracking.experiment=one-run"])  # fmt: skip
    run_dir.mkdir(exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "ds_config.json").write_text("{}\n")
    tracker = open_run_tracker(
        cfg, run_dir, rank=0, fresh=launch == 1, derived={"launch": launch}, source_run_id=None
    )
    for step in steps:
        row = {"train/loss": 1.0 / step}
        tracker.log_metrics(row, step=step, in_file=True)
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")
    tracker.log_metrics({"eval/top1": launch / 10}, step=steps[-1])
    tracker.set_tags({"launch": launch})
    tracker.close(status, timeout=5)
    return tracker.run_id


def _records(run_dir: Path) -> list[Path]:
    return [p for p in (run_dir / "mlflow_spool").glob("*.jsonl") if p.name != "rejected.jsonl"]


def _the_one_run(uri: str, run_dir: Path) -> Any:
    """The experiment's only run, which RUN/mlflow_run_id names and which holds every launch's
    params, points at their steps, and artifacts; no record is left to send."""
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("one-run").experiment_id])
    rid = run.info.run_id
    assert (run_dir / "mlflow_run_id").read_text().strip() == rid
    loss = {m.step: m.value for m in client.get_metric_history(rid, "train/loss")}
    assert loss == {s: 1.0 / s for s in (2, 4, 6, 8, 10, 12)}
    top1 = {m.step: m.value for m in client.get_metric_history(rid, "eval/top1")}
    assert top1 == {4: 0.1, 8: 0.2, 12: 0.3}
    assert run.data.params["train.steps"] == "12" and run.data.params["derived.launch"] == "1"
    assert "config.yaml" in [a.path for a in client.list_artifacts(rid)]
    assert run.data.tags["ssl_vit.run_key"] == (run_dir / "mlflow_run_key").read_text().strip()
    assert not _records(run_dir)
    return run


def test_launches_without_mlflow_join_the_run_of_the_next_launch(
    tmp_path: Path, mlflow_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Down, down, up: the third launch creates the run once and takes in both records."""
    monkeypatch.chdir(tmp_path)  # the store's artifacts
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down, up, run_dir = MlflowServer(tmp_path).uri, f"sqlite:///{mlflow_db}", tmp_path / "run"
    assert _launch(run_dir, down, [2, 4], 1) is None
    assert _launch(run_dir, down, [6, 8], 2) is None
    assert not (run_dir / "mlflow_run_id").exists() and len(_records(run_dir)) == 2
    rid = _launch(run_dir, up, [10, 12], 3)
    run = _the_one_run(up, run_dir)
    assert run.info.run_id == rid
    assert run.data.tags["launch"] == "3" and run.info.status == "FINISHED"


def test_a_launch_that_knew_the_run_but_not_the_store_syncs_into_it(
    tmp_path: Path, mlflow_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up, down, up: the second launch read RUN/mlflow_run_id; its record joins that run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down, up, run_dir = MlflowServer(tmp_path).uri, f"sqlite:///{mlflow_db}", tmp_path / "run"
    first = _launch(run_dir, up, [2, 4], 1)
    assert first is not None and (run_dir / "mlflow_run_id").read_text().strip() == first
    assert _launch(run_dir, down, [6, 8], 2) == first and len(_records(run_dir)) == 1
    assert _launch(run_dir, up, [10, 12], 3) == first
    run = _the_one_run(up, run_dir)
    assert run.data.tags["launch"] == "3" and run.info.status == "FINISHED"


def test_replayed_launches_make_one_run_in_order_that_the_next_launch_continues(
    tmp_path: Path, mlflow_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Down (failed), down, then `replay`: the two records become one run, replayed in the order
    the launches ran (the second's tag and status last), and the run's id reaches the run
    directory; the next launch, up, continues that run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down, up, run_dir = MlflowServer(tmp_path).uri, f"sqlite:///{mlflow_db}", tmp_path / "run"
    _launch(run_dir, down, [2, 4], 1, status="FAILED")
    (first,) = _records(run_dir)
    _launch(run_dir, down, [6, 8], 2)
    (second,) = set(_records(run_dir)) - {first}
    # Record names are random: make theirs sort against the order the launches ran in.
    first.rename(first.with_name("f" * 12 + ".jsonl"))
    second.rename(second.with_name("0" * 12 + ".jsonl"))
    assert main(["replay", str(run_dir / "mlflow_spool"), "--tracking-uri", up]) == 0
    client = MlflowClient(up)
    (run,) = client.search_runs([client.get_experiment_by_name("one-run").experiment_id])
    assert run.data.tags["launch"] == "2" and run.info.status == "FINISHED"
    assert (run_dir / "mlflow_run_id").read_text().strip() == run.info.run_id
    assert _steps(client, run.info.run_id, "train/loss") == [2, 4, 6, 8]
    assert _launch(run_dir, up, [10, 12], 3) == run.info.run_id
    _the_one_run(up, run_dir)


def test_a_lost_run_id_is_found_again_by_the_run_key(
    tmp_path: Path, mlflow_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RUN/mlflow_run_id gone (deleted, or never written: a replay elsewhere): the next launch
    finds the run by the key it was tagged with rather than starting a second one."""
    monkeypatch.chdir(tmp_path)
    up, run_dir = f"sqlite:///{mlflow_db}", tmp_path / "run"
    first = _launch(run_dir, up, [2, 4, 6, 8], 1)
    (run_dir / "mlflow_run_id").unlink()
    assert _launch(run_dir, up, [10, 12], 2) == first
    assert (run_dir / "mlflow_run_id").read_text().strip() == first
    client = MlflowClient(up)
    assert len(client.search_runs([client.get_experiment_by_name("one-run").experiment_id])) == 1


def test_a_launch_that_changed_the_config_with_the_store_down_reaches_the_run(
    tmp_path: Path, mlflow_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up, down with optim.lr lowered, up: the run keeps launch 1's params (MLflow's are
    immutable) and nothing is refused, but the change made while the store was down is on the
    run: launch 2's tag and file, synced by launch 3; params new at launch 2 are logged."""
    from ssl_vit.config import load_config
    from ssl_vit.engine import launches
    from ssl_vit.engine.run_tracker import open_run_tracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down, up, run_dir = MlflowServer(tmp_path).uri, f"sqlite:///{mlflow_db}", tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ds_config.json").write_text("{}\n")
    base = ["train.steps=12", f"run.dir={run_dir}", "tracking.experiment=one-run"]
    for n, uri, extra in (
        (1, up, ["optim.lr=2e-4"]),
        (2, down, ["optim.lr=1e-4", "train.deepspeed={wall_clock_breakdown: false}"]),
        (3, up, ["optim.lr=1e-4", "train.deepspeed={wall_clock_breakdown: false}"]),
    ):
        cfg = load_config(None, [*base, f"tracking.uri={uri}", *extra])
        this = launches.begin(run_dir, cfg, f"# launch {n}")
        tracker = open_run_tracker(
            cfg, run_dir, 0, True, {"world_size": 1}, None, this_launch=this, step=4 * (n - 1)
        )  # `fresh`: no launch had a checkpoint, so only the records say what was logged
        tracker.close(timeout=5)
        assert tracker.flushed == (uri == up)
    client = MlflowClient(up)
    (run,) = client.search_runs([client.get_experiment_by_name("one-run").experiment_id])
    params, tags = run.data.params, run.data.tags
    assert params["optim.lr"] == "0.0002"  # launch 1's, never overwritten or refused
    assert params["train.deepspeed.wall_clock_breakdown"] == "False"  # new at launch 2
    assert tags["ssl_vit.launch.2.changed"].startswith("optim.lr: 0.0002 -> 0.0001; "), tags
    assert "tracking.uri: sqlite:///" in tags["ssl_vit.launch.2.changed"]
    assert "optim.lr" not in tags["ssl_vit.launch.3.changed"]  # only the store came back
    assert "ssl_vit.launch.1.changed" not in tags and tags["ssl_vit.launches"] == "3"
    files = {a.path for a in client.list_artifacts(run.info.run_id, "launches")}
    assert files == {f"launches/launch-{n}.yaml" for n in (1, 2, 3)}
    got = client.download_artifacts(run.info.run_id, "launches/launch-2.yaml", str(tmp_path))
    record = yaml.safe_load(Path(got).read_text())
    assert record["launch"] == 2 and record["step"] == 4
    assert record["changed"]["optim.lr"] == {"old": 0.0002, "new": 0.0001}
    assert not (run_dir / "mlflow_spool" / "rejected.jsonl").exists()  # no param was refused
    assert not _records(run_dir)
