"""Checkpoints out to serving stacks and back: `export` (vLLM, speculators, SGLang, TensorRT-LLM,
FasterDecoding Medusa), `import_drafter` / `import_checkpoint` (the same formats plus the EAGLE
repository's), and the Hub conventions (`Drafter.from_pretrained`, model cards, `push_folder`).

Tensor names are derived from each drafter's declared layout (export/layouts.py); docs/formats.md
says what each format writes and why.
"""
from .card import Drafter, push_folder, record_eval, write_card
from .core import FORMATS, SUPPORTED, ExportError, export
from .importers import ImportError_, import_checkpoint, import_drafter

__all__ = ["Drafter", "ExportError", "FORMATS", "ImportError_", "SUPPORTED", "export", "import_checkpoint",
           "import_drafter", "push_folder", "record_eval", "write_card"]
