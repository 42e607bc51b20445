"""The engine must compute what the model computes: cached blocks, tree masks, compaction, padding."""
import pytest
import torch
from conftest import build_tiny_target
from draftsmith.heads.runtime.target import Target
from draftsmith.heads.decoding.tree import DraftTree


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def family_target(request, tmp_path_factory):
    directory = build_tiny_target(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    return Target.load(str(directory), "float32")


def test_blocks_match_full_forward(family_target):
    target = family_target
    ids = torch.randint(6, target.vocab_size, (1, 12))
    reference = target.model(input_ids=ids).logits
    cache = target.new_cache(1, 32)
    pieces = [target.forward_block(cache, ids[:, a:b], torch.arange(a, b)[None]).logits
              for a, b in ((0, 5), (5, 6), (6, 12))]
    assert torch.allclose(torch.cat(pieces, 1), reference, atol=1e-4)


def test_tree_node_sees_only_its_ancestors(tiny_target):
    target = tiny_target
    prompt = torch.randint(6, target.vocab_size, (1, 7))
    # root r, children a b, grandchild c under a:  r -> a -> c, r -> b
    tree = DraftTree(tokens=torch.tensor([11, 12, 13]), parents=torch.tensor([-1, -1, 0]))
    root = 10
    cache = target.new_cache(1, 32)
    target.forward_block(cache, prompt, torch.arange(7)[None])
    ids = torch.tensor([[root, 11, 12, 13]])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    tree_logits = target.forward_block(cache, ids, (7 + offsets)[None], tree.attention_mask()[None]).logits[0]
    for node, path in ((1, [root, 11]), (2, [root, 12]), (3, [root, 11, 13])):
        full = torch.cat([prompt, torch.tensor([path])], 1)
        expected = target.model(input_ids=full).logits[0, -1]
        assert torch.allclose(tree_logits[node], expected, atol=1e-4), node


def test_keep_compacts_the_accepted_path(tiny_target):
    target = tiny_target
    prompt = torch.randint(6, target.vocab_size, (1, 5))
    cache = target.new_cache(1, 32)
    target.forward_block(cache, prompt, torch.arange(5)[None])
    tree = DraftTree(tokens=torch.tensor([21, 22, 23]), parents=torch.tensor([-1, -1, 1]))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    start = cache.length
    target.forward_block(cache, torch.tensor([[20, 21, 22, 23]]), (5 + offsets)[None], tree.attention_mask()[None])
    cache.keep(start, torch.tensor([start, start + 2, start + 3]))     # root, node 1 (22), node 2 (23)
    assert cache.length == 8
    nxt = target.forward_block(cache, torch.tensor([[24]]), torch.tensor([[8]])).logits[0, -1]
    full = torch.cat([prompt, torch.tensor([[20, 22, 23, 24]])], 1)
    assert torch.allclose(nxt, target.model(input_ids=full).logits[0, -1], atol=1e-4)


def test_left_padding_is_invisible(tiny_target):
    target = tiny_target
    short = torch.randint(6, target.vocab_size, (3,))
    long = torch.randint(6, target.vocab_size, (6,))
    ids = torch.zeros(2, 6, dtype=torch.long)
    ids[0, 3:], ids[1] = short, long
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, :3] = False
    positions = torch.stack([torch.tensor([0, 0, 0, 0, 1, 2]), torch.arange(6)])
    cache = target.new_cache(2, 16)
    out = target.forward_block(cache, ids, positions, valid=valid, logits="last").logits
    assert torch.allclose(out[0, -1], target.model(input_ids=short[None]).logits[0, -1], atol=1e-4)
    assert torch.allclose(out[1, -1], target.model(input_ids=long[None]).logits[0, -1], atol=1e-4)


