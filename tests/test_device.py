"""One device decision for every verb: the placement test that needs no GPU, and the device errors.

Every verb (data, train, eval, export, quickstart) is run through the real CLI on a tiny target while
`Target.load` is spied on: each call must receive the device explicitly, and it must be the one the
recipe or the `--device` flag asked for.  A call that drops its device argument would load on the
machine's default instead (the CPU on a GPU machine, before this test existed), and fails here.
"""
import pytest
import torch
import yaml
from draftsmith.cli import main
from draftsmith.heads.infra.device import DeviceError, available_devices, resolve_device
from draftsmith.heads.runtime.target import Target
from draftsmith.train.settings import RecipeError, recipe_from_dict
from conftest import chats_file

MISSING = object()


@pytest.fixture
def load_calls(monkeypatch):
    """Record the device every Target.load receives (MISSING when the caller left it out)."""
    calls = []
    original = Target.load.__func__

    def spy(cls, path="smollm2-135m", dtype="auto", device=MISSING, trust_remote_code=False, **adapter):
        calls.append(device)
        return original(cls, path, dtype, "auto" if device is MISSING else device, trust_remote_code, **adapter)

    monkeypatch.setattr(Target, "load", classmethod(spy))
    return calls


def _recipe_file(tmp_path, target_dir, device: str):
    prompts = chats_file(tmp_path / "chats.jsonl", 24)
    recipe = {
        "method": "medusa", "output_dir": str(tmp_path / "run"), "seed": 0,
        "target": {"path": str(target_dir), "dtype": "auto", "device": device},   # the machine default
        "data": {"source": str(prompts), "max_conversations": None, "batch_size": 8, "max_new_tokens": 12},
        "drafter": {"num_heads": 2, "lm_head": "shared", "draft_vocab_size": 64},
        "train": {"epochs": 1, "batch_size": 4, "warmup_steps": 1, "mixed_precision": "no", "eval_prompts": 0,
                  "heldout_fraction": 0.2},
        "eval": {"prompts": str(prompts), "limit": 2, "max_new_tokens": 8, "dtype": "bfloat16",
                 "baselines": ["plain"], "proposal": "chain", "chain_length": 2},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text("# draftsmith train recipe.yaml\n" + yaml.safe_dump(recipe))
    return path


def _assert_placed(calls, expected: torch.device, count: int, verb: str):
    assert len(calls) == count, f"{verb}: {len(calls)} Target.load calls, expected {count}"
    dropped = [i for i, device in enumerate(calls) if device is MISSING]
    assert not dropped, f"{verb}: Target.load call(s) {dropped} did not pass a device"
    wrong = [str(d) for d in calls if resolve_device(d).type != expected.type]
    assert not wrong, f"{verb}: Target.load placed on {wrong}, the recipe asked for {expected}"
    calls.clear()


def test_every_verb_places_the_target_on_the_resolved_device(tiny_target_dir, tmp_path, load_calls):
    expected = resolve_device("cpu")
    recipe = str(_recipe_file(tmp_path, tiny_target_dir, "cpu"))
    assert main(["data", recipe]) == 0
    _assert_placed(load_calls, expected, 1, "data")
    assert main(["train", recipe]) == 0
    _assert_placed(load_calls, expected, 1, "train")
    checkpoint = str(tmp_path / "run" / "checkpoint")
    assert main(["eval", checkpoint, "--prompts", str(tmp_path / "chats.jsonl"), "--limit", "2",
                 "--max-new-tokens", "8", "--chain", "2", "--baselines", "plain", "--dtype", "bfloat16",
                 "--device", "cpu"]) == 0
    _assert_placed(load_calls, expected, 2, "eval")        # the timed target and the fp32 exactness one
    assert main(["export", checkpoint, "--to", "vllm", str(tmp_path / "export"), "--target",
                 str(tiny_target_dir), "--device", "cpu"]) == 0
    _assert_placed(load_calls, expected, 1, "export")
    assert main(["quickstart", "--recipe", recipe, f"output_dir={tmp_path / 'quick'}"]) == 0
    _assert_placed(load_calls, expected, 3, "quickstart")   # data + training, then eval's two


def test_a_device_this_machine_lacks_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"'cuda' is not on this machine \(it has \['cpu'"):
        resolve_device("cuda")
    with pytest.raises(RecipeError, match=r"target.device: device 'cuda:1' is not on this machine"):
        recipe_from_dict({"method": "medusa", "target": {"device": "cuda:1"}})
    with pytest.raises(DeviceError, match="not a device name"):
        resolve_device("gpu0")
    assert resolve_device("auto") == torch.device("cpu") and "cpu" in available_devices()


def test_eval_refuses_a_missing_device_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["eval", str(tmp_path), "--device", "cuda"]) == 2
    assert "is not on this machine" in capsys.readouterr().err


def test_a_device_map_naming_a_missing_device_lists_the_devices_there_are(monkeypatch):
    from draftsmith.heads.infra.device import check_device_map

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"puts 'model.layers.10' on 'cuda:3', which is not on this machine; "
                                          r"the devices here are \['cpu'"):
        check_device_map({"model.embed_tokens": "cpu", "model.layers.10": "cuda:3"})
    with pytest.raises(DeviceError, match=r"puts 'lm_head' on '1'"):
        check_device_map({"lm_head": 1})
    with pytest.raises(RecipeError, match=r"target.device_map: device_map 'everywhere' is not one of \['auto'"):
        recipe_from_dict({"method": "medusa", "target": {"device_map": "everywhere"}})
    assert check_device_map({"model": "cpu", "lm_head": "disk"}) == {"model": "cpu", "lm_head": "disk"}


def test_a_target_loaded_with_a_device_map_decodes_and_extracts_as_without(tiny_target_dir):
    """transformers' big-model loading (device_map=auto puts everything on the CPU here): the same
    greedy tokens and the same hidden states as the plain load."""
    from draftsmith.heads.decoding.verifier import decode

    plain = Target.load(str(tiny_target_dir), "float32", "cpu")
    mapped = Target.load(str(tiny_target_dir), "float32", "cpu", device_map="auto")
    assert mapped.identity == plain.identity
    prompt = [1, 5, 9, 30, 12]
    assert decode(mapped, prompt, 16).tokens == decode(plain, prompt, 16).tokens
    ids = torch.tensor([prompt])
    for layer, hidden in plain.features(ids, None, [1, plain.num_layers]).items():
        assert torch.allclose(mapped.features(ids, None, [1, plain.num_layers])[layer], hidden, atol=1e-6)


def test_eval_refuses_a_bad_device_map_before_any_work(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--device-map", "everywhere"]) == 2
    assert "eval.device_map: device_map 'everywhere' is not one of" in capsys.readouterr().err
