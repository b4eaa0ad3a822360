"""Parent runs as a general feature, against a real SQLite store: a Tracker tagged with a parent
(what `tracking.parent_run_id` sets) and an eval given `--parent-run-id` are created in the
parent's experiment as its children; the eval keeps its lineage tag to the pretraining run."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from ssl_vit.evaluation.cli import add_common_args
from ssl_vit.evaluation.report import log_to_mlflow
from ssl_vit.tracking import PARENT_TAG, Tracker


def test_children_nest_under_an_explicit_parent(mlflow_db, tmp_path):
    uri = f"sqlite:///{mlflow_db}"
    client = MlflowClient(uri)
    parent_exp = client.create_experiment("group")
    parent = client.create_run(parent_exp).info.run_id
    with Tracker(
        enabled=True,
        experiment="train",
        tracking_uri=uri,
        tags={PARENT_TAG: parent},
        spool_dir=tmp_path / "spool",
        system_metrics=False,
    ) as train:
        train.log_metrics({"loss": 1.0}, step=1)
    child = client.get_run(train.run_id)
    assert child.data.tags[PARENT_TAG] == parent and child.info.experiment_id == parent_exp

    nested = log_to_mlflow(
        "knn", {"top1": 0.5}, {}, parent_run_id=train.run_id, tracking_uri=uri, nest_under=parent
    )
    default = log_to_mlflow("knn", {"top1": 0.5}, {}, parent_run_id=train.run_id, tracking_uri=uri)
    ev, ev_default = client.get_run(nested), client.get_run(default)
    assert ev.data.tags[PARENT_TAG] == parent and ev.info.experiment_id == parent_exp
    assert ev.data.tags["pretrain_run_id"] == train.run_id  # lineage kept
    assert ev_default.data.tags[PARENT_TAG] == train.run_id  # default: under the pretraining run
    assert not list((tmp_path / "spool").glob("*.jsonl"))  # everything reached the store

    gone = "0" * 32  # a parent not in this store: the run is made, not nested
    with Tracker(
        enabled=True,
        experiment="train",
        tracking_uri=uri,
        tags={PARENT_TAG: gone},
        spool_dir=tmp_path / "spool",
        system_metrics=False,
    ) as orphan:
        pass
    assert PARENT_TAG not in client.get_run(orphan.run_id).data.tags


def test_eval_parser_takes_a_parent_run_id(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    add_common_args(p)
    args = p.parse_args(["--backbone", str(tmp_path), "--data", "d", "--parent-run-id", "abc"])
    assert args.parent_run_id == "abc"
    assert p.parse_args(["--backbone", str(tmp_path), "--data", "d"]).parent_run_id is None
