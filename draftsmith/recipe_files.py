"""Where a recipe named on the command line is: a YAML file, or one shipped with draftsmith."""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def resolve_recipe(name: str) -> Path:
    """A recipe path, or the name of a recipe shipped with draftsmith (e.g. medusa-smollm2-135m)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = resources.files("draftsmith.recipes").joinpath(f"{name.removesuffix('.yaml')}.yaml")
    if shipped.is_file():
        return Path(str(shipped))
    available = sorted(p.name.removesuffix(".yaml") for p in resources.files("draftsmith.recipes").iterdir()
                       if p.name.endswith(".yaml"))
    raise ValueError(f"recipe '{name}' not found: give a YAML file or one of {available}")
