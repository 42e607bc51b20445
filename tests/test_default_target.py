"""The real default target (SmolLM2-135M-Instruct): a short training run, then evaluation.  Marked slow."""
import pytest
from draftsmith.eval.benchmark import EvalSettings, evaluate

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("default-target")]   # with test_serving.py


@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_short_training_gives_exact_speculation_with_tau_above_one(default_run, method):
    report = evaluate(default_run[method], EvalSettings(limit=2, max_new_tokens=40, proposal="chain",
                                                       baselines=("plain",), dtype="float32"), progress=False)
    assert report.greedy_exact is True and report.exact_checked_prompts == 2
    assert report.tau > 1.0
    assert report.per_position_acceptance[0] > 0


def test_the_embedded_target_is_converted_once_for_every_copy_of_its_file(tmp_path, monkeypatch):
    """Each virtual environment installs its own copy of the GGUF: the conversion is keyed by content."""
    import shutil

    import transformers
    from draftsmith.heads.runtime import assets

    installed = assets.package_file(*assets.EMBEDDED_TARGETS["smollm2-135m"])
    converted = assets.convert_gguf(installed, name="smollm2-135m")
    copy = tmp_path / "elsewhere" / installed.name
    copy.parent.mkdir()
    shutil.copyfile(installed, copy)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("converted again"))
    assert assets.convert_gguf(copy, name="smollm2-135m") == converted
    with open(copy, "r+b") as f:                 # other content: another key
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert assets.gguf_sha256(copy) != assets.gguf_sha256(installed)
