"""draftsmith: train draft heads for speculative decoding and prove what they are worth."""
from draftsmith.heads.infra.version import __version__

__all__ = ["__version__"]
