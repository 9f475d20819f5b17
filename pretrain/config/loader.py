"""Strict YAML <-> dataclass conversion with dotted CLI overrides.

Every config is a ``@dataclass(kw_only=True)`` tree. Loading checks each key against
the dataclass fields and each value against the field's annotated type; any mistake is
a ``ValueError`` naming the full dotted path (``optim.lr``) and what was found.

YAML files may start with ``include: [other.yaml, ...]`` (paths relative to the file);
included files are merged first, in order, and the including file wins.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")

INCLUDE_KEY = "include"
BOUNDS_KEY = "bounds"
"""Size presets only: ``bounds: {at_most: {dotted.key: N}, at_least: {...}}`` are the run settings ``model=NAME`` on
the command line brings within the preset's scale (see ``apply_bounds``); a file that includes the preset gets its
model keys only."""
INTERNAL = "internal"
"""Field metadata flag: filled by the loader, not a config key (never read from YAML, never written)."""


def read_yaml(path: str | os.PathLike) -> dict:
    """Read a YAML mapping, resolving ``include:`` lists recursively."""
    return _read_yaml(Path(path), seen=())


def _read_yaml(path: Path, seen: tuple, keep_bounds: bool = False) -> dict:
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist; pass the path to a YAML file under configs/")
    if path in seen:
        raise ValueError(f"config include cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at top level, got {type(data).__name__}")
    includes = data.pop(INCLUDE_KEY, None) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        merged = deep_merge(merged, _read_yaml(path.parent / inc, seen + (path,)))
    if not keep_bounds:
        data.pop(BOUNDS_KEY, None)  # a size preset's bounds act through model=NAME only
    return deep_merge(merged, data)


def deep_merge(base: dict, top: dict) -> dict:
    """Return base updated by top; nested mappings merge, everything else is replaced."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict. A mapping value merges into the
    mapping there (``train={micro_batch_size: 64}`` sets that key only, as the same mapping in a file does);
    ``a.b=null`` first makes it start from the defaults."""
    out = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value (e.g. optim.lr=3e-4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r} has an empty key part")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        here = node.get(parts[-1])
        node[parts[-1]] = deep_merge(here, value) if isinstance(value, dict) and isinstance(here, dict) else value
    return out


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from a plain mapping, strictly."""
    where = path or "<root>"
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config {where}: expected a mapping for {cls.__name__}, got {type(data).__name__} {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.metadata.get(INTERNAL)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        def dotted(k: str) -> str:
            return f"{path}.{k}" if path else k

        full = [dotted(k) for k in unknown]
        close = {k: difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6) for k in unknown}
        guesses = "; ".join(f"{dotted(k)}: did you mean {dotted(m[0])}?" for k, m in close.items() if m)
        raise ValueError(
            f"unknown config key(s) {', '.join(full)}{f' ({guesses})' if guesses else ''}; "
            f"valid keys under {where}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        kwargs[name] = _convert(hints[name], value, sub)
    try:
        return cls(**kwargs)
    except TypeError as e:  # missing required field
        raise ValueError(f"config {where}: {e}") from None


def _convert(tp: Any, value: Any, path: str) -> Any:
    """``value`` read from YAML as the field type ``tp`` (ValueError naming the dotted ``path`` when it is not)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path)
    if origin is typing.Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ValueError(f"config {path}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        return _convert_sequence(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"config {path}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(kt, k, f"{path}.{k}"): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    return _convert_scalar(tp, value, path)


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # Optional[X]: X's own error (with its dotted path) is the useful one
        return _convert(options[0], value, path)
    errors = []
    for arg in options:
        try:
            return _convert(arg, value, path)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(f"config {path}: {value!r} does not match {_type_name(tp)} ({'; '.join(errors)})")


def _convert_sequence(tp: Any, value: Any, path: str) -> list | tuple:
    origin = get_origin(tp)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"config {path}: expected a list ({_type_name(tp)}), got {type(value).__name__} {value!r}")
    args = get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ValueError(f"config {path}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    item_t = args[0] if args else Any
    items = [_convert(item_t, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"config {path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"config {path}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"config {path}: expected a number, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        hint = f"; to leave it unset, give an empty string: {path}=''" if value is None else ""
        raise ValueError(f"config {path}: expected a string, got {type(value).__name__} {value!r}{hint}")
    raise ValueError(f"config {path}: unsupported field type {tp!r}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain dict/list/scalars (YAML-serialisable)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if not f.metadata.get(INTERNAL)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


SIZE_PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
"""``model=NAME`` on the command line merges ``configs/models/NAME.yaml`` (tiny, mini, small, base, large)."""


def size_presets() -> list[str]:
    return sorted(p.stem for p in SIZE_PRESETS_DIR.glob("*.yaml"))


def _preset_path(name: str) -> Path:
    path = SIZE_PRESETS_DIR / f"{name}.yaml"
    if not name.replace("-", "").replace("_", "").isalnum() or not path.is_file():
        raise ValueError(f"model={name}: no such size preset; choose one of {', '.join(size_presets()) or '(none found)'}"
                         f" (files in {SIZE_PRESETS_DIR}), or set model.* keys one by one")
    return path


def load(cls: type[T], path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + overrides -> validated ``cls`` instance.

    Overrides apply left to right: ``a.b=value`` sets one key; ``include=FILE[,FILE...]`` merges YAML files over
    what is there so far (paths relative to the working directory); ``model=NAME`` merges the size preset
    ``configs/models/NAME.yaml`` (the recipe's other model keys — pooling, dropout, ... — stay) and, after every
    override, brings the run settings its ``bounds:`` name within them unless the command line sets them
    (``model=tiny``: lengths, warm-up, batch, evaluation and checkpoint intervals of a base-size recipe; see
    configs/models/tiny.yaml).

    A config class with an internal ``given`` field (RunConfig) gets the dotted keys the files and overrides
    set, so that defaults can be told from choices (``checkpoint.init_from`` fills only the defaults)."""
    data = read_yaml(path) if path is not None else {}
    bounds: dict = {}
    typed: set[str] = set()
    for item in overrides or []:
        key, _, raw = item.partition("=")
        key = key.strip()
        if key == INCLUDE_KEY:
            files = yaml.safe_load(raw) if raw.strip().startswith("[") else raw.split(",")
            for inc in files or []:
                data = deep_merge(data, read_yaml(str(inc).strip()))
        elif key == "model" and raw.strip() and not raw.strip().startswith("{"):
            preset = _read_yaml(_preset_path(raw.strip()), seen=(), keep_bounds=True)
            bounds = preset.pop(BOUNDS_KEY, None) or {}
            data = deep_merge(data, preset)
        else:
            data = apply_overrides(data, [item])
            typed |= _typed_keys(key, raw)
    cfg = from_dict(cls, data)
    bounded: frozenset[str] = frozenset()
    if bounds:
        cfg, bounded = apply_bounds(cls, cfg, bounds, keep=typed)
    if any(f.name == "given" and f.metadata.get(INTERNAL) for f in dataclasses.fields(cls)):
        cfg = dataclasses.replace(cfg, given=given_keys(data) | bounded)
    return cfg


def apply_bounds(cls: type[T], cfg: T, bounds: dict, keep=frozenset()) -> tuple[T, frozenset[str]]:
    """``cfg`` with each ``at_most`` key lowered to its bound and each ``at_least`` key raised to its bound, and the
    dotted keys that changed. Keys in ``keep`` (typed on the command line) and under a section that is off
    (``objective.triplet: null``) are left alone; ``at_least`` leaves 0 alone (0 means "off" for the every-N
    settings it is for)."""
    unknown = set(bounds) - {"at_most", "at_least"}
    if unknown:
        raise ValueError(f"size preset bounds: unknown key(s) {', '.join(sorted(unknown))}; use at_most / at_least")
    tree = to_dict(cfg)
    changed = set()
    for kind, table in bounds.items():
        for dotted, bound in (table or {}).items():
            *parents, leaf = dotted.split(".")
            node = tree
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                continue  # the section is off in this config
            if leaf not in node:
                raise ValueError(f"size preset bounds: {dotted} is not a config key")
            value = node[leaf]
            if dotted in keep or any(dotted.startswith(k + ".") for k in keep):
                continue
            if kind == "at_most" and value > bound or kind == "at_least" and 0 < value < bound:
                node[leaf] = bound
                changed.add(dotted)
    return (from_dict(cls, tree) if changed else cfg), frozenset(changed)


def _typed_keys(key: str, raw: str) -> frozenset[str]:
    """The dotted keys the override ``key=raw`` sets: ``key`` itself, or the leaves of a mapping value."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = None
    return given_keys(value, key + ".") if isinstance(value, dict) and value else frozenset({key})


def given_keys(data: dict, prefix: str = "") -> frozenset[str]:
    """The dotted keys a config mapping sets (its leaves: "model.hidden_size", "data.sources", ...)."""
    keys: set[str] = set()
    for k, v in data.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            keys |= given_keys(v, path + ".")
        else:
            keys.add(path)
    return frozenset(keys)
