"""draftsmith's version, from the installed package's metadata (pyproject.toml's `version`)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("draftsmith")
except PackageNotFoundError:          # imported from a checkout that was never installed
    __version__ = "0+unknown"
