"""The fused soft cross-entropy, and the EAGLE-3 loss built on it, against the plain formulas."""
import pytest
import torch
from conftest import prompts
from draftsmith.heads import soft_loss
from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
from draftsmith.heads.soft_loss import soft_cross_entropy


def plain(logits, probs, weight):
    log_q = torch.log_softmax(logits.float(), dim=-1)
    return -(probs * log_q).sum(-1) * weight, log_q.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_soft_cross_entropy_equals_the_plain_formula(dtype, monkeypatch):
    monkeypatch.setattr(soft_loss, "CHUNK_ROWS", 3)                   # several chunks and a ragged last one
    torch.manual_seed(0)
    logits = (torch.randn(10, 33) * 3).to(dtype).requires_grad_()
    probs = torch.softmax(torch.randn(10, 33) * 2, dim=-1)
    weight = torch.tensor([1.0, 0, 1, 1, 0.5, 1, 1, 0, 1, 1])
    upstream = torch.randn(10)
    fused, top = soft_cross_entropy(logits, probs, weight)
    (fused * upstream).sum().backward()
    fused_grad, logits.grad = logits.grad.clone(), None
    expected, expected_top = plain(logits, probs, weight)
    (expected * upstream).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(fused, expected, atol=tolerance) and torch.equal(top, expected_top)
    assert fused_grad.dtype == dtype
    assert torch.allclose(fused_grad.float(), logits.grad.float(), atol=tolerance)


def test_fused_soft_cross_entropy_passes_gradcheck():
    torch.manual_seed(1)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(5, 7, dtype=torch.float64), -1) * 0.9    # a sum other than 1 as well
    weight = torch.rand(5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, probs, weight)[0], (logits,))


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="differ in shape"):
        soft_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 4))


def test_eagle3_loss_equals_the_position_by_position_definition(tiny_target):
    """Step s scores the drafter at t against the target at t+1+s, over draft-vocabulary tokens, weighed
    decay**s, masked where the target's top token is outside the draft vocabulary; rows right-padded."""
    torch.manual_seed(0)
    drafter = Eagle3(Eagle3Config(draft_vocab_size=40, layer_ids=[0, 1, 2], ttt_steps=3), tiny_target)
    ids = torch.tensor(prompts(tiny_target, count=2, length=14))
    attention = torch.ones_like(ids)
    attention[1, 11:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 5:] = 1
    loss_mask[1, 7:11] = 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
             "features": tiny_target.features(ids, attention, drafter.required_layers)}
    # a draft vocabulary holding the target's top token at some positions and not at others
    tops = tiny_target.compute_logits(batch["features"][tiny_target.num_layers]).argmax(-1).unique()
    others = torch.tensor([i for i in range(tiny_target.vocab_size) if i not in tops.tolist()])
    drafter.set_draft_vocabulary(torch.cat([tops[::2], others[: 40 - len(tops[::2])]]).sort().values)
    result = drafter.loss(batch)
    result.loss.backward()
    fused_grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
    drafter.zero_grad()

    final = batch["features"][tiny_target.num_layers]
    total, correct, counted, included = 0.0, [0] * 3, [0] * 3, 0
    hiddens = list(drafter.unroll(batch))
    draft_to_target = drafter.draft_to_target
    in_draft = torch.zeros(tiny_target.vocab_size, dtype=torch.bool)
    in_draft[draft_to_target] = True
    for step, hidden in enumerate(hiddens):
        count = int(loss_mask[:, 2 + step:].sum())
        for b in range(2):
            for t in range(ids.shape[1]):
                j = t + 1 + step
                if j + 1 >= ids.shape[1] or not loss_mask[b, j + 1]:
                    continue
                logits = tiny_target.compute_logits(final[b, j]).float()
                p = torch.softmax(logits[draft_to_target], -1)
                ok = bool(in_draft[logits.argmax()])
                included += ok
                log_q = torch.log_softmax(drafter.logits(hidden[b, t]).float(), -1)
                total = total + 0.8 ** step * (-(p * log_q).sum() * ok) / count
                correct[step] += int(ok and log_q.argmax() == p.argmax())
                counted[step] += 1
    total.backward()
    assert torch.allclose(result.loss, total.detach(), rtol=1e-5)
    assert result.correct.tolist() == correct and result.counted.tolist() == counted
    assert 0 < included < sum(counted)           # both sides of the in-vocabulary mask were exercised
    plain_grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert len(plain_grads) == len(fused_grads) > 0
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(fused_grads, plain_grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_hard_cross_entropy_equals_f_cross_entropy(dtype, monkeypatch):
    """Medusa's loss: per-row loss, argmax and gradient against F.cross_entropy on fp32 copies, over
    ragged chunks, with rows weighted out (weight 0) as unscored positions are."""
    from draftsmith.heads.soft_loss import hard_cross_entropy

    monkeypatch.setattr(soft_loss, "CHUNK_ROWS", 3)
    torch.manual_seed(2)
    logits = (torch.randn(10, 33) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 33, (10,))
    weight = torch.tensor([1.0, 0, 1, 1, 1, 1, 0, 0, 1, 1])
    upstream = torch.randn(10)
    fused, top = hard_cross_entropy(logits, labels, weight)
    (fused * upstream).sum().backward()
    fused_grad, logits.grad = logits.grad.clone(), None
    expected = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none") * weight
    (expected * upstream).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(fused, expected, atol=tolerance)
    assert torch.equal(top, logits.float().argmax(-1))
    assert fused_grad.dtype == dtype and torch.allclose(fused_grad.float(), logits.grad.float(), atol=tolerance)
    with pytest.raises(ValueError, match="do not match"):
        hard_cross_entropy(logits, labels[:4])


def test_fused_hard_cross_entropy_passes_gradcheck():
    from draftsmith.heads.soft_loss import hard_cross_entropy

    torch.manual_seed(3)
    logits = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (6,))
    weight = torch.rand(6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda z: hard_cross_entropy(z, labels, weight)[0], (logits,))


