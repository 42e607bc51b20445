"""Load speculators-format exports with the real `speculators` library and compare every tensor.

Run with the Python of the environment that has speculators (the serving tests' .venv-vllm):
    python tests/speculators_load.py EXPORT_DIR [EXPORT_DIR ...]
Prints one JSON line per export: the class speculators chose, the tensors compared, any that differ or
were not loaded, and the rotary angles its model computes at position 4,000 (`rope_at`: cos and sin of one
head; the rope tests compare them with the target's).  Exits 1 if any export fails to load or any tensor differs.
"""
import json
import sys

import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel


ROPE_POSITION = 4000


def check(directory: str) -> dict:
    model = SpeculatorModel.from_pretrained(directory)
    loaded = model.state_dict()
    written = load_file(f"{directory}/model.safetensors")
    missing = sorted(set(written) - set(loaded))
    differ = sorted(k for k in written if k in loaded
                    and not (loaded[k].shape == written[k].shape and torch.equal(loaded[k].to(written[k].dtype),
                                                                                 written[k])))
    rope = None
    if hasattr(model, "rotary_emb"):
        cos, sin = model.rotary_emb(torch.zeros(1, 1, 1), torch.tensor([[ROPE_POSITION]]))
        rope = {"position": ROPE_POSITION, "cos": cos.flatten().tolist(), "sin": sin.flatten().tolist()}
    return {"export": directory, "class": type(model).__name__, "compared": len(written) - len(missing),
            "not_loaded": missing, "differ": differ, "rope_at": rope}


def main() -> int:
    failed = False
    for directory in sys.argv[1:]:
        try:
            result = check(directory)
        except Exception as error:            # one line per export, whatever speculators raised
            result = {"export": directory, "error": f"{type(error).__name__}: {error}"[:2000]}
        failed |= bool(result.get("error") or result.get("not_loaded") or result.get("differ"))
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
