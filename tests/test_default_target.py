"""The real default target (SmolLM2-135M-Instruct): a short training run, then evaluation.  Marked slow."""
import pytest
from draftsmith.eval.benchmark import EvalOptions, evaluate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_short_training_gives_exact_speculation_with_tau_above_one(default_run, method):
    report = evaluate(default_run[method], EvalOptions(limit=2, max_new_tokens=40, proposal="chain",
                                                       baselines=("plain",)), progress=False)
    assert report.greedy_exact is True and report.exact_checked_prompts == 2
    assert report.tau > 1.0
    assert report.per_position_acceptance[0] > 0
