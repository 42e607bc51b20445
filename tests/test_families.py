"""The family matrix: tiny random-weight models built from each family's own configuration class in the
installed transformers (tests/tiny_models.py FAMILIES keeps what makes each architecture itself), through
the real code path.  For each family: the engine's blocks equal transformers' eager forward, the engine's
plain greedy decoding equals transformers' own greedy `generate` (eager attention, transformers' cache),
speculative decoding equals plain for a Medusa and an EAGLE-3 drafter and for a drafter that is right for
a random number of tokens (so every rollback length is exercised), and an EAGLE-3 drafter trains a step.
docs/targets.md's table is these tests' rows."""
import pytest
import torch
from conftest import OracleDrafter, build_tiny_target, one_training_step, prompts
from tiny_models import FAMILIES, REFUSED, chats_file, dialogues_file

from draftsmith.eval.engine_check import NEAR_TIE, compare
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.tree import DraftTree, TreeShape, all_paths
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
from draftsmith.heads.medusa import Medusa, MedusaConfig
from draftsmith.heads.runtime.engine import TreeOverRecurrentLayers
from draftsmith.heads.runtime.target import Target, TargetError

HYBRID = {"qwen3_next", "qwen3_5", "granite4_hybrid", "nemotron_h"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    directory = build_tiny_target(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return request.param, Target.load(str(directory), "float32")


class NoisyOracle(OracleDrafter):
    """The target's own greedy continuation with one wrong token at a random depth (or none): each step
    accepts a random 0..depth tokens, so every rollback length is exercised."""

    def __init__(self, target, depth, seed=0):
        super().__init__(target, depth)
        self.random = torch.Generator().manual_seed(seed)

    def propose(self, context):
        truth = super().propose(context).tokens.tolist()
        wrong = int(torch.randint(0, self.depth + 1, (1,), generator=self.random))
        if wrong < len(truth):
            truth[wrong] = (truth[wrong] + 1) % self.target.vocab_size
        return DraftTree(tokens=torch.tensor(truth, dtype=torch.long), parents=torch.arange(len(truth)) - 1)


def assert_same_up_to_a_near_tie(target, prompt, spec, plain, name):
    """spec == plain, or they part where plain's two tokens are within float rounding (NEAR_TIE) of each
    other: a block's sums run in another order than a single token's, and a MoE router or an exact tie
    of a random tiny model then flips.  Returns where they part (None: nowhere)."""
    if spec == plain:
        return None
    i = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
    assert i < min(len(spec), len(plain)), (name, "one stopped early", spec, plain)
    gap, scale = target.logit_gap(prompt + plain[:i], spec[i], plain[i])
    assert gap <= NEAR_TIE * (1 + scale), (name, i, gap, spec, plain)
    return i


def test_engine_blocks_equal_the_eager_forward(family):
    name, target = family
    ids = torch.randint(6, target.vocab_size, (1, 12))
    target.model.set_attn_implementation("eager")
    try:
        reference = target.model(input_ids=ids, use_cache=False).logits
    finally:
        target.model.set_attn_implementation("draftsmith")
    cache = target.new_cache(1, 32)
    pieces = [target.forward_block(cache, ids[:, a:b], torch.arange(a, b)[None]).logits
              for a, b in ((0, 5), (5, 6), (6, 12))]
    err = (torch.cat(pieces, 1) - reference).abs().max().item()
    assert err <= 1e-4 * (1 + reference.abs().max().item()), (name, err)


def test_engine_greedy_equals_transformers_generate(family):
    name, target = family
    cases = [(str(i), p) for i, p in enumerate(prompts(target, count=3, length=8))]
    check = compare(target, cases, 24)
    # a near-tie (two logits within float rounding, eval/engine_check.py) may part the texts legitimately: with
    # one thread per worker the tiny Qwen3-MoE has one in these prompts on an AVX2 EPYC (on the code before the
    # GPU-path change too); more than one, or too few tokens compared, would make the check mean nothing
    assert check.matches and check.near_ties <= 1, (name, check)
    assert check.tokens >= 3 * 12                  # decodings long enough to mean something


def test_speculative_equals_plain_with_every_rollback_length(family):
    name, target = family
    oracle = NoisyOracle(target, depth=4)
    accepted, ties = [], set()
    for index, prompt in enumerate(prompts(target, count=3, length=8)):
        spec = decode(target, prompt, 30, drafter=oracle)
        ties.add((index, assert_same_up_to_a_near_tie(target, prompt, spec.tokens, decode(target, prompt, 30).tokens,
                                                      name)))
        accepted += spec.accepted[:-1]
    assert len(ties - {(i, None) for i in range(3)}) <= 1, name
    assert {0, 1, 2, 3, 4} <= set(accepted), (name, sorted(set(accepted)))   # every rollback length, and none


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_medusa_and_eagle3_decode_exactly_chain_and_tree(family, kind):
    name, target = family
    torch.manual_seed(0)
    if kind == "medusa":
        drafter = Medusa(MedusaConfig(num_heads=3), target)
        for block in drafter.blocks:
            torch.nn.init.normal_(block[0].linear.weight, std=0.5)
        tree = dict(tree=TreeShape(all_paths(3, 2)))
    else:
        drafter = Eagle3(Eagle3Config(layer_ids=[0, 1, target.num_layers], draft_vocab_size=None), target)
        for p in drafter.midlayer.parameters():
            torch.nn.init.normal_(p, std=0.3)
        tree = dict(tree=TreeSettings(depth=3, top_k=2, total_tokens=6))
    cases = prompts(target, count=2, length=8)
    plain = [decode(target, prompt, 24).tokens for prompt in cases]
    drafter.set_proposal(chain=3)
    ties = {(i, assert_same_up_to_a_near_tie(target, prompt, decode(target, prompt, 24, drafter=drafter).tokens,
                                             reference, name)) for i, (prompt, reference) in enumerate(zip(cases, plain))}
    drafter.set_proposal(**tree)
    if name in HYBRID:                  # a tree over recurrent layers is refused, never decoded wrong
        with pytest.raises(TreeOverRecurrentLayers, match="eval.proposal=chain"):
            decode(target, cases[0], 24, drafter=drafter)
        return
    ties |= {(i, assert_same_up_to_a_near_tie(target, prompt, decode(target, prompt, 24, drafter=drafter).tokens,
                                              reference, name)) for i, (prompt, reference) in enumerate(zip(cases, plain))}
    assert len(ties - {(i, None) for i in range(len(cases))}) <= 1, name     # one tied place at most


def test_an_eagle3_drafter_trains_a_step(family):
    name, target = family
    drafter = Eagle3(Eagle3Config(draft_vocab_size=None, ttt_steps=2), target)
    first, after = one_training_step(target, drafter, torch.tensor(prompts(target, count=2, length=12)))
    assert torch.isfinite(first.loss) and first.counted[0] > 0, name
    assert after < first.loss, name


@pytest.mark.parametrize("mode", ["regenerate", "prefill"])
def test_data_in_each_mode_is_the_targets_own(family, mode, tmp_path):
    """make_data as `draftsmith data` runs it: regenerated replies are the engine's plain greedy decoding
    (which equals transformers' generate, above); prefilled dialogues keep both source replies under the loss
    mask; the captured features equal a fresh forward over the written ids (bf16 storage)."""
    from draftsmith.data import features as feature_cache
    from draftsmith.data.distill import DataSettings, make_data, read_shard, shard_paths

    name, target = family
    if mode == "regenerate":
        settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 5)), max_conversations=None,
                                batch_size=3, max_new_tokens=10)
    else:
        settings = DataSettings(source=str(dialogues_file(tmp_path / "d.jsonl", 4)), mode="prefill",
                                max_conversations=None, batch_size=3)
    layers = [1, target.num_layers]
    report = make_data(target, settings, tmp_path / "data", seed=0, progress=False, capture_layers=layers)
    records = [(shard, r) for shard in shard_paths(tmp_path / "data") for r in read_shard(shard)]
    assert len(records) == report.conversations == (5 if mode == "regenerate" else 4), name
    for _, record in records:
        mask = record["loss_mask"]
        if mode == "regenerate":
            prompt_len = mask.index(1)
            assert record["input_ids"][prompt_len:] == decode(target, record["input_ids"][:prompt_len], 10).tokens, name
        else:
            assert sum(1 for a, b in zip([0] + mask, mask) if b and not a) == 2, name
    for shard in sorted({shard for shard, _ in records}):
        cached = feature_cache.cache_dir(tmp_path / "data", layers) / (shard.stem + ".safetensors")
        reader = feature_cache.ShardReader(cached, layers, target.identity.weights_sha256)
        for row, expected in enumerate(feature_cache.compute_features(target, read_shard(shard), layers)):
            got = reader.record(row).float()
            assert torch.allclose(got[:-1], expected[:-1].float(), atol=0.05, rtol=0.02), (name, shard.stem, row)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_family_the_engine_cannot_decode_is_refused_by_name_before_its_weights_load(name, tmp_path, monkeypatch):
    import transformers
    from transformers import AutoModelForCausalLM
    directory = build_tiny_target(tmp_path / name, name)
    model_type = getattr(transformers, REFUSED[name][0]).model_type
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(TargetError, match=f"'{model_type}' has .* layers, which draftsmith's engine cannot decode"):
        Target.load(str(directory), "float32")


