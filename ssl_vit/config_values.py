"""Nested dataclasses filled from YAML mappings and `key=value` overrides, every value checked
against its field's type hint; a bad key or value raises a one-line `ConfigError` naming it.
The schema itself is ssl_vit.config."""

from __future__ import annotations

import dataclasses
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what to do."""


def plain(obj: Any) -> Any:
    """Tuples as lists, all the way down (what YAML writes and reads back)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a field's type hint (`int | None`, `tuple[float, float]`, ...)."""
    if get_origin(hint) in (Union, UnionType):
        if value is None and type(None) in get_args(hint):
            return None
        hint = next(a for a in get_args(hint) if a is not type(None))
    if value is None:
        raise ConfigError(f"config key {key!r}: null is not allowed here; give a value")
    origin = get_origin(hint) or hint
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        dict: lambda v: isinstance(v, dict),
        tuple: lambda v: isinstance(v, (list, tuple)) and len(v) == len(get_args(hint)),
        list: lambda v: isinstance(v, (list, tuple)) and all(ok[get_args(hint)[0]](x) for x in v),
    }
    if hint is Any:
        return value
    if origin is float and isinstance(value, str):  # YAML 1.1 reads "2e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if not ok[origin](value) or (origin is tuple and not all(ok[float](v) for v in value)):
        want = getattr(hint, "__name__", str(hint))
        if origin is list:
            want = f"list of {get_args(hint)[0].__name__} (e.g. [1, 2, 4])"
        raise ConfigError(f"config key {key!r}: {value!r} is not a valid {want}")
    if origin is float:
        return float(value)
    if origin is tuple:
        return tuple(float(v) for v in value)
    if origin is list:
        return list(value)
    return value


def apply_mapping(section: Any, values: dict[str, Any], prefix: str = "") -> None:
    """Set `values` (nested like the dataclasses under `section`) on them, each type-checked."""
    hints = get_type_hints(type(section))
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(f"{prefix}{k}" for k in hints)
            raise ConfigError(f"unknown config key {full!r}; known keys here: {known}")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {full!r} is a section; give a mapping")
            apply_mapping(current, value, f"{full}.")
        else:
            setattr(section, key, _coerce(value, hints[key], full))


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ["optim.lr=1e-3", "model.kwargs={depth: 6}"] into a nested dict (values are YAML)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=200)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        node = nested
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return nested


def yaml_problem(e: yaml.YAMLError) -> str:
    """One line from PyYAML's multi-line message: where and what."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark, context = getattr(e, "problem_mark", None), getattr(e, "context", None)
    if mark is None:
        return problem
    where = getattr(e, "context_mark", None)
    if context and where is not None and where.line != mark.line:
        problem += f" ({context} from line {where.line + 1})"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
