"""The drafter contract (heads/contract.py) and the declared layouts (export/layouts.py)."""
import pytest
import torch
from draftsmith.export.layouts import RULES, layout, names
from draftsmith.heads.contract import DrafterContract, Proposer
from draftsmith.heads.drafter import describe, registry

SETTINGS = {"medusa": [{"num_heads": 2}, {"num_heads": 3, "lm_head": "own", "num_layers": 2, "draft_vocab_size": 24},
                       {"num_heads": 2, "conditioning": "path"}],
            "medusa2": [{"num_heads": 2}],
            "eagle": [{}, {"draft_vocab_size": 30}],
            "eagle3": [{"layer_ids": [1, 1, 2], "draft_vocab_size": 40}, {"draft_vocab_size": None}]}


def cases():
    return [(kind, s) for kind in registry() for s in SETTINGS[kind]]


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


@pytest.mark.parametrize("kind,fmt", sorted(RULES))
def test_format_names_are_one_to_one_and_cover_the_layout(tiny_target, kind, fmt):
    cls = registry()[kind]
    settings = {"medusa": {"num_heads": 3, "num_layers": 2, "lm_head": "own"},
                "eagle3": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40}}[kind]
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


# which folders each folder may import from (docs/design.md, "Layout and data flow")
ALLOWED = {"heads": {"heads"}, "export": {"heads", "export"}, "data": {"heads", "data"},
           "train": {"heads", "data", "export", "train"}, "eval": {"heads", "data", "export", "eval"}}


def test_the_import_rules_of_the_layout_hold():
    import ast
    from pathlib import Path

    import draftsmith.heads

    root = Path(draftsmith.heads.__file__).resolve().parents[1]        # the checkout, or site-packages/draftsmith
    broken = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith."):
                    used = node.module.split(".")[1]
                    if used in ALLOWED and used not in allowed:
                        broken.append(f"{folder}/{path.name}: {node.module}")
    assert not broken
