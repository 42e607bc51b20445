"""The decision rule (eval/decision.py: plain decoding among the choices) and the verdict every evaluation
ends with (eval/verdict.py), issue 58.

The rule is tested against cost curves given to it (a steep one, where no proposal pays, and flat ones, where
a chain does) with a drafter whose acceptance is known (the oracle: every draft accepted); the verdict against
timed prompts whose ratios are known; and both through the real `eval` CLI on a tiny target.
"""
import json
from types import SimpleNamespace

import pytest
from conftest import OracleDrafter, medusa_checkpoint
from draftsmith.eval import decision as decision_module
from draftsmith.eval.verdict import pairs_of, speedup_interval, verdict
from draftsmith.heads.decoding.settings import EvalSettings


class OracleChain(OracleDrafter):
    """The oracle as an eval drafter: chains of any length up to 3, every draft accepted."""

    static_tree = dynamic_tree = False

    def __init__(self, target):
        super().__init__(target, 3)
        self.set_proposal(chain=3)

    def set_proposal(self, chain=None, **shape):
        self.depth = chain or 3
        self.tree = SimpleNamespace(depth=self.depth)

    def describe_proposal(self):
        return f"chain of {self.depth}"


def priced(monkeypatch, curve_ms, draft_ms=1.0):
    """The machine's cost curve T(n) and the proposal's cost D, as given (seconds)."""
    monkeypatch.setattr(decision_module, "block_cost",
                        lambda target, sizes, **_: {n: curve_ms(n) / 1000 for n in sizes})
    monkeypatch.setattr(decision_module, "measure_proposal", lambda *a, **k: draft_ms / 1000)


def decide(tiny_target, prompts, options=None):
    options = options or EvalSettings(max_new_tokens=16)
    decided, proposer = decision_module.decide(OracleChain(tiny_target), tiny_target, options,
                                               [(f"p{i}", p) for i, p in enumerate(prompts)], calibration_tokens=16)
    return decided, proposer, options


@pytest.fixture
def calibration_prompts(tiny_target):
    from conftest import prompts
    return prompts(tiny_target, count=2, length=8)


def test_a_steep_cost_curve_makes_plain_decoding_the_choice(tiny_target, calibration_prompts, monkeypatch):
    """A forward over n tokens costing n times one: even every draft accepted cannot pay for its proposal."""
    priced(monkeypatch, lambda n: 10.0 * n)
    decided, _, options = decide(tiny_target, calibration_prompts)
    assert not decided.on
    plain, *chains = decided.candidates
    assert plain.description == "plain decoding" and plain.predicted_speedup == 1.0
    assert [c.description for c in chains] == ["chain of 1", "chain of 2", "chain of 3"]
    for c in chains:                                     # the oracle: k + 1 tokens a step, short only at the end
        k = c.settings["chain_length"]
        assert c.tokens_per_step == pytest.approx(k + 1, rel=0.25) and c.verified_tokens == k + 1
        assert c.predicted_speedup < 1.0
    assert "no proposal is predicted to beat plain decoding" in decided.notes[0]
    assert options.proposal == "chain"                  # the best speculative one is still decoded and timed


@pytest.mark.parametrize("curve, best", [
    (lambda n: 10.0, 3),                                  # verification is flat: the deepest chain
    (lambda n: 10.0 if n <= 2 else 100.0, 1),             # only two tokens verify cheaply: a chain of 1
])
def test_a_flat_cost_curve_makes_a_chain_the_choice(tiny_target, calibration_prompts, monkeypatch, curve, best):
    priced(monkeypatch, curve)
    decided, proposer, options = decide(tiny_target, calibration_prompts)
    assert decided.on and decided.chosen.settings["chain_length"] == best
    assert options.proposal == "chain" and options.chain_length == best and proposer.depth == best
    ranked = sorted(decided.candidates[1:], key=lambda c: -c.predicted_speedup)
    assert ranked[0] is decided.chosen
    expected = decided.chosen.tokens_per_step * curve(1) / (curve(best + 1) + 1.0)     # S = E T(1) / (T(n) + D)
    assert decided.chosen.predicted_speedup == pytest.approx(expected)


def timed(ratio_by_prompt):
    """Per-prompt rows as evaluate keeps them: plain at 100 tok/s, speculative at `ratio` times that."""
    return [{"mode_tokens": {"plain": 100, "speculative": 100}, "seconds": {"plain": 1.0, "speculative": 1.0 / r}}
            for r in ratio_by_prompt]


def report_of(rows, exact=True, proposal="chain of 2"):
    total = sum(r["seconds"]["plain"] for r in rows) / sum(r["seconds"]["speculative"] for r in rows)
    return SimpleNamespace(speedup_vs_plain=total, per_prompt=rows, prompts=len(rows), greedy_exact=exact,
                           temperature=0.0, proposal=proposal, tau=1.4)