def test_a_hybrid_target_under_a_transformers_without_recurrent_cache_layers_is_refused_by_name(tmp_path,
                                                                                                monkeypatch):
    """vLLM's transformers pin (older) imports draftsmith for data.backend=vllm: the engine must import there,
    and a hybrid target be refused before its weights load, naming the version it needs."""
    import transformers.cache_utils
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.runtime import engine
    directory = build_tiny_target(tmp_path / "qwen3_next", "qwen3_next")
    monkeypatch.delattr(transformers.cache_utils, "DummyLayer")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were read"))
    engine.recurrent_layer_classes.cache_clear()
    try:
        with pytest.raises(TargetError, match=f"'qwen3_next': .*needs transformers >= {engine.HYBRID_TRANSFORMERS}"):
            Target.load(str(directory), "float32")
    finally:
        engine.recurrent_layer_classes.cache_clear()


@pytest.mark.parametrize("name", ["qwen3_next", "granite4_hybrid"])
def test_hybrid_data_generation_equals_one_by_one_decoding(name, tmp_path):
    """Continuous batching over recurrent layers: prompts prefilled alone (no padding read as tokens), the
    recurrent states merged and dropped by row with the keys and values; greedy output equals one-by-one
    decoding, and the captured features those of a fixed batch."""
    from draftsmith.data.generate import generate_batch
    from draftsmith.data.stream import generate_stream

    target = Target.load(str(build_tiny_target(tmp_path / name, name, seed=3)), "float32")
    cases = [p[:4 + i % 5] for i, p in enumerate(prompts(target, count=7, length=9))]
    plain = [decode(target, p, 12).tokens for p in cases]
    stop = plain[0][5]                      # a stop token: rows finish at different steps
    target.eos_token_ids = [stop]
    plain = [decode(target, p, 12).tokens for p in cases]
    layers = [1, target.num_layers]
    streamed = generate_stream(target, cases, 12, rows=3, capture_layers=layers)
    fixed = generate_batch(target, cases, 12, capture_layers=layers)
    assert len({len(s.token_ids) for s in streamed}) > 1
    for reference, got, batch in zip(plain, streamed, fixed):
        assert got.token_ids == reference and batch.token_ids == reference
        assert torch.allclose(got.features.float(), batch.features.float(), atol=0.03, rtol=0.02)


