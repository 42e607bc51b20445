"""Which drafters exist: each drafter file registers its own class, and everything else asks here.

    @register("eagle3")
    class Eagle3(DrafterBase): ...

A drafter class declares what the rest of draftsmith needs to know about its kind (heads/contract.py):
its config, its parameter layout, its export formats (heads/formats.py: renaming rules, writer,
serving command, reader), its card title and its contract flags.  train/, eval/, export/ and the
CLI read those declarations; none of them names a kind.  The drafters shipped with draftsmith are the
modules of this package that register a class, found the first time the registry is asked; a
drafter defined anywhere else (a plugin, a test) registers itself the same way when it is imported.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil

_KINDS: dict[str, type] = {}
_FOUND = False


def register(kind: str):
    """Class decorator: make `cls` the drafter of `kind` (recipes' `method`, checkpoints' `kind`)."""

    def add(cls: type) -> type:
        held = _KINDS.get(kind)
        if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"drafter kind '{kind}' is registered twice: {held.__module__}.{held.__qualname__} "
                             f"and {cls.__module__}.{cls.__qualname__}; give one of them another kind")
        cls.kind = kind
        _KINDS[kind] = cls
        return cls

    return add


def unregister(kind: str) -> None:
    """Forget a registered kind (a test's toy drafter, after the test)."""
    _KINDS.pop(kind, None)


def _find_builtin() -> None:
    """Import every module of draftsmith.heads once: the drafter files among them register themselves."""
    global _FOUND
    if _FOUND:
        return
    _FOUND = True
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if not info.ispkg:
            importlib.import_module(f"{__package__}.{info.name}")


def registry() -> dict[str, type]:
    """kind -> drafter class, for every registered drafter."""
    _find_builtin()
    return dict(_KINDS)


def saved_kind(cls: type) -> str:
    """The kind a checkpoint of `cls` records (`checkpoint_kind`; Medusa-2's heads are saved as Medusa)."""
    value = inspect.getattr_static(cls, "checkpoint_kind", None)
    return value if isinstance(value, str) else cls.kind


def drafter_class(kind: str, where: str = "") -> type:
    """The class of `kind`, or an error naming the known kinds."""
    kinds = registry()
    if kind not in kinds:
        raise ValueError(f"{where + ': ' if where else ''}unknown drafter kind '{kind}'; known: "
                         f"{', '.join(sorted(kinds))}")
    return kinds[kind]


def trained_class(config: dict) -> type:
    """The class that trained a checkpoint (config.json): the registered class saved under its kind whose
    `checkpoint_marker` key the config holds (Medusa-2 records its settings under 'medusa2'), else the
    kind's own class."""
    cls = drafter_class(config["kind"], "checkpoint")
    for other in registry().values():
        marker = getattr(other, "checkpoint_marker", None)
        if other is not cls and saved_kind(other) == config["kind"] and marker and marker in config:
            return other
    return cls
