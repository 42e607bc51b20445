"""Lossless means lossless: greedy speculative output == plain greedy; sampling keeps the target's distribution."""

import pytest
import torch
from draftsmith.heads.decoding import acceptance
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.medusa import Medusa, MedusaConfig
from draftsmith.heads.decoding.tree import DraftTree, TreeShape, all_paths
from conftest import OracleDrafter, RandomDrafter, chi_square_p_value, exact_two_token_distribution, prompts, sample_pairs


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


# Fixed logits: a Markov "target" over 12 tokens (the next token's logits depend on the last token only), so the
# exact distribution of the first two tokens after the root is known in closed form and each run costs a few
# acceptance calls instead of model forwards: 20,000 runs in seconds, for every proposal shape and rule.

VOCAB = 12


def markov_table(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=g) * 1.5          # row x: the target's logits after token x


def chain_proposal(q, g):
    tokens = torch.multinomial(q, 2, replacement=True, generator=g)
    return DraftTree(tokens=tokens, parents=torch.tensor([-1, 0]), draft_probs=q.expand(2, -1))


def tree_proposal(q, g):
    top = q.topk(3).indices                           # 3 candidates at depth 1, 2 under the first
    return DraftTree(tokens=torch.cat([top, top[:2]]), parents=torch.tensor([-1, -1, -1, 0, 0]))


def fixed_logit_pairs(table, root, propose, runs, temperature, top_p=1.0, rule="auto", seed=1234):
    """Counts [v, v] of the first two tokens emitted after `root` by repeated verification steps."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 2, -1)   # the drafter: wrong
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(runs):
        emitted, last = [], root
        while len(emitted) < 2:
            tree = propose(q, g)
            logits = torch.stack([table[last]] + [table[t] for t in tree.tokens.tolist()])
            verdict = acceptance.accept(tree, logits, temperature, top_p, rule=rule, generator=g)
            emitted += [int(tree.tokens[c]) for c in verdict.path] + [verdict.bonus]
            last = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    return counts


def markov_pair_distribution(table, root, temperature, top_p=1.0):
    from draftsmith.heads.decoding.sampling import probabilities

    return probabilities(table[root], temperature, top_p)[:, None] * probabilities(table, temperature, top_p)


@pytest.mark.slow                 # thousands of samples: a distribution test
@pytest.mark.parametrize("propose", [chain_proposal, tree_proposal], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature,top_p", [(0.8, 1.0), (1.3, 0.9)])
def test_rejection_sampling_keeps_the_target_distribution_on_fixed_logits(propose, temperature, top_p):
    table = markov_table()
    counts = fixed_logit_pairs(table, 4, propose, 20000, temperature, top_p)
    assert chi_square_p_value(counts, markov_pair_distribution(table, 4, temperature, top_p)) > 1e-3


@pytest.mark.slow                 # thousands of samples: a distribution test
@pytest.mark.parametrize("propose", [chain_proposal, tree_proposal], ids=["chain", "tree"])
def test_the_fixed_logit_test_detects_lossy_rules(propose):
    """Negative control: typical acceptance is not lossless, and the same test must say so."""
    table = markov_table()
    expected = markov_pair_distribution(table, 4, 0.8)
    counts = fixed_logit_pairs(table, 4, propose, 20000, 0.8, rule="typical")
    assert chi_square_p_value(counts, expected) < 1e-3


@pytest.mark.slow                 # thousands of samples: a distribution test
def test_the_fixed_logit_test_detects_a_drafter_that_misreports_q():
    """A drafter that samples from q but reports another q' (a real bug: probabilities from the wrong
    temperature) makes rejection sampling lossy; the same test must say so."""
    table = markov_table()
    expected = markov_pair_distribution(table, 4, 0.8)

    def misreported(q, g):
        tree = chain_proposal(q, g)
        return DraftTree(tokens=tree.tokens, parents=tree.parents, draft_probs=torch.full((2, VOCAB), 1 / VOCAB))

    counts = fixed_logit_pairs(table, 4, misreported, 20000, 0.8)
    assert chi_square_p_value(counts, expected) < 1e-3


@pytest.mark.slow                 # thousands of samples: a distribution test
@pytest.mark.parametrize("shape", ["tree"])
def test_speculative_sampling_keeps_the_target_distribution(small_vocab_target, shape):
    target = small_vocab_target
    target.eos_token_ids = []                     # two tokens always: the test looks at both
    prompt = [7, 9, 11]
    temperature = 0.8
    expected = exact_two_token_distribution(target, prompt, temperature)
    counts = sample_pairs(target, RandomDrafter(target.vocab_size, shape), prompt, 3000, temperature)
    assert chi_square_p_value(counts, expected) > 1e-3
