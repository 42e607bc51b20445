"""Typed settings: every dataclass of settings (recipe sections, drafter configs, eval options) is built
here, from YAML values, `key=value` overrides or command-line flags alike.

Each value is checked and coerced against its field's annotation when it is parsed, before any work is
done: `train.lr=1e-4` (a string to YAML) becomes a float, `train.lr=abc` is an error that names the key,
the type it wants and the value it got.  Unknown keys are errors that list the valid ones.  Range checks
stay in each dataclass's `__post_init__`.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
import types
import typing


class ConfigError(ValueError):
    """A setting whose value or key is not valid."""


def config_from_dict(config_cls, values: dict, where: str):
    """Build `config_cls` from `values`, coercing each to its field's type; unknown keys are errors."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {list(fields)}")
    hints = typing.get_type_hints(config_cls)
    coerced = {name: coerce(value, hints[name], f"{where}: '{name}'") for name, value in values.items()}
    try:
        return config_cls(**coerced)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None


def coerce(value, annotation, where: str):
    """`value` as `annotation` (str, int, float, bool, X | None, list[X], tuple[X, ...], tuple[X, Y], dict)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return coerce(value, option, where)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else ConfigError(
            f"{where} must be {' or '.join(_name(o) for o in args)}, got {value!r}")
    if value is None:
        raise ConfigError(f"{where} must be {_name(annotation)}, got null")
    if origin in (list, tuple):
        return _sequence(value, origin, args, where)
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if annotation in (int, float):
        return _number(value, annotation, where)
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        hint = (" (YAML reads an unquoted no, yes, on or off as true/false: quote it, as in 'no')"
                if isinstance(value, bool) else "")
        raise ConfigError(f"{where} must be a string, got {value!r}{hint}")
    return value


def _sequence(value, origin, args, where: str):
    """list[X], tuple[X, ...] or tuple[X, Y]; a comma-separated string is a list (command-line flags)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}: {value!r}")
        return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    item = args[0] if args else typing.Any
    items = [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _number(value, kind, where: str):
    """An int (whole floats allowed) or a float; numeric strings (YAML reads 1e-4 as one) are parsed."""
    if isinstance(value, str):
        try:
            value = kind(value.strip())
        except ValueError:
            pass
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}; no setting takes nan or infinity "
                              "(null where a setting means 'no limit')")
        if kind is float:
            return float(value)
        if isinstance(value, int) or value.is_integer():
            return int(value)
    raise ConfigError(f"{where} must be {_name(kind)}, got {value!r}")


def _name(annotation) -> str:
    if annotation is type(None):
        return "null"
    return {str: "a string", int: "a whole number", float: "a number", bool: "true or false",
            dict: "a mapping"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def field_help(cls) -> dict[str, str]:
    """Each dataclass field's help: the string written under it in the class body (its bases' too)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError):
            continue
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs

