"""Lossless means lossless: greedy speculative output == plain greedy; sampling keeps the target's distribution."""

import pytest
import torch
from draftsmith.eval import acceptance
from draftsmith.eval.verifier import decode
from draftsmith.heads.medusa import Medusa, MedusaConfig
from draftsmith.heads.tree import DraftTree, TreeShape, all_paths


class OracleDrafter:
    """Proposes the target's own greedy continuation: every draft is accepted (tau = K + 1)."""

    required_layers = ()

    def __init__(self, target, depth):
        self.target, self.depth = target, depth
        self.sequence: list[int] = []

    def reset(self):
        self.sequence = []

    def propose(self, context):
        self.sequence += context.tokens.tolist()
        continuation = decode(self.target, self.sequence + [context.next_token], self.depth + 1).tokens
        proposal = continuation[: self.depth]
        return DraftTree(tokens=torch.tensor(proposal), parents=torch.arange(len(proposal)) - 1)


def prompts(target, count=4, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, target.vocab_size, (length,), generator=g).tolist() for _ in range(count)]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_untrained_medusa_is_exact(tiny_target, shape):
    torch.manual_seed(0)
    drafter = Medusa(MedusaConfig(num_heads=3), tiny_target)
    for block in drafter.blocks:              # random (not identity) heads: some drafts right, most wrong
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
    drafter.set_proposal(chain=3) if shape == "chain" else drafter.set_proposal(tree=TreeShape(all_paths(3, 2)))
    total_accepted = 0
    for prompt in prompts(tiny_target):
        plain = decode(tiny_target, prompt, 40)
        spec = decode(tiny_target, prompt, 40, drafter=drafter)
        assert spec.tokens == plain.tokens
        total_accepted += sum(spec.accepted)
    assert total_accepted > 0        # the check exercised accepted drafts, not only rejections


def test_oracle_drafter_reaches_k_plus_one(tiny_target):
    depth = 4
    oracle = OracleDrafter(tiny_target, depth)
    for prompt in prompts(tiny_target, count=2):
        plain = decode(tiny_target, prompt, 33)
        spec = decode(tiny_target, prompt, 33, drafter=oracle)
        assert spec.tokens == plain.tokens
        if len(plain.tokens) == 33:                       # no early stop: every full step emitted K + 1
            assert spec.accepted[:-1] == [depth] * (len(spec.accepted) - 1)
            assert len(spec.accepted) == 7                # 1 (prefill) + 32 tokens / 5 per step, rounded up


def test_greedy_rule_follows_the_argmax():
    logits = torch.full((4, 8), -5.0)
    # rows: after the root, after node 0, after node 1, after node 2.  The target says 3, (1), 5, 7:
    # node 1 (3) under the root is right, node 2 (5) under node 1 is right, then the target adds 7.
    logits[0, 3] = logits[1, 1] = logits[2, 5] = logits[3, 7] = 5.0
    tree = DraftTree(tokens=torch.tensor([2, 3, 5]), parents=torch.tensor([-1, -1, 1]))
    verdict = acceptance.greedy(tree, logits)
    assert verdict.path == [1, 2] and verdict.bonus == 7


# -- sampling -----------------------------------------------------------------------------------------------

def exact_two_token_distribution(target, prompt, temperature):
    """P(x1, x2 | prompt) by enumeration: [v, v]."""
    from draftsmith.heads.sampling import probabilities

    v = target.vocab_size
    with torch.no_grad():
        p1 = probabilities(target.model(input_ids=torch.tensor([prompt])).logits[0, -1], temperature)
        batch = torch.tensor([prompt + [x] for x in range(v)])
        p2 = probabilities(target.model(input_ids=batch).logits[:, -1], temperature)
    return p1[:, None] * p2


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test, cells with expected count < 5 pooled; p from the regularized upper incomplete gamma."""
    n = counts.sum()
    expected = expected_probs.flatten() * n
    counts = counts.flatten().double()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


class RandomDrafter:
    """Proposes from a fixed, wrong distribution q: as a chain of i.i.d. samples with q attached (classic rule),
    or as a top-k tree (point-mass rule)."""

    required_layers = ()

    def __init__(self, vocab, shape, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
        self.shape = shape
        self.g = torch.Generator().manual_seed(seed + 1)

    def reset(self):
        pass

    def propose(self, context):
        if self.shape == "chain":
            tokens = torch.multinomial(self.q, 2, replacement=True, generator=self.g)
            return DraftTree(tokens=tokens, parents=torch.tensor([-1, 0]), draft_probs=self.q.expand(2, -1))
        top = self.q.topk(3).indices              # 3 candidates at depth 1, 2 under the first
        return DraftTree(tokens=torch.cat([top, top[:2]]), parents=torch.tensor([-1, -1, -1, 0, 0]))


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    from conftest import build_tiny_target
    from draftsmith.heads.target import Target

    directory = build_tiny_target(tmp_path_factory.mktemp("tiny-vocab"), seed=3, vocab_size=12, sharpen=1.5)
    return Target.load(str(directory), "float32")


def sample_pairs(target, drafter, prompt, runs, temperature, rule="auto"):
    v = target.vocab_size
    counts = torch.zeros(v, v)
    g = torch.Generator().manual_seed(1234)
    for _ in range(runs):
        out = decode(target, prompt, 2, drafter=drafter, temperature=temperature, rule=rule, generator=g)
        counts[out.tokens[0], out.tokens[1]] += 1
    return counts


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_speculative_sampling_keeps_the_target_distribution(small_vocab_target, shape):
    target = small_vocab_target
    target.eos_token_ids = []                     # two tokens always: the test looks at both
    prompt = [7, 9, 11]
    temperature = 0.8
    expected = exact_two_token_distribution(target, prompt, temperature)
    counts = sample_pairs(target, RandomDrafter(target.vocab_size, shape), prompt, 3000, temperature)
    assert chi_square_p_value(counts, expected) > 1e-3


def test_the_sampling_test_detects_a_lossy_rule(small_vocab_target):
    """Negative control: typical acceptance is not lossless, and the same test must say so."""
    target = small_vocab_target
    target.eos_token_ids = []
    prompt = [7, 9, 11]
    expected = exact_two_token_distribution(target, prompt, 0.8)
    counts = sample_pairs(target, RandomDrafter(target.vocab_size, "tree"), prompt, 3000, 0.8, rule="typical")
    assert chi_square_p_value(counts, expected) < 1e-3