def test_eval_fails_loudly_on_an_engine_that_disagrees_with_transformers(checkpoint, tmp_path, monkeypatch, caplog):
    """A defect shared by plain and speculative decoding, and by the engine's own fallback so the load-time
    self-check passes too (here: attention scaled 3x, as a dropped sink would be shared), passes "greedy
    exact"; the engine check catches it, names where, and greedy exact is reported false."""
    import json

    from draftsmith.eval.benchmark import EvalSettings, evaluate
    from draftsmith.eval.report import markdown
    from draftsmith.heads.runtime import engine
    from tiny_models import chats_file

    original, fallback = engine.cached_attention, engine.sdpa_attention_forward

    def wrong(cache, layer, query, key, value, scaling=None, *rest):
        return original(cache, layer, query, key, value, 3 * (scaling or query.shape[-1] ** -0.5), *rest)

    def wrong_fallback(module, query, key, value, mask, scaling=None, **kwargs):
        return fallback(module, query, key, value, mask, scaling=3 * (scaling or query.shape[-1] ** -0.5), **kwargs)
    monkeypatch.setattr(engine, "cached_attention", wrong)
    monkeypatch.setattr(engine, "sdpa_attention_forward", wrong_fallback)
    options = EvalSettings(prompts=str(chats_file(tmp_path / "chats.jsonl", 3)), limit=2, max_new_tokens=12,
                           exact_prompts=2, baselines=("plain",))
    result = evaluate(str(checkpoint), options, progress=False)
    assert result.engine_matches_transformers is False and result.greedy_exact is False
    assert result.first_mismatch.startswith("engine vs transformers: prompt ")
    assert "does not reproduce transformers' greedy generate" in caplog.text
    assert "engine matches transformers" in markdown(result) and "**False**" in markdown(result)
    assert json.loads(json.dumps(result.to_dict()))["engine_matches_transformers"] is False