def test_layer_ids_follow_hidden_states_convention(tiny_target):
    target = tiny_target
    ids = torch.randint(6, target.vocab_size, (1, 6))
    feats = target.features(ids, None, [0, 1, target.num_layers])
    out = target.model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(feats[0], target.embed_tokens(ids))               # 0 = embeddings
    assert torch.allclose(feats[1], out.hidden_states[1])                # i = input of decoder layer i
    logits = target.compute_logits(feats[target.num_layers])             # N = after the final norm
    assert torch.allclose(logits, out.logits, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        target.check_layer_ids([0, target.num_layers + 1])


def test_float16_on_a_cpu_packs_weights_for_small_blocks_only(tiny_target_dir):
    """dtype float16 on a CPU: blocks of at most 16 tokens use fp16 weights (close to fp32), larger
    ones the fp32 weights (identical to an fp32 target); the identity is the fp32 target's."""
    from draftsmith.heads.runtime.cpu_linear import PackedLinear, fbgemm_fp16_available
    if not fbgemm_fp16_available():
        pytest.skip("this PyTorch build has no FBGEMM fp16 GEMM (non-x86): float16 falls back to fp32 there")
    fp32 = Target.load(str(tiny_target_dir), "float32", "cpu")
    packed = Target.load(str(tiny_target_dir), "float16", "cpu")
    assert packed.precision.startswith("float16") and packed.identity == fp32.identity
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == 7 * fp32.num_layers + 1
    ids = torch.randint(3, fp32.vocab_size, (1, 24))

    def logits(target, n):
        cache = target.new_cache(1, 32)
        return target.forward_block(cache, ids[:, :n], torch.arange(n)[None]).logits
    assert torch.equal(logits(packed, 24), logits(fp32, 24))                  # large block: the fp32 weights
    small, reference = logits(packed, 5), logits(fp32, 5)
    assert not torch.equal(small, reference)                                  # small block: the fp16 weights ...
    assert (small - reference).abs().max() <= 2e-2 * reference.abs().max()     # ... close to fp32


def test_a_packed_linear_warns_nothing_and_keeps_dtype_and_shape():
    """The deprecation warning PyTorch gives once per process is spent when a PackedLinear is built, so
    forward runs without a catch_warnings per call; activations that are not fp32, or not contiguous, are
    converted in and back out."""
    import warnings
    from draftsmith.heads.runtime.cpu_linear import PackedLinear, fbgemm_fp16_available
    if not fbgemm_fp16_available():
        pytest.skip("no FBGEMM fp16 GEMM in this PyTorch build")
    linear = torch.nn.Linear(16, 24)
    packed = PackedLinear(linear)
    x = torch.randn(2, 3, 32)[..., ::2]                                    # [2, 3, 16], not contiguous
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = packed(x)
        half = packed(x.to(torch.bfloat16))
    assert not caught
    assert out.shape == (2, 3, 24) and out.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert torch.allclose(out, linear(x), atol=2e-2)

def test_a_medusa_drafter_decoding_beside_a_packed_target_saves_only_its_weights(tiny_target_dir, tmp_path):
    from draftsmith.heads.runtime.cpu_linear import fbgemm_fp16_available
    from draftsmith.heads.drafter import load_drafter, save_drafter
    from draftsmith.heads.medusa import Medusa, MedusaConfig
    if not fbgemm_fp16_available():
        pytest.skip("no FBGEMM fp16 GEMM in this PyTorch build")
    packed = Target.load(str(tiny_target_dir), "float16", "cpu")
    drafter = Medusa(MedusaConfig(num_heads=2, lm_head="shared"), packed)
    with torch.no_grad():
        fast = drafter.head_logits(torch.randn(1, packed.hidden_size))              # the packed head is built
    assert drafter.__dict__.get("_packed_head") is not None
    reference = drafter.head_logits(torch.randn(1, packed.hidden_size))             # grad on: the fp32 path
    assert fast.shape == reference.shape
    save_drafter(drafter, tmp_path / "ckpt")
    assert set(load_drafter(tmp_path / "ckpt", packed).state_dict()) == set(drafter.state_dict())