def test_acceptance_losses_are_one_minus_and_minus_log_of_the_acceptance_probability():
    from draftsmith.heads.soft_loss import acceptance_loss

    torch.manual_seed(0)
    logits = torch.randn(5, 7, requires_grad=True)
    p = torch.softmax(torch.randn(5, 7), dim=-1)
    accepted = torch.minimum(torch.softmax(logits, -1), p).sum(-1)
    tv, top = acceptance_loss(logits, p, None, "tv")
    lk, _ = acceptance_loss(logits, p, torch.ones(5), "lk")
    assert torch.allclose(tv, 1 - accepted) and torch.allclose(lk, -accepted.log())
    assert torch.allclose(tv, 0.5 * (torch.softmax(logits, -1) - p).abs().sum(-1))     # the TV distance
    assert torch.equal(top, logits.argmax(-1))
    lk.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    same, _ = acceptance_loss(p.log(), p, None, "tv")
    assert same.abs().max() < 1e-6                                   # q = p: every draft accepted
    with pytest.raises(ValueError, match="drafter.loss must be one of soft_ce, tv, lk"):
        acceptance_loss(logits, p, None, "kl")


@pytest.mark.parametrize("loss", ["tv", "lk"])
def test_an_eagle3_drafter_trains_with_an_acceptance_loss(tiny_target, loss):
    from draftsmith.heads.eagle3 import Eagle3, Eagle3Config

    torch.manual_seed(0)
    drafter = Eagle3(Eagle3Config(layer_ids=[0, 1, 2], draft_vocab_size=None, ttt_steps=2, loss=loss), tiny_target)
    ids = torch.randint(6, tiny_target.vocab_size, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(15):
        optimizer.zero_grad()
        out = drafter.loss(batch).loss
        first = float(out) if first is None else first
        out.backward()
        optimizer.step()
    assert float(drafter.loss(batch).loss) < first
    with pytest.raises(ValueError, match="drafter.loss"):
        Eagle3Config(loss="mse")
