"""Checkpoints out to serving stacks and back: `export` (each drafter's declared formats: vLLM,
speculators, SGLang, TensorRT-LLM, FasterDecoding Medusa), `import_drafter` / `import_checkpoint`
(the same formats plus the EAGLE repository's), and the Hub conventions (`Drafter.from_pretrained`,
`push_folder`).  docs/formats.md says what each format writes and why.
"""
from draftsmith.heads.card import record_eval, write_card
from draftsmith.heads.formats import ExportError

from .core import export
from .hub import Drafter, push_folder
from .importers import ImportError_, import_checkpoint, import_drafter

__all__ = ["Drafter", "ExportError", "ImportError_", "export", "import_checkpoint", "import_drafter", "push_folder",
           "record_eval", "write_card"]
