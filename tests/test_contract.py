"""The drafter contract (heads/contract.py) and the declared layouts and formats (heads/formats.py).
The import rules of the layout are in tests/test_layout.py."""
import pytest
import torch
from draftsmith.heads.contract import DrafterContract, Proposer
from draftsmith.heads.drafter import describe
from draftsmith.heads.formats import layout, names
from draftsmith.heads.registry import registry

SHIPPED = ("medusa", "medusa2", "eagle", "eagle3", "p_eagle", "dflash", "dspark")       # a drafter added to heads/ must get a row in SETTINGS

SETTINGS = {"medusa": [{"num_heads": 2}, {"num_heads": 3, "lm_head": "own", "num_layers": 2, "draft_vocab_size": 24},
                       {"num_heads": 2, "conditioning": "path"}],
            "medusa2": [{"num_heads": 2}],
            "eagle": [{}, {"draft_vocab_size": 30}],
            "eagle3": [{"layer_ids": [1, 1, 2], "draft_vocab_size": 40}, {"draft_vocab_size": None}],
            "p_eagle": [{"layer_ids": [1, 1, 2], "draft_vocab_size": 40, "ttt_steps": 3,
                         "tree": {"depth": 3, "top_k": 2, "total_tokens": 5}}],
            "dflash": [{"layer_ids": [1, 2], "draft_vocab_size": 40, "num_layers": 2},
                       {"draft_vocab_size": None, "block_size": 3, "tree": {"depth": 2, "top_k": 2, "total_tokens": 4}}],
            "dspark": [{"layer_ids": [1, 2], "draft_vocab_size": 40, "num_layers": 2, "markov_rank": 8},
                       {"draft_vocab_size": None, "block_size": 3, "markov_rank": 0, "confidence_with_markov": False,
                        "sample_from_anchor": False},
                       {"markov_rank": 4, "draft_vocab_size": 40, "confidence_head": False, "confidence_threshold": None}]}


def cases():
    return [(kind, s) for kind in SHIPPED for s in SETTINGS[kind]]


def test_the_registry_finds_every_shipped_drafter():
    kinds = registry()
    assert set(SHIPPED) <= set(kinds)
    assert all(kinds[k].kind == k and kinds[k].title for k in SHIPPED)


def format_cases():
    return sorted((kind, f.name) for kind in SHIPPED for f in vars(registry()[kind]).get("formats", ()))


@pytest.mark.parametrize("kind,settings", cases(), ids=[f"{k}-{i}" for i, (k, _) in enumerate(cases())])
def test_every_drafter_keeps_the_contract_and_its_declared_layout(tiny_target, kind, settings):
    cls = registry()[kind]
    drafter = cls(cls.config_class(**settings), tiny_target)
    assert isinstance(drafter, DrafterContract) and isinstance(drafter, Proposer)
    declared = layout(describe(drafter))
    actual = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert declared == actual
    groups = drafter.param_groups(1e-3)
    trainable = {id(p) for p in drafter.parameters() if p.requires_grad}
    assert {id(p) for g in groups for p in g["params"]} == trainable


def test_a_drafter_missing_a_member_breaks_the_contract():
    class Half:
        required_layers = ()

        def reset(self):
            pass

        def propose(self, context):
            return None

    assert not isinstance(Half(), Proposer)          # no observe
    assert not isinstance(Half(), DrafterContract)


@pytest.mark.parametrize("kind,fmt", format_cases())
def test_format_names_are_one_to_one_and_cover_the_layout(tiny_target, kind, fmt):
    cls = registry()[kind]
    settings = {"medusa": {"num_heads": 3, "num_layers": 2, "lm_head": "own"},
                "eagle3": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40},
                "p_eagle": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40},
                "dflash": {"layer_ids": [1, 2], "draft_vocab_size": 40, "num_layers": 2},
                "dspark": {"layer_ids": [1, 2], "draft_vocab_size": 40, "num_layers": 2, "markov_rank": 8}}[kind]
    config = describe(cls(cls.config_class(**settings), tiny_target))
    mapping = names(config, fmt)
    assert len(set(mapping.values())) == len(mapping)
    assert set(mapping) == set(layout(config)) - {"draft_to_target"}


def test_vocabulary_maps_follow_the_module_and_are_never_saved(tiny_target):
    cls = registry()["eagle3"]
    drafter = cls(cls.config_class(layer_ids=[1, 1, 2], draft_vocab_size=40), tiny_target)
    drafter.set_draft_vocabulary(torch.arange(40) * 3)
    assert "target_to_draft" not in drafter.state_dict()
    assert int(drafter.target_to_draft[9]) == 3 and int(drafter.target_to_draft[10]) == -1
    fresh = cls(cls.config_class(layer_ids=[1, 1, 2], draft_vocab_size=40), tiny_target)
    fresh.load_state_dict(drafter.state_dict())
    assert torch.equal(fresh.target_to_draft, drafter.target_to_draft)
    moved = fresh.to(torch.float64)
    assert moved.target_to_draft.dtype == torch.long
