"""Conditioned Medusa heads (drafter.conditioning): 'root' reads the token the target just chose, 'path' also
the tokens drafted before each head.  They start as plain Medusa, train, stay exact, and draft what they learn."""

import pytest
import torch
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import DraftContext, load_drafter, save_drafter
from draftsmith.heads.medusa import Medusa, MedusaConfig
from draftsmith.heads.decoding.tree import TreeShape, all_paths
from conftest import prompts


def batch(target, seed=0, b=2, s=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, target.vocab_size, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.long)
    mask[:, 4:] = 1
    return {"input_ids": ids, "loss_mask": mask,
            "features": target.features(ids, torch.ones_like(ids), (target.num_layers,))}


def randomised(target, conditioning, heads=3):
    torch.manual_seed(0)
    drafter = Medusa(MedusaConfig(num_heads=heads, conditioning=conditioning), target)
    for module in [*drafter.token_proj, *(block[0].linear for block in drafter.blocks)]:
        torch.nn.init.normal_(module.weight, std=0.5)
    return drafter


@pytest.mark.parametrize("conditioning", ["root", "path"])
def test_conditioned_heads_start_as_medusa_and_train_their_projections(tiny_target, conditioning):
    torch.manual_seed(0)
    drafter = Medusa(MedusaConfig(num_heads=3, conditioning=conditioning), tiny_target)
    plain = Medusa(MedusaConfig(num_heads=3), tiny_target)
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("token_proj")})
    data = batch(tiny_target)
    assert torch.allclose(drafter.loss(data).loss, plain.loss(data).loss)       # zero init: plain Medusa
    drafter.loss(data).loss.backward()
    assert len(drafter.token_proj) == (1 if conditioning == "root" else 3)
    assert all(proj.weight.grad.abs().sum() > 0 for proj in drafter.token_proj)


def test_path_heads_draft_what_they_score_teacher_forced(tiny_target):
    """Level by level, each drafted token is the argmax of its head fed the path above it, as in training."""
    drafter = randomised(tiny_target, "path")
    drafter.set_proposal(chain=3)
    g = torch.Generator().manual_seed(0)
    blind = 0                     # contexts where a head fed the root alone would have drafted otherwise
    for _ in range(16):
        hidden = torch.randn(4, tiny_target.hidden_size, generator=g)
        root = int(torch.randint(6, tiny_target.vocab_size, (), generator=g))
        context = DraftContext(tokens=torch.tensor([5, 6, 7, 8]), hidden={tiny_target.num_layers: hidden},
                               next_token=root, position=4)
        chain = drafter.propose(context).tokens.tolist()
        logits = drafter.head_logits(hidden[-1:], torch.tensor([[root] + chain]))[:, 0]     # [k, v] teacher-forced
        assert chain == drafter.draft_to_target[logits.argmax(-1)].tolist()
        rootless = drafter.head_logits(hidden[-1:], torch.tensor([[root, 0, 0, 0]]))[:, 0]
        blind += int(rootless[1:].argmax(-1).tolist() != logits[1:].argmax(-1).tolist())
        other = drafter.head_logits(hidden[-1:], torch.tensor([[root, (chain[0] + 1) % 50] + chain[1:]]))[:, 0]
        assert torch.equal(other[0], logits[0]) and not torch.allclose(other[1], logits[1])  # head 1 reads t+2
    assert blind > 0              # the drafted path changed what the deeper heads chose: the check above can fail


@pytest.mark.parametrize("conditioning", ["root", "path"])
def test_conditioned_heads_are_exact_and_survive_a_checkpoint(tiny_target, tmp_path, conditioning):
    drafter = randomised(tiny_target, conditioning)
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt", tiny_target)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(loaded.token_proj, drafter.token_proj))
    accepted = 0
    for shape in (TreeShape.chain(3), TreeShape(all_paths(3, 2))):
        loaded.set_proposal(tree=shape)
        for prompt in prompts(tiny_target, count=3):
            spec = decode(tiny_target, prompt, 30, drafter=loaded)
            assert spec.tokens == decode(tiny_target, prompt, 30).tokens
            accepted += sum(spec.accepted)
    assert accepted > 0
