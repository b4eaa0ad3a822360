"""Nested dataclasses filled from YAML mappings and `key=value` overrides, every value checked
against its field's type hint; a bad key or value raises a one-line `ConfigError` naming it.
The schema itself is ssl_vit.config."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
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


def numeric_type(hint: Any) -> tuple[type, bool] | None:
    """(int or float, whether the value is a tuple or list of them) for a numeric field's type
    hint: `int | None`, `tuple[float, float]`, `list[int]`; None for any other (bool, str,
    dict, Any)."""
    if get_origin(hint) in (Union, UnionType):
        hint = next((a for a in get_args(hint) if a is not type(None)), None)
    many = get_origin(hint) in (tuple, list)
    if many:
        hint = get_args(hint)[0]
    return (hint, many) if hint in (int, float) else None


_BOUND = re.compile(r"^(>=|>) *(\S+)$")
_INTERVAL = re.compile(r"^([\[(]) *([^,]+), *([^\])]+)([\])])$")


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take, written as in maths: a bound, ">= 1" or "> 0", or an
    interval, "[0, 1)" or "(0, 1]"; `hint`, if any, says more in the error. NaN and the
    infinities are in no range: every bound here is finite, and a value past it is a typo."""

    text: str
    lo: float
    hi: float
    lo_closed: bool
    hi_closed: bool
    hint: str = ""

    @classmethod
    def parse(cls, spec: str) -> Range:
        """`spec` is "RANGE" or "RANGE; HINT", e.g. "(0, 1]; e.g. 0.1"."""
        text, _, hint = (part.strip() for part in spec.partition(";"))
        if m := _BOUND.match(text):
            return cls(f"{m[1]} {m[2]}", float(m[2]), math.inf, m[1] == ">=", False, hint)
        if m := _INTERVAL.match(text):
            lo, hi = float(m[2]), float(m[3])
            return cls(f"in {text}", lo, hi, m[1] == "[", m[4] == "]", hint)
        raise ValueError(f"range {spec!r}: write '>= a', '> a', '[a, b]', '(a, b)' or a mix")

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):  # (an int is finite; a huge
            return False  # one would overflow math.isfinite)
        above = value >= self.lo if self.lo_closed else value > self.lo
        below = value <= self.hi if self.hi_closed else value < self.hi
        return above and below


def check_range(key: str, value: Any, hint: Any, allowed: Range) -> None:
    """Raise a one-line ConfigError unless `value`, of a field whose type hint is `hint`, is a
    number of that type within `allowed` (each element of a tuple or list); None passes where
    the hint allows it (the key's "not set")."""
    numeric = numeric_type(hint)
    if numeric is None:
        raise TypeError(f"{key}: a range is declared for a field that holds no numbers")
    kind, many = numeric
    if value is None and type(None) in get_args(hint):
        return

    def ok(v: Any) -> bool:
        # bool is an int to Python, and True would pass as 1: a typo, not a count
        is_kind = isinstance(v, int if kind is int else (int, float)) and not isinstance(v, bool)
        return is_kind and v in allowed

    if many and isinstance(value, (tuple, list)) and all(ok(v) for v in value):
        return
    if not many and ok(value):
        return
    what = "an integer" if kind is int else "a number"
    hint_text = f" ({allowed.hint})" if allowed.hint else ""
    each = "each must be" if many else "must be"
    shown = list(value) if isinstance(value, tuple) else value  # as YAML writes it: [a, b]
    raise ConfigError(f"{key}={shown!r}: {each} {what} {allowed.text}{hint_text}")


def check_flow_keys(value: Any, key: str) -> None:
    """Refuse the YAML flow-map trap in `value` (mappings at any depth, also inside lists):
    `{depth:2}` lacks the space after the colon, so YAML reads one key "depth:2" with no value,
    and a consumer that drops null keyword arguments (timm does) would silently train with its
    defaults. A key holding ':' whose value is null is taken for that typo."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:
                name, _, given = k.partition(":")
                raise ConfigError(
                    f"config key {key!r}: {k!r} reads as a key with no value; put a space after "
                    f"the colon: {{{name.strip()}: {given.strip()}}}"
                )
            check_flow_keys(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_flow_keys(v, key)


def apply_mapping(section: Any, values: dict[str, Any], prefix: str = "") -> None:
    """Set `values` (nested like the dataclasses under `section`) on them, each type-checked."""
    hints = get_type_hints(type(section))
    for key, value in values.items():
        full = f"{prefix}{key}"
        check_flow_keys(value, full)
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
