"""YAML configs with ``base:`` chains and ``key=value`` overrides (MaxText style) -> a validated ``Config``."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from megatrain_jax.config.schema import Config
from megatrain_jax.config.validate import validate
from megatrain_jax.errors import UserError


def _coerce(value: Any, typ: Any, name: str) -> Any:
    """Turn a YAML / command-line value into the dataclass field's type."""
    tname = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    optional = "None" in tname
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UserError(name, "must not be empty", f"give a value of type {tname}")
    base = tname.replace("| None", "").replace("None |", "").strip()
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if base == "int":
            if isinstance(value, bool):
                raise ValueError
            f = float(value)
            if f != int(f):
                raise ValueError
            return int(f)
        if base == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base == "str":
            return str(value)
    except (TypeError, ValueError):
        article = "an" if base[:1] in "aeiou" else "a"
        raise UserError(name, f"{value!r} is not a valid {base}", f"give {article} {base}") from None
    return value


def _fill(cls: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise UserError(prefix.rstrip("."), "must be a mapping", "write it as `key: value` lines")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = ", ".join(sorted(fields))
            raise UserError(name, "unknown config key", f"use one of: {close}")
        f = fields[key]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            kwargs[key] = _fill(f.default_factory, value or {}, name + ".")
        else:
            kwargs[key] = _coerce(value, f.type, name)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if node.get(k) is None:  # absent, or an optional section left empty (model.lora: null after a base:)
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            raise UserError(dotted, "is not a section", "override a leaf key such as train.steps=10")
    if raw == "":
        value = None
    else:
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw  # not YAML (e.g. "[1" or "a: b: c"): the literal text; _coerce checks its type
    node[keys[-1]] = value


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config, apply ``key=value`` overrides, validate, and return a ``Config``."""
    tree: dict[str, Any] = _read_tree(path, ()) if path is not None else {}
    for item in overrides:
        if "=" not in item:
            raise UserError(item, "override is not key=value", "write e.g. --set train.steps=10")
        key, raw = item.split("=", 1)
        if not all(k.strip() for k in key.split(".")):
            raise UserError(item, "override has an empty key", "write e.g. --set train.steps=10")
        _set_dotted(tree, key.strip(), raw.strip())
    cfg = _fill(Config, tree, "")
    validate(cfg)
    return cfg


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (``_DuplicateKey``)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: the constructor below reports it
                continue
            if dup:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_tree(path: str, chain: tuple[str, ...], named_by: str | None = None) -> dict[str, Any]:
    """One config file as a dict, its ``base:`` (a path relative to it) merged underneath; ``chain``:
    the files that led here, so that a cycle of ``base:`` is one error, not a RecursionError."""
    if not os.path.isfile(path):
        where = f" (named by base: in {named_by})" if named_by else ""
        problem = "is a directory" if os.path.isdir(path) else "does not exist"
        raise UserError("CONFIG", f"file {path!r}{where} {problem}",
                        "fix that base: line" if named_by else "pass a YAML file such as configs/tiny.yaml")
    real = os.path.realpath(path)
    if real in chain:
        raise UserError("CONFIG", f"base: in {named_by} names {path}, which is already in the chain of bases "
                        f"({' -> '.join(chain + (real,))})", "remove the cycle of base: files")
    try:
        with open(path) as f:
            tree = yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except _DuplicateKey as e:
        raise UserError("CONFIG", f"{path}:{e.line}: key {e.key!r} appears twice in one section (YAML would keep "
                        "the last silently)", "keep one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = getattr(e, "problem", None) or e.__class__.__name__
        raise UserError("CONFIG", f"{where}: not valid YAML ({what})", "fix the YAML syntax there") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError("CONFIG", f"{path} cannot be read ({e.__class__.__name__})", "pass a readable YAML text file") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise UserError("CONFIG", f"{path} holds a YAML {type(tree).__name__} at the top level, not a mapping",
                        "write it as sections of `key: value` lines (model:, optim:, data:, train:)")
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str) or not base.strip():
        raise UserError("base", f"in {path} must be one file name, got {base!r}",
                        "write e.g. `base: tiny.yaml` (one YAML file, relative to this one)")
    parent = os.path.join(os.path.dirname(path), base)
    merged = _fill(Config, _read_tree(parent, chain + (real,), path), "")
    validate(merged)
    out = merged.to_dict()
    _deep_update(out, tree)
    return out


def _deep_update(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v
