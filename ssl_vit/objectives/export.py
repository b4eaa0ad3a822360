"""Save and restore an objective's own weights (MPP [mask] token and head, classifier head).

The trainer exports the backbone through `ssl_vit.models.export_backbone` and, beside it, the
rest of the objective: `objective.safetensors` (every tensor not under `backbone.` nor a
normalisation buffer) and `objective.json` (the `build_objective` kind and options). Tools that
need the pretraining head, such as the MPP-predictions plot, rebuild it with `load_objective`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save
from torch import nn

from ssl_vit.io import atomic_write_bytes, atomic_write_text

WEIGHTS = "objective.safetensors"
META = "objective.json"
_SKIP = ("mean", "std")  # rebuilt from backbone.json, not learned

_RENAMED = {"sup_weight": "supervised_weight"}  # exports written before the rename


def _own_tensors(objective: nn.Module) -> dict:
    return {
        k: v.detach().to("cpu").contiguous()
        for k, v in objective.state_dict().items()
        if ".backbone." not in f".{k}" and k.rsplit(".", 1)[-1] not in _SKIP
    }


def save_objective(
    objective: nn.Module, out_dir: str | os.PathLike, kind: str, options: dict
) -> None:
    """Write out_dir/objective.safetensors, then out_dir/objective.json (atomically, in order)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / WEIGHTS, save(_own_tensors(objective)))
    atomic_write_text(out / META, json.dumps({"kind": kind, "options": options}, indent=2) + "\n")


def load_objective(
    path: str | os.PathLike, backbone: nn.Module, mean: list[float], std: list[float]
) -> nn.Module | None:
    """The objective exported beside a backbone (export folder or run directory), on `backbone`.

    Returns None when the export has no objective (e.g. written by `export_backbone` alone).
    """
    from ssl_vit.objectives import build_objective

    path = Path(path)
    folder = next((p for p in (path, path / "export") if (p / META).is_file()), None)
    if folder is None:
        return None
    meta: dict[str, Any] = json.loads((folder / META).read_text(encoding="utf-8"))
    options = {_RENAMED.get(k, k): v for k, v in meta["options"].items()}
    objective = build_objective(meta["kind"], backbone, mean=mean, std=std, **options)
    missing, unexpected = objective.load_state_dict(load_file(str(folder / WEIGHTS)), strict=False)
    missing = [
        k for k in missing if ".backbone." not in f".{k}" and k.rsplit(".", 1)[-1] not in _SKIP
    ]
    if missing or unexpected:
        raise ValueError(
            f"{folder / WEIGHTS}: does not match the {meta['kind']} objective "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); re-export it"
        )
    return objective