DECIDED_OFF = {"on": False, "chosen": "chain of 2", "forward_ms": {"1": 50.0, "3": 90.0},
               "candidates": [{"proposal": "plain decoding", "verified_tokens": 1.0, "draft_ms": 0.0},
                              {"proposal": "chain of 2", "verified_tokens": 3.0, "draft_ms": 5.0}]}


@pytest.mark.parametrize("ratios, decided, exact, word, reason", [
    ([1.3, 1.25, 1.35, 1.3], None, True, "ON", "switch speculative decoding on here with chain of 2"),
    ([0.8, 0.85, 0.75, 0.8], DECIDED_OFF, True, "OFF", "it is slower than plain decoding"),
    ([0.7, 1.4, 0.8, 1.3], None, True, "OFF", "no measurable gain"),
    ([1.3, 1.25, 1.35], None, True, "OFF", "too few to tell"),
    ([1.3, 1.25, 1.35, 1.3], None, False, "OFF", "NOT exact"),
    ([1.3, 1.25, 1.35, 1.3], DECIDED_OFF, True, "ON", "the measurement, not the prediction, decides"),
])
def test_the_verdict_follows_the_measured_interval(ratios, decided, exact, word, reason):
    said = verdict(report_of(timed(ratios), exact), decided)
    assert said["text"].startswith(f"{word}:") and reason in said["text"], said["text"]
    low, high = said["interval"]
    assert min(ratios) - 1e-9 <= low <= said["speedup"] <= high <= max(ratios) + 1e-9
    if word == "OFF" and decided:
        needed = said["break_even"]["tokens_per_step_needed"]
        assert needed == pytest.approx((90.0 + 5.0) / 50.0) and "Break-even" in said["text"]
        assert said["break_even"]["predicted_where_verification_is_flat"] == pytest.approx(1.4 * 50 / 55)


def test_the_interval_narrows_with_agreeing_prompts():
    wide = speedup_interval(pairs_of(timed([0.7, 1.4, 0.8, 1.3])), 0)
    narrow = speedup_interval(pairs_of(timed([1.04, 1.05, 1.06, 1.05])), 0)
    assert wide[1] - wide[0] > 5 * (narrow[1] - narrow[0])


@pytest.mark.parametrize("curve, word", [(lambda n: 10.0 * n, "OFF")])
def test_eval_prints_the_decision_and_a_verdict(tiny_target, tmp_path, capsys, monkeypatch, curve, word):
    """Through the real CLI: the decision's candidates in eval.json and the report, the verdict last."""
    from draftsmith.cli import main
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    monkeypatch.setattr(decision_module, "block_cost",
                        lambda target, sizes, **_: {n: curve(n) / 1000 for n in sizes})
    code = main(["eval", str(tmp_path / "ckpt"), "--prompts", "mt-bench", "--limit", "4", "--max-new-tokens", "12",
                 "--lookup", "2", "--dtype", "float32", "--exact-prompts", "1", "--json", str(tmp_path / "e.json")])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads((tmp_path / "e.json").read_text())
    proposals = [c["proposal"] for c in report["decision"]["candidates"]]
    assert proposals[0] == "plain decoding" and "chain of 1" in proposals
    assert any("context lookup of 2" in p for p in proposals)
    halved = [c for c in report["decision"]["candidates"] if "context lookup of 1 " in c["proposal"]]
    assert len(halved) == 1 and not any("lookup of 0" in p for p in proposals)     # 2 halved once, to 1
    best_with_lookup = max((c for c in report["decision"]["candidates"] if "context lookup of 2 " in c["proposal"]),
                           key=lambda c: c["predicted_speedup"])
    assert halved[0]["proposal"].split(" + ")[0] == best_with_lookup["proposal"].split(" + ")[0]
    assert not report["decision"]["on"] and report["verdict"]["decision"] == "off"
    assert "Break-even" in report["verdict"]["text"]
    assert out.rstrip().splitlines()[-3].startswith(f"**Verdict: {word}:") or f"**Verdict: {word}:" in out


def test_calibration_too_short_falls_back_to_held_out_agreement(tiny_target, calibration_prompts, monkeypatch):
    """Prompts that stop at once measure no acceptance: a chain is priced from training's held-out agreement,
    said in a note naming the fallback."""
    priced(monkeypatch, lambda n: 10.0)
    options = EvalSettings(max_new_tokens=16)
    decided, _ = decision_module.decide(OracleChain(tiny_target), tiny_target, options,
                                        [(f"p{i}", p) for i, p in enumerate(calibration_prompts)],
                                        calibration_tokens=3, heldout=[0.5, 0.5, 0.5])
    chains = {c.settings["chain_length"]: c for c in decided.candidates[1:]}
    assert chains[1].tokens_per_step == pytest.approx(1.5) and chains[3].tokens_per_step == pytest.approx(1.875)
    assert any("too few to measure acceptance" in n and "held-out agreement" in n for n in decided.notes)


def test_a_forced_proposal_the_rule_predicts_to_lose_is_run_and_said_to_lose(tiny_target, tmp_path, capsys,
                                                                             monkeypatch):
    from draftsmith.cli import main
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    monkeypatch.setattr(decision_module, "block_cost",
                        lambda target, sizes, **_: {n: 10.0 * n / 1000 for n in sizes})
    code = main(["eval", str(tmp_path / "ckpt"), "--prompts", "mt-bench", "--limit", "4", "--max-new-tokens", "12",
                 "--chain", "2", "--dtype", "float32", "--exact-prompts", "1", "--json", str(tmp_path / "e.json")])
    assert code == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["proposal"] == "chain of 2" and report["decision"]["forced"] and not report["decision"]["on"]
    assert "run as asked; the decision rule predicts it loses here" in report["verdict"]["text"]
    assert "proposal as asked, priced" in capsys.readouterr().out


class FlatAfterOne(OracleChain):
    """Accepts the first draft only: chains past 1 commit no more a step."""

    def propose(self, context):
        from draftsmith.heads.decoding.tree import DraftTree
        tree = super().propose(context)
        tokens = tree.tokens.clone()
        tokens[1:] = (tokens[1:] + 1) % self.target.vocab_size       # every draft after the first is wrong
        return DraftTree(tokens=tokens, parents=tree.parents)


def test_longer_chains_are_tried_only_while_they_commit_more(tiny_target, calibration_prompts, monkeypatch):
    priced(monkeypatch, lambda n: 10.0)
    options = EvalSettings(max_new_tokens=16)
    decided, _ = decision_module.decide(FlatAfterOne(tiny_target), tiny_target, options,
                                        [(f"p{i}", p) for i, p in enumerate(calibration_prompts)],
                                        calibration_tokens=16)
    assert [c.description for c in decided.candidates[1:]] == ["chain of 1", "chain of 2"]   # chain of 3 not tried
    assert decided.candidates[2].tokens_per_step == pytest.approx(decided.candidates[1].tokens_per_step)


def test_a_verification_is_priced_at_the_mean_of_its_steps_costs(tiny_target, monkeypatch):
    """A lookup proposes a varying number of tokens: on a curve flat to 4 tokens and steep after, three steps
    of 2 tokens and one of 6 cost (3 x 10 + 40) / 4 ms, not T(ceil(mean n)) = T(3) = 10 ms nor T(6)."""
    priced(monkeypatch, lambda n: 10.0 if n <= 4 else 40.0)
    mixed = decision_module.Candidate({"lookup": 4}, "mixed", tokens_per_step=2.0, verified_tokens=3.0, draft_ms=1.0,
                                      verified_sizes={2: 3, 6: 1})
    even = decision_module.Candidate({"lookup": 0}, "even", tokens_per_step=2.0, verified_tokens=3.0, draft_ms=1.0,
                                     verified_sizes={3: 4})
    curve = decision_module.price([mixed, even], tiny_target)
    assert sorted(curve) == [1, 2, 3, 6]
    assert mixed.verify_ms == pytest.approx(17.5) and even.verify_ms == pytest.approx(10.0)
    assert mixed.predicted_speedup == pytest.approx(2.0 * 10.0 / (17.5 + 1.0))
    assert even.predicted_speedup == pytest.approx(2.0 * 10.0 / (10.0 + 1.0))


def test_lookup_sizes_halve_down_to_one():
    assert decision_module.halvings(4) == [2, 1] and decision_module.halvings(10) == [5, 2, 1]
    assert decision_module.halvings(1) == []


@pytest.mark.parametrize("tuned, small", [(8, [2, 3]), (3, [2]), (2, [3]), (1, [2, 3])])
def test_static_trees_of_two_and_three_are_candidates_beside_the_tuned_one(tiny_target, tuned, small):
    """A static tree (Medusa) is also tried at 2 and 3 nodes, whatever size the tuner chose: on a CPU whose
    curve is flat for a few tokens, the first position's top 2 paid where the tuned tree of 4 did not, and a
    tuner that chose 1 (a chain) from a noisy curve must not hide them."""
    from draftsmith.heads.medusa import Medusa, MedusaConfig
    drafter = Medusa(MedusaConfig(num_heads=2, lm_head="shared"), tiny_target)
    shapes = decision_module.candidate_settings(drafter, tiny_target, EvalSettings(tree_size=tuned, lookup=2))
    trees = [s for s in shapes if s["tree_size"]]
    assert sorted({s["tree_size"] for s in trees}) == sorted([tuned, *small])
    assert all({s["lookup"] for s in trees if s["tree_size"] == size} == {0, 2} for size in [tuned, *small])
    assert {s["chain_length"] for s in shapes if s["proposal"] == "chain"} == {1, 2}
