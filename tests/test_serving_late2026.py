"""The drafters of late 2026 in the serving stacks: the speculators library loads a DSpark export and a P-EAGLE
export with EAGLE-3.1's norms tensor by tensor; vLLM 0.32 reads a DSpark export's config and, on this CPU,
says why it cannot serve it (its DSpark runs in Model Runner V2 only, which needs Triton: a GPU).  Once a
vLLM that serves DSpark here is installed, the last test compares vLLM's text with draftsmith's, and fails
on anything but that one refusal.  All three are in `make test-heavy` (CI runs it after `make test`): each
starts the speculators or vLLM environment, which the default run's time budget cannot spare."""
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from test_serving import REPO, speculators_python, vllm_python  # noqa: F401  (fixtures)

from draftsmith.export import export
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import save_drafter
from draftsmith.heads.dspark import DSpark, DSparkConfig
from draftsmith.heads.runtime.target import Target

pytestmark = [pytest.mark.serving]

V2_ONLY = "Model Runner V1 does not support: dspark speculative decoding"


def dspark_export(tmp_path, fmt: str):
    from tiny_models import build_tiny_target

    directory = build_tiny_target(tmp_path / "target", "llama", layers=4)
    target = Target.load(str(directory), "float32")
    torch.manual_seed(0)
    drafter = DSpark(DSparkConfig(layer_ids=[1, 2, 3], num_layers=1, block_size=4, draft_vocab_size=64,
                                  markov_rank=16), target)
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight)
    save_drafter(drafter, tmp_path / "ckpt")
    return directory, target, drafter, export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")


@pytest.mark.heavy
def test_the_speculators_library_loads_a_dspark_export_tensor_by_tensor(speculators_python, tmp_path):  # noqa: F811
    *_, out = dspark_export(tmp_path, "speculators")
    done = subprocess.run([speculators_python, str(REPO / "tests" / "speculators_load.py"), str(out)],
                          capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print("\n" + "\n".join(json.dumps({k: v for k, v in r.items() if k != "rope_at"}) for r in results))
    assert done.returncode == 0 and len(results) == 1, (done.stdout + done.stderr)[-3000:]
    assert results[0]["class"] == "DSparkDraftModel" and not results[0]["differ"]
    written = json.loads((out / "config.json").read_text())
    assert results[0]["compared"] == 21 and written["markov_rank"] == 16


@pytest.mark.heavy
def test_the_speculators_library_loads_a_p_eagle_export_with_norms(speculators_python, tmp_path):  # noqa: F811
    from test_eagle31 import p_eagle_with
    from tiny_models import build_tiny_target

    directory = build_tiny_target(tmp_path / "target", "llama", layers=4)
    target = Target.load(str(directory), "float32")
    drafter = p_eagle_with(target, layer_ids=(1, 2, 3), norm_before_fc=True, norm_before_residual=True)
    save_drafter(drafter, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "speculators", tmp_path / "spec", dtype="float32")
    done = subprocess.run([speculators_python, str(REPO / "tests" / "speculators_load.py"), str(out)],
                          capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print("\n" + "\n".join(json.dumps({k: v for k, v in r.items() if k != "rope_at"}) for r in results))
    assert done.returncode == 0 and len(results) == 1, (done.stdout + done.stderr)[-3000:]
    assert results[0]["class"] == "PEagleDraftModel" and not results[0]["differ"] and not results[0]["not_loaded"]
    assert "input_norm.weight" in load_file(str(out / "model.safetensors"))


SERVE = """
import sys
from vllm import LLM, SamplingParams
spec = {"method": "dspark", "model": sys.argv[2], "num_speculative_tokens": int(sys.argv[3])}
llm = LLM(model=sys.argv[1], speculative_config=spec, max_model_len=256, enforce_eager=True, dtype="float32")
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(max_tokens=16, temperature=0))
print("TOKENS", list(out[0].outputs[0].token_ids))
"""


@pytest.mark.heavy
def test_vllm_reads_a_dspark_export_and_serves_it_or_says_why_not(vllm_python, tmp_path):  # noqa: F811
    directory, target, drafter, out = dspark_export(tmp_path, "vllm")
    done = subprocess.run([vllm_python, "-c", SERVE, str(directory), str(out), str(drafter.drafts)],
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert "Resolved architecture: Qwen3DSparkModel" in log, log[-3000:]
    if done.returncode != 0:
        print(f"\nvLLM refused: {V2_ONLY}")
        assert V2_ONLY in log, log[-3000:]               # any other refusal is a fault in the export
        return
    served = json.loads(log.split("TOKENS", 1)[1].splitlines()[0].strip().replace("'", '"'))
    assert served == decode(target, [5, 6, 7, 8, 9], 16, drafter=drafter).tokens