def test_the_rollback_cost_script_runs_as_its_usage_line_says(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    directory = build_tiny_target(tmp_path / "qwen3_next", "qwen3_next", seed=3)
    script = Path(__file__).resolve().parents[1] / "scripts" / "rollback_cost.py"
    run = subprocess.run([sys.executable, str(script), str(directory), "--prompt", "16", "--draft", "4",
                          "--accepted", "1", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for line in ("recorded + crop", "copy + re-run", "one-token forward"):
        assert line in run.stdout
    plain = build_tiny_target(tmp_path / "llama", "llama")
    refused = subprocess.run([sys.executable, str(script), str(plain)], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "has no recurrent layers" in refused.stderr


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_an_eagle3_export_imports_back_with_the_same_weights_and_decoding(family, fmt, tmp_path, capsys):
    from conftest import eagle3_checkpoint

    from draftsmith.cli import main
    from draftsmith.export import export
    from draftsmith.heads.drafter import load_drafter

    name, target = family
    original = eagle3_checkpoint(target, tmp_path / "ckpt")
    export(tmp_path / "ckpt", fmt, tmp_path / "export", dtype="float32")
    assert main(["import", str(tmp_path / "export"), "--from", fmt, str(tmp_path / "back"),
                 "--target", target.source]) == 0, capsys.readouterr()
    back = load_drafter(tmp_path / "back", target)
    mine, theirs = original.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k].float(), theirs[k].float()) for k in mine), name
    original.set_proposal(chain=3)
    back.set_proposal(chain=3)
    for prompt in prompts(target, count=2, length=6):
        assert decode(target, prompt, 16, drafter=original).accepted == \
            decode(target, prompt, 16, drafter=back).accepted, name


def test_docs_targets_lists_exactly_the_families_tested_and_refused():
    """docs/targets.md's rows come from these tests: every family tested has a row and no row names a
    family that is not tested (or, in the refused table, refused by a test here)."""
    import re
    from pathlib import Path

    import transformers

    text = (Path(__file__).resolve().parents[1] / "docs" / "targets.md").read_text()
    tested, refused = text.split("## Refused, by name, at load")[0], text.split("## Refused, by name, at load")[1]
    def rows(part):
        return set(re.findall(r"^\| [^|]*\(`(\w+)`", part, flags=re.M))
    assert rows(tested) == {class_name for class_name, _ in FAMILIES.values()}
    assert rows(refused) == {class_name for class_name, _ in REFUSED.values()}
    assert all(hasattr(transformers, name) for name in rows(tested) | rows(refused))
