"""EAGLE-3: the training-time-test attention, the draft vocabulary, exact decoding with chains and dynamic trees."""
import pytest
import torch
from conftest import build_tiny_target, one_training_step, prompts
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
from draftsmith.heads.eagle_layer import ttt_mask
from draftsmith.heads.runtime.target import Target, TargetError


def test_ttt_mask_element_by_element():
    s = 4
    for step in range(3):
        mask = ttt_mask(s, step)
        assert mask.shape == (s, s * (step + 1))
        for i in range(s):
            for j in range(s):
                assert mask[i, j] == (j <= i)                       # step-0 keys: causal
            for t in range(1, step + 1):
                for j in range(s):
                    assert mask[i, t * s + j] == (j == i)           # later steps: own position only


def test_efficient_ttt_attention_equals_dense_masked_attention(tiny_target):
    torch.manual_seed(0)
    drafter = Eagle3(Eagle3Config(draft_vocab_size=64), tiny_target)
    attention = drafter.midlayer.self_attn
    b, s = 2, 6
    width = attention.q_proj.in_features
    inputs = [torch.randn(b, s, width) for _ in range(3)]
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, 4:] = False                                            # padding at the end of row 1
    positions = torch.arange(s)[None].expand(b, s)
    past, outs = [], []
    for step, x in enumerate(inputs):
        cos, sin = drafter.rotary(x, positions + step)
        outs.append(attention.ttt(x, cos, sin, past, valid))
    # dense reference: all steps' keys side by side, ttt_mask (and padding) deciding visibility
    groups = attention.shape.num_heads // attention.shape.num_kv_heads
    for step, x in enumerate(inputs):
        cos, sin = drafter.rotary(x, positions + step)
        q = attention._qkv(x, cos, sin).query
        keys = torch.cat([k for k, _ in past[: step + 1]], dim=2).repeat_interleave(groups, 1)
        values = torch.cat([v for _, v in past[: step + 1]], dim=2).repeat_interleave(groups, 1)
        mask = ttt_mask(s, step)[None, None] & valid.repeat(1, step + 1)[:, None, None, :]
        mask = mask | torch.eye(s, s * (step + 1), dtype=torch.bool)[None, None]       # a query sees itself
        dense = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        expected = attention.o_proj(dense.transpose(1, 2).reshape(b, s, -1))
        assert torch.allclose(outs[step][0], expected[0], atol=1e-5)
        assert torch.allclose(outs[step][1, :4], expected[1, :4], atol=1e-5)


def _eager_ttt(self, x, cos, sin, past, key_valid):
    """The training-time-test attention as it was computed before scaled_dot_product_attention: fp32
    [b, h, s, s] scores over the step-0 keys, the later steps' own-position scores beside them."""
    out, k, v = _eager_ttt_step(self, x, cos, sin, past, key_valid)
    past.append((k, v))
    return out


def _eager_ttt_step(self, x, cos, sin, past, key_valid):
    """`_eager_ttt` as `DraftAttention.ttt_step` (what the drafter's layer calls): past is not appended to."""
    q, k, v = self._qkv(x, cos, sin)
    past = [*past, (k, v)]
    groups = self.shape.num_heads // self.shape.num_kv_heads
    expand = (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t)
    scale = self.shape.head_dim ** -0.5
    k0, v0 = expand(past[0][0]), expand(past[0][1])
    scores0 = torch.matmul(q, k0.transpose(-1, -2)).float() * scale
    s = x.shape[1]
    visible = torch.ones(s, s, dtype=torch.bool).tril() & key_valid[:, None, None, :]
    scores0 = scores0.masked_fill(~visible, float("-inf"))
    diagonal = [(q * expand(kt)).sum(-1, keepdim=True).float() * scale for kt, _ in past[1:]]
    probs = torch.softmax(torch.cat([scores0] + diagonal, dim=-1), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :s], v0)
    for t, (_, vt) in enumerate(past[1:]):
        out = out + probs[..., s + t: s + t + 1] * expand(vt)
    return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], s, -1)), k, v


