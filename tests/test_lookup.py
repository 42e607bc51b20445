"""Context lookup merged into a drafter's tree: what it proposes, how it merges, and that it stays lossless."""

import pytest
import torch
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.decoding.lookup import WithLookup, lookup, merge_chain
from draftsmith.heads.medusa import Medusa, MedusaConfig
from draftsmith.heads.decoding.tree import DraftTree, TreeShape, all_paths
from conftest import RandomDrafter, chi_square_p_value, exact_two_token_distribution


def test_lookup_copies_what_followed_the_latest_longest_match():
    history = [5, 6, 7, 8, 1, 6, 7, 9, 2, 3, 6, 7]
    assert lookup(history, 2) == [9, 2]                  # "6 7" last seen before 9; the 3-gram "3 6 7" is new
    assert lookup([4, 5, 8, 3, 5, 9, 4, 5], 1, max_ngram=1) == [9]   # the latest earlier "5"
    assert lookup([1, 2, 3, 4, 2, 3], 3) == [4, 2, 3]    # at most what follows, and up to `length`
    assert lookup([1, 2, 3], 3) == []                    # no earlier occurrence of 3
    assert lookup([4, 5, 8, 3, 5, 9, 4, 5], 1) == [8]   # the 2-gram "4 5" wins over the later 1-gram "5"
    assert lookup([4, 5, 4], 3, min_ngram=2) == []


def test_merge_chain_reuses_the_nodes_it_shares_with_the_tree():
    tree = DraftTree(tokens=torch.tensor([10, 11, 12]), parents=torch.tensor([-1, -1, 0]))    # 10 -> 12, and 11
    merged, added = merge_chain(tree, [10, 12, 13, 14])
    assert added == 2
    assert merged.tokens.tolist() == [10, 11, 12, 13, 14]
    assert merged.parents.tolist() == [-1, -1, 0, 2, 3]
    assert merge_chain(tree, [11])[1] == 0 and merge_chain(tree, [])[1] == 0
    merged, added = merge_chain(tree, [12, 10])           # a new branch under the root
    assert added == 2 and merged.parents.tolist() == [-1, -1, 0, -1, 3]


def test_greedy_output_with_the_lookup_is_plain_greedy_and_accepts_from_both(tiny_target):
    torch.manual_seed(0)
    drafter = Medusa(MedusaConfig(num_heads=3), tiny_target)
    for block in drafter.blocks:
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
    drafter.set_proposal(tree=TreeShape(all_paths(2, 2)))
    merged = WithLookup(drafter, length=4)
    g = torch.Generator().manual_seed(0)
    total = 0
    for _ in range(4):
        pattern = torch.randint(6, tiny_target.vocab_size, (5,), generator=g).tolist()
        prompt = pattern * 3                                      # repeats: the lookup has something to copy
        plain = decode(tiny_target, prompt, 40)
        spec = decode(tiny_target, prompt, 40, drafter=merged)
        assert spec.tokens == plain.tokens
        total += sum(spec.accepted)
    assert merged.accepted["lookup"] > 0 and sum(merged.accepted.values()) == total


class SilentDrafter:
    """Proposes nothing: whatever is accepted, the lookup proposed."""

    required_layers = ()

    def reset(self):
        pass

    def observe(self, path):
        pass

    def propose(self, context):
        return DraftTree(tokens=torch.zeros(0, dtype=torch.long), parents=torch.zeros(0, dtype=torch.long))

    def describe_proposal(self):
        return "nothing"


def test_accepted_tokens_are_credited_to_whoever_proposed_them(tiny_target):
    merged = WithLookup(SilentDrafter(), length=4)
    prompt = [7, 8, 9, 10, 11] * 3
    spec = decode(tiny_target, prompt, 40, drafter=merged)
    assert spec.tokens == decode(tiny_target, prompt, 40).tokens
    assert merged.accepted == {"drafter": 0, "lookup": sum(spec.accepted)} and sum(spec.accepted) > 0


@pytest.mark.slow                 # thousands of samples: a distribution test
def test_sampling_with_the_lookup_keeps_the_target_distribution(small_vocab_target):
    target = small_vocab_target
    target.eos_token_ids = []
    prompt = [7, 9, 11, 7, 9]                  # the lookup proposes 11, 7, 9 after the root
    expected = exact_two_token_distribution(target, prompt, 0.8)
    drafter = WithLookup(RandomDrafter(target.vocab_size, "tree"), length=3)
    counts = torch.zeros(target.vocab_size, target.vocab_size)
    g = torch.Generator().manual_seed(1234)
    for _ in range(3000):
        out = decode(target, prompt, 2, drafter=drafter, temperature=0.8, generator=g)
        counts[out.tokens[0], out.tokens[1]] += 1
    assert chi_square_p_value(counts, expected) > 1e-3
    assert drafter.accepted["lookup"] > 0


def test_forward_costs_are_fitted_nondecreasing_before_the_tree_is_chosen():
    from draftsmith.eval.proposal import nondecreasing

    assert nondecreasing({1: 30.0, 2: 31.0, 4: 35.0}) == {1: 30.0, 2: 31.0, 4: 35.0}      # already in order
    fitted = nondecreasing({1: 30.0, 5: 36.0, 9: 34.0, 13: 35.0, 17: 40.0})
    assert fitted == pytest.approx({1: 30.0, 5: 35.0, 9: 35.0, 13: 35.0, 17: 40.0})      # 36, 34, 35 pooled
    assert list(fitted.values()) == sorted(fitted.values())
