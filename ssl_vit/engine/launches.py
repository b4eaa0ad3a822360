"""Every launch of a run directory on record, with what it changed since the launch before.

A run directory is one training run, launched again after each interruption, and a later launch
may change keys (`train.steps`, `optim.lr`...) that MLflow's params, never changed once logged,
would keep describing wrongly. `begin` (rank 0) writes RUN/launches/launch-<n>.yaml (number,
time, command, what changed as `key: {old, new}`, the whole config) and RUN/config.yaml;
`Launch.finish` adds the derived values and the starting step. ssl_vit.engine.run_tracker gives
the MLflow run those files as artifacts, the tags `ssl_vit.launch.<n>.changed` and
`ssl_vit.launches`, and the params no earlier launch logged (`Launch.logged_params`).

What a launch records and sends: docs/tracking.md#a-launch-that-changes-the-config.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ssl_vit.config import Config, save_config
from ssl_vit.io import atomic_write_text
from ssl_vit.tracking import MAX_PARAM_LEN

log = logging.getLogger("ssl_vit.train")
FOLDER = "launches"
TAG = "ssl_vit.launch.{n}.changed"
COUNT_TAG = "ssl_vit.launches"
TAG_CHARS = 500  # of the changes tag: the whole list is in the launch's file
VALUE_CHARS = 80  # of one value in the tag and the log line (a train.deepspeed mapping...)
UNSET = "(unset)"  # a key one side of a change does not have
_NAME = re.compile(r"launch-(\d+)\.yaml")


def leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": {}} -> {"a.b": 1, "c": {}}: the keys `Tracker.log_params` makes of
    a config, with their values as they are."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{key: {"old": a, "new": b}} for each flattened key whose param would differ; a key one
    side lacks is UNSET there."""
    a, b = leaves(old), leaves(new)
    out = {}
    for key in [*b, *(k for k in a if k not in b)]:
        before, after = a.get(key, UNSET), b.get(key, UNSET)
        # compared as the run's params hold them (ssl_vit.tracking.flatten)
        if (
            key not in a
            or key not in b
            or str(before)[:MAX_PARAM_LEN] != str(after)[:MAX_PARAM_LEN]
        ):
            out[key] = {"old": before, "new": after}
    return out


def describe(changed: Mapping[str, Mapping[str, Any]], more_in: str, limit: int = TAG_CHARS) -> str:
    """ "optim.lr: 0.002 -> 0.001; train.steps: 8 -> 12", cut after a whole change to at most
    about `limit` characters, saying how many more there are in `more_in`."""

    def short(v: Any) -> str:
        text = str(v)
        return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."

    parts = [f"{k}: {short(c['old'])} -> {short(c['new'])}" for k, c in changed.items()]
    kept: list[str] = []
    for i, part in enumerate(parts):
        tail = f" (+{len(parts) - i - 1} more in {more_in})" if i + 1 < len(parts) else ""
        if len("; ".join([*kept, part]) + tail) > limit:
            break
        kept.append(part)
    if len(kept) == len(parts):
        return "; ".join(kept)
    return "; ".join(kept) + f"{' ' if kept else ''}(+{len(parts) - len(kept)} more in {more_in})"


def _read(path: Path) -> dict[str, Any]:
    try:
        body = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:  # a record cut by a crash: the launch still runs
        log.warning("%s: unreadable (%s); its launch is left out of the comparison", path, e)
        return {}
    return body if isinstance(body, dict) else {}


def _write(path: Path, record: dict[str, Any]) -> None:
    atomic_write_text(path, yaml.safe_dump(record, sort_keys=False))


@dataclass
class Launch:
    """This launch of a run directory (rank 0): made by `begin`, completed by `finish`."""

    run_dir: Path
    number: int
    path: Path  # RUN/launches/launch-<n>.yaml
    record: dict[str, Any]
    earlier: list[dict[str, Any]] = field(default_factory=list)  # oldest first

    @property
    def changed(self) -> dict[str, dict[str, Any]]:
        return self.record["changed"]

    def logged_params(self, fresh: bool, derived: Mapping[str, Any]) -> set[str] | None:
        """The param keys an earlier launch logged to the MLflow run; None when none did (this
        launch logs them all). A run directory from before these records logged its params at
        its first launch, whose checkpoint a `fresh` launch would not have been without; its
        `derived` keys, not on record, are taken to be this launch's."""
        done = [r for r in self.earlier if r.get("mlflow_params")]
        if not done and not fresh:
            done = self.earlier
        if not done:
            return None
        return {
            key
            for r in done
            for key in leaves({**r.get("config", {}), "derived": r.get("derived", derived)})
        }

    def finish(self, derived: dict[str, Any], step: int) -> None:
        """What the launch resolved after its config (`derived`: compared with the last launch
        that recorded it) and the step it starts at; called once its params are with the
        tracker (`mlflow_params`: every key of this launch is logged, now or before)."""
        before = next((r["derived"] for r in reversed(self.earlier) if "derived" in r), None)
        if before is not None:
            self.changed.update(changes({"derived": before}, {"derived": derived}))
        config = self.record.pop("config")  # kept last in the file: the long part
        self.record.update(step=step, mlflow_params=True, derived=dict(derived), config=config)
        _write(self.path, self.record)

    @property
    def artifact(self) -> str:
        return f"{FOLDER}/{self.path.name}"

    def summary(self) -> str:
        """The log line of a launch after the first."""
        at = f"launch {self.number} of {self.run_dir} (from step {self.record.get('step', 0)})"
        if not self.changed:
            return f"{at}: config as at launch {self.number - 1}"
        return (
            f"{at} changes {describe(self.changed, self.artifact, limit=1000)}; MLflow params "
            f"keep their first values, the changes are in tag {TAG.format(n=self.number)} and "
            f"artifact {self.artifact}"
        )


def begin(run_dir: Path, cfg: Config, header: str = "") -> Launch:
    """Number this launch, record what its config changed since the launch before, and write
    RUN/config.yaml for it (rank 0; before any training state exists)."""
    folder, saved = run_dir / FOLDER, run_dir / "config.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted((int(m[1]), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name)))
    previous = (_read(saved) or None) if saved.is_file() else None
    if previous is not None and not found:  # a run directory from before launch records
        first = folder / "launch-1.yaml"
        _write(first, {"launch": 1, "time": None, "changed": {}, "config": previous})
        found = [(1, first)]
    number = found[-1][0] + 1 if found else 1
    now = cfg.to_dict()
    record = {
        "launch": number,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": header.removeprefix("# "),
        "changed": changes(previous, now) if previous is not None else {},
        "config": now,
    }
    path = folder / f"launch-{number}.yaml"
    _write(path, record)
    save_config(cfg, saved, header)
    return Launch(run_dir, number, path, record, [_read(p) for _, p in found])