@pytest.mark.parametrize("block", [None, 4, 5], ids=["one-block", "blocks-of-4", "blocks-of-5"])
def test_fused_ttt_attention_gives_the_eager_paths_loss_and_gradients(tiny_target, monkeypatch, block):
    """The 4-step training-time-test loss of a tiny EAGLE-3 (grouped-query attention: 4 heads, 2 KV), with right
    padding, through scaled_dot_product_attention and through the eager fp32 scores: equal loss, equal
    gradients of every parameter.  With queries attended in blocks (eagle_layer.TTT_QUERY_BLOCK, 4 and 5
    against rows of 12, 7 and 10 tokens: blocks that split rows, padding and a last short block) the same."""
    from draftsmith.heads import eagle_layer
    from draftsmith.heads.eagle_layer import DraftAttention
    from draftsmith.train.batches import collate

    if block:
        monkeypatch.setattr(eagle_layer, "TTT_QUERY_BLOCK", block)

    torch.manual_seed(0)
    drafter = Eagle3(Eagle3Config(draft_vocab_size=64, ttt_steps=4), tiny_target)
    for p in drafter.midlayer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(4, tiny_target.vocab_size, (n,), generator=g).tolist(),
             "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (12, 7, 10)]
    batch = collate(rows)
    batch["features"] = tiny_target.features(batch["input_ids"], batch["attention_mask"], drafter.required_layers)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def loss_and_grads():
        loss = drafter.loss(batch).loss
        return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    fused_loss, fused = loss_and_grads()
    monkeypatch.setattr(DraftAttention, "ttt_step", _eager_ttt_step)      # what the drafter's layer calls
    eager_loss, eager = loss_and_grads()
    assert torch.allclose(fused_loss, eager_loss, rtol=1e-5), (fused_loss, eager_loss)
    for p, a, b in zip(params, fused, eager):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), float((a - b).abs().max())


def test_layer_ids_and_vocabulary_are_checked(tiny_target):
    with pytest.raises(TargetError, match="out of range"):
        Eagle3(Eagle3Config(layer_ids=[0, 1, 9]), tiny_target)
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        Eagle3(Eagle3Config(draft_vocab_size=10_000), tiny_target)


def untrained(target, seed=0, vocab=None):
    torch.manual_seed(seed)
    drafter = Eagle3(Eagle3Config(draft_vocab_size=vocab, layer_ids=[0, 1, 2]), target)
    for p in drafter.midlayer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return drafter


def assert_exact_with_accepted_drafts(target, drafter, cases, max_new_tokens=40, min_accepted=20):
    """Speculative greedy equals plain greedy on every prompt, and enough drafts were accepted that the
    accept path (and the cache compaction after it) was exercised."""
    accepted = 0
    for prompt in cases:
        plain = decode(target, prompt, max_new_tokens)
        spec = decode(target, prompt, max_new_tokens, drafter=drafter)
        assert spec.tokens == plain.tokens
        accepted += sum(spec.accepted)
    assert accepted > min_accepted


def overfit(target, drafter, sequences, steps=60):
    ids = torch.tensor(sequences)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = target.features(ids, batch["attention_mask"], drafter.required_layers)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        drafter.loss(batch).loss.backward()
        optimizer.step()


@pytest.mark.parametrize("proposal", ["chain", "tree"])
def test_eagle3_decodes_exactly(tiny_target, proposal):
    drafter = untrained(tiny_target, vocab=tiny_target.vocab_size)
    cases = prompts(tiny_target)
    overfit(tiny_target, drafter, [p + decode(tiny_target, p, 40).tokens[:34] for p in cases])   # some drafts right
    if proposal == "chain":
        drafter.set_proposal(chain=4)
    else:
        drafter.set_proposal(tree=TreeSettings(depth=4, top_k=3, total_tokens=10))
    assert_exact_with_accepted_drafts(tiny_target, drafter, cases)


def test_dynamic_tree_keeps_a_prefix_closed_tree_of_the_asked_size(tiny_target):
    drafter = untrained(tiny_target, vocab=tiny_target.vocab_size)
    drafter.set_proposal(tree=TreeSettings(depth=4, top_k=3, total_tokens=9))
    prompt = prompts(tiny_target, count=1)[0]
    cache = tiny_target.new_cache(1, 64)
    out = tiny_target.forward_block(cache, torch.tensor([prompt]), torch.arange(len(prompt))[None],
                                    layer_ids=drafter.required_layers, logits="last")
    from draftsmith.heads.drafter import DraftContext
    drafter.reset()
    context = DraftContext(torch.tensor(prompt), {i: h[0] for i, h in out.hidden_states.items()},
                           int(out.logits[0, -1].argmax()), len(prompt))
    tree = drafter.propose(context)
    assert tree.size == 9 and int(tree.depths.max()) <= 4
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))       # parents first
    assert drafter.cache.length == len(prompt)                           # drafted slots dropped


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_families_train_a_step_and_decode_exactly(family, tmp_path):
    target = Target.load(str(build_tiny_target(tmp_path / family, family, seed=4)), "float32")
    drafter = Eagle3(Eagle3Config(draft_vocab_size=48, ttt_steps=3), target)
    ids = torch.tensor([prompts(target, count=1, length=12)[0], prompts(target, count=1, length=12, seed=5)[0]])
    first, after = one_training_step(target, drafter, ids)
    assert torch.isfinite(first.loss) and first.counted[0] > 0
    assert after < first.loss                                             # the step helped
    drafter.set_proposal(tree=TreeSettings(depth=3, top_k=2, total_tokens=6))
    for prompt in prompts(target, count=2):
        assert decode(target, prompt, 24, drafter=drafter).tokens == decode(target, prompt, 24).tokens


NORM_SETS = {"plain": {}, "eagle-3.1": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
             "fc_norm": {"fc_norm": True, "norm_output": True}}


