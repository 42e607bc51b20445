"""An EAGLE-3 drafter made by the real `speculators` library, the way its trainer makes one, and its logits.

Run with the Python of the environment that has speculators (the serving tests' .venv-vllm):
    python tests/speculators_drafter.py VERIFIER_DIR OUT_DIR '[{"norm_before_fc": true, ...}, ...]' LAYER_IDS
For each set of flags i, builds `Eagle3DraftModel.from_training_args` (speculators' trainer's constructor) for the verifier with the
given flags (absent ones take the trainer's defaults: norm_before_residual, norm_before_fc and norm_output
true), gives every weight but the verifier's embedding random values (norm weights around 1, so each norm
changes the result), saves it with speculators' own save_pretrained to OUT_DIR/i/drafter, and runs
speculators' own training-time-test forward (3 steps, teacher forcing) on random target features and tokens.
Writes OUT_DIR/i/logits.safetensors: hidden_states [1, L, 3T], input_ids [1, L] and logits.{s} [1, L, v] for
each step s (the draft lm_head's output), and prints one JSON line per set: the flags its saved config holds.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig
from speculators.models.eagle3.core import Eagle3DraftModel

TRAINER_DEFAULTS = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}
STEPS, LENGTH, DRAFT = 3, 12, 40


def make(verifier: str, out: Path, flags: dict, layer_ids: list[int]) -> dict:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(verifier)
    config.num_hidden_layers = 1                        # the drafter's one layer (the trainer's num_layers)
    vocab = config.vocab_size
    draft = torch.arange(0, vocab, 3)[:DRAFT]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft] = True
    settings = {**TRAINER_DEFAULTS, **flags}
    model = Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=draft - torch.arange(draft.numel()), draft_vocab_size=DRAFT,
        verifier_name_or_path=verifier, ttt_steps=STEPS, draft_attn_impl="eager", target_layer_ids=layer_ids,
        **settings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    model.save_pretrained(out / "drafter")
    width = len(layer_ids) * config.hidden_size
    hidden = torch.randn(1, LENGTH, width)
    input_ids = torch.randint(0, vocab, (1, LENGTH))
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    with torch.no_grad():
        model.eval()
        model(hidden_states=hidden, input_ids=input_ids, document_ids=torch.zeros(1, LENGTH, dtype=torch.long),
              ttt_steps=STEPS)
    hook.remove()
    save_file({"hidden_states": hidden, "input_ids": input_ids,
               **{f"logits.{s}": logits.contiguous() for s, logits in enumerate(seen)}},
              str(out / "logits.safetensors"))
    saved = json.loads((out / "drafter" / "config.json").read_text())
    return {"steps": len(seen), **{k: saved.get(k) for k in TRAINER_DEFAULTS}}


if __name__ == "__main__":
    for i, flags in enumerate(json.loads(sys.argv[3])):
        print(json.dumps(make(sys.argv[1], Path(sys.argv[2]) / str(i), flags, json.loads(sys.argv[4]))), flush=True)