@pytest.mark.parametrize("options", sorted(NORM_SETS))
def test_inference_proposals_equal_teacher_forced_predictions(tiny_target, options):
    """No train/inference mismatch: on one sequence, drafting reproduces the training-time unroll.
    Depth 1 at root position P equals step 0 at t = P-1; depth 2 equals step 1 there when depth 1 was right.
    With EAGLE-3.1's norms too (norm_output changes what depth 2 reads, in both)."""
    torch.manual_seed(1)
    drafter = Eagle3(Eagle3Config(draft_vocab_size=tiny_target.vocab_size, ttt_steps=2, **NORM_SETS[options]),
                     tiny_target)
    for p in drafter.midlayer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    prompt = prompts(tiny_target, count=1, length=8)[0]
    sequence = prompt + decode(tiny_target, prompt, 30).tokens
    ids = torch.tensor([sequence])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(60):             # overfit this sequence, so depth 1 is often right and depth 2 gets compared
        optimizer.zero_grad()
        drafter.loss(batch).loss.backward()
        optimizer.step()
    with torch.no_grad():
        forced = [drafter.draft_to_target[drafter.logits(h).argmax(-1)][0] for h in drafter.unroll(batch)]

    proposals = []
    original = drafter.propose

    def recording(context):
        tree = original(context)
        proposals.append((context.position, tree.tokens.tolist()))
        return tree
    drafter.propose = recording
    drafter.set_proposal(chain=2)
    decode(tiny_target, prompt, 30, drafter=drafter)
    checked_depth2 = 0
    for position, (first, second) in proposals:
        t = position - 1
        if t + 2 >= len(sequence):
            continue
        assert first == int(forced[0][t]), position
        if first == sequence[t + 2]:
            assert second == int(forced[1][t]), position
            checked_depth2 += 1
    assert len(proposals) > 5 and checked_depth2 >= 3


def test_eagle1_learns_and_decodes_exactly(tiny_target):
    from draftsmith.heads.eagle import Eagle, EagleConfig
    torch.manual_seed(0)
    drafter = Eagle(EagleConfig(noise=0.0), tiny_target)
    cases = prompts(tiny_target)
    sequences = [p + decode(tiny_target, p, 40).tokens[:34] for p in cases]
    ids = torch.tensor(sequences)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    first = drafter.loss(batch)
    overfit(tiny_target, drafter, sequences)
    last = drafter.loss(batch)
    assert last.loss < 0.6 * first.loss and last.correct > first.correct
    drafter.set_proposal(tree=TreeSettings(depth=3, top_k=3, total_tokens=8))
    assert_exact_with_accepted_drafts(tiny_target, drafter, cases)


def test_eagle3_cached_and_online_features_give_the_same_loss(tiny_target):
    """The cache stores bf16; the same batch with bf16-rounded features gives the same loss as online."""
    torch.manual_seed(0)
    drafter = Eagle3(Eagle3Config(draft_vocab_size=64, layer_ids=[0, 1, 2], ttt_steps=3), tiny_target)
    ids = torch.tensor(prompts(tiny_target, count=2, length=16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    online = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    cached = {i: f.to(torch.bfloat16).float() for i, f in online.items()}
    a = drafter.loss({**batch, "features": online})
    b = drafter.loss({**batch, "features": cached})
    assert torch.allclose(a.loss, b.loss, rtol=1e-2) and torch.equal(a.counted, b.counted)


@pytest.mark.parametrize("settings", [TreeSettings(depth=3, top_k=1, total_tokens=3),
                                      TreeSettings(depth=4, top_k=3, total_tokens=10)], ids=["chain", "tree"])
def test_cached_draft_steps_propose_what_a_fresh_drafter_proposes(tiny_target, settings):
    """The drafter keeps its own KV cache between steps (one new token fed per step); a fresh drafter fed
    the whole history at once must propose the same tree, node for node."""
    from draftsmith.heads.drafter import DraftContext
    drafter = untrained(tiny_target, vocab=tiny_target.vocab_size)
    drafter.set_proposal(tree=settings)
    prompt = prompts(tiny_target, count=1, length=20)[0]
    ids = torch.tensor([prompt])
    cache = tiny_target.new_cache(1, 32)
    hidden = tiny_target.forward_block(cache, ids, torch.arange(len(prompt))[None], layer_ids=drafter.required_layers,
                                       logits="none").hidden_states

    def context(start, end):
        return DraftContext(ids[0, start:end], {i: h[0, start:end] for i, h in hidden.items()}, prompt[end], end)
    drafter.reset()
    cached = [drafter.propose(context(0, 12))]
    cached += [drafter.propose(context(j, j + 1)) for j in range(12, 18)]
    for step, tree in enumerate(cached):
        drafter.reset()
        fresh = drafter.propose(context(0, 12 + step))
        assert torch.equal(tree.tokens, fresh.tokens) and torch.equal(tree.parents, fresh.parents), step
