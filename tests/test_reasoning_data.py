"""Reasoning targets' data: each regenerated turn is rendered as the target's template renders the chat at
that turn (a server renders it the same way), with the loss over exactly the tokens the target generated.

Three templates written here, one per style of 2026's reasoning targets:
- Qwen3 style: `<think>` blocks, earlier turns' reasoning dropped from the history (read from
  `reasoning_content`, or split off the content), `enable_thinking=false` opening an empty block;
- harmony style (gpt-oss): analysis and final channels, earlier turns' analysis dropped (`thinking`);
- R1 style: the generation prompt opens `<think>` itself; the history keeps answers only.
The replies are scripted token ids given to the real `ShardWork` (data/regenerate.py), as the engine
gives them: what is checked is the rendering and the mask, token by token."""
import json
from types import SimpleNamespace

import pytest
import torch
from draftsmith.data.chat import reasoning_of, render, reply_message
from draftsmith.data.health import Health
from draftsmith.data.regenerate import ShardWork
from draftsmith.data.settings import DataSettings
from draftsmith.data.sources import Conversation
from draftsmith.heads.runtime.target import Target

QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set content = content.split('</think>')[-1].strip() -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}"
    "{{ '<think>\n' + reasoning + '\n</think>\n\n' }}{%- endif -%}"
    "{{ content + '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}")

HARMONY_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_user and m.thinking -%}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif -%}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- else -%}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}")

R1_STYLE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<|User|>' + m.content }}"
    "{%- elif m.role == 'assistant' -%}{%- set c = m.content -%}"
    "{%- if '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|Assistant|>' + c + '<|eos|>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|Assistant|><think>\n' }}{%- endif -%}")

STYLES = {
    # template, (special tokens, other added tokens, stop token), the two scripted replies, the prompts of
    # both turns as the template renders them (the first reply's reasoning gone from the second)
    "qwen3": (QWEN3_STYLE, ([], ["<think>", "</think>"], "<|im_end|>"),
              ["<think> one of the day </think> the sea", "<think> water </think> the night"],
              ["<|im_start|>user\nthe time<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nthe time<|im_end|>\n<|im_start|>assistant\nthe sea<|im_end|>\n"
               "<|im_start|>user\nwater is<|im_end|>\n<|im_start|>assistant\n"]),
    "harmony": (HARMONY_STYLE, (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"],
                                ["analysis", "final"], "<|return|>"),
                ["<|channel|>analysis<|message|> one of the day <|end|><|start|>assistant<|channel|>final<|message|> "
                 "the sea", "<|channel|>analysis<|message|> water <|end|><|start|>assistant<|channel|>final"
                 "<|message|> the night"],
                ["<|start|>user<|message|>the time<|end|><|start|>assistant",
                 "<|start|>user<|message|>the time<|end|><|start|>assistant<|channel|>final<|message|>the sea<|end|>"
                 "<|start|>user<|message|>water is<|end|><|start|>assistant"]),
    "r1": (R1_STYLE, (["<|User|>", "<|Assistant|>", "<|eos|>"], ["<think>", "</think>"], "<|eos|>"),
           ["one of the day </think> the sea", "water </think> the night"],
           ["<|User|>the time<|Assistant|><think>\n",
            "<|User|>the time<|Assistant|>the sea<|eos|><|User|>water is<|Assistant|><think>\n"]),
}


def styled_target(directory, style: str, **chat) -> Target:
    """A tiny Llama whose tokenizer has the style's tokens and template (random weights: the replies are
    scripted, never decoded)."""
    from transformers import AutoModelForCausalLM

    from tiny_models import make_config, make_tokenizer
    template, (special, added, stop), _, _ = STYLES[style]
    tok = make_tokenizer()
    tok.add_tokens(special, special_tokens=True)
    tok.add_tokens(added)
    tok.eos_token = stop
    tok.chat_template = template
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config("llama", len(tok))).save_pretrained(directory)
    tok.save_pretrained(directory)
    return Target.load(str(directory), "float32", "cpu", chat=chat or None)


def ids(target, text: str) -> list[int]:
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def regenerate(target, replies: list[str], **settings):
    """Both turns of one two-question conversation through ShardWork, the replies given as the engine
    would give them (their ids, then the stop token): the prompts it rendered and the rows it keeps."""
    conv = Conversation("c0", [{"role": "user", "content": "the time"}, {"role": "assistant", "content": "x"},
                               {"role": "user", "content": "water is"}])
    work = ShardWork(target, 0, [conv], DataSettings(max_turns=2, **settings), seed=0,
                     counts={"generated_tokens": 0, "skipped_long_prompts": 0, "truncated_prompts": 0})
    prompts, generated = [], []
    for turn, reply in enumerate(replies):
        messages, prompt = work.next_job(0, turn)
        prompts.append((render(target.tokenizer, messages, add_generation_prompt=True), prompt.input_ids))
        generated.append(ids(target, reply) + [target.tokenizer.eos_token_id])
        work.take(0, messages, prompt, SimpleNamespace(token_ids=generated[-1], stopped=True, features=None))
    return prompts, generated, work.result()


@pytest.mark.parametrize("style", sorted(STYLES))
def test_each_turn_is_rendered_as_the_template_renders_it_and_only_generated_tokens_are_trained(style, tmp_path):
    target = styled_target(tmp_path / style, style)
    _, _, replies, expected = STYLES[style]
    prompts, generated, rows = regenerate(target, replies)
    assert [text for text, _ in prompts] == expected            # the second without the first's reasoning
    assert [prompt for _, prompt in prompts] == [ids(target, text) for text in expected]
    # the template rewrote the first reply in the second prompt: each turn is a row of its own, as it was seen
    assert [r["id"] for r in rows] == ["c0#turn1", "c0"]
    for row, (_, prompt), reply in zip(rows, prompts, generated):
        assert row["input_ids"] == prompt + reply
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(reply)
    history = rows[1]["messages"][1]
    assert history["content"] == "the sea" and "one of the day" in history.values(), history


def test_thinking_off_opens_an_empty_block_in_the_prompt_and_it_is_not_trained(tmp_path):
    target = styled_target(tmp_path / "q", "qwen3", kwargs={"enable_thinking": False})
    prompts, generated, rows = regenerate(target, ["the sea", "the night"])
    assert prompts[0][0] == "<|im_start|>user\nthe time<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ids(target, "<think> </think>") == prompts[0][1][-2:]
    for row, (_, prompt), reply in zip(rows, prompts, generated):
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(reply)


def test_a_template_that_keeps_each_reply_gives_one_row_with_both_replies_trained(tmp_path):
    """The tiny target's own template renders a chat as a growing prefix: the second turn's row holds the
    first reply as it was written, so one row carries both, each marked."""
    from conftest import build_tiny_target
    target = Target.load(str(build_tiny_target(tmp_path / "t", "llama")), "float32", "cpu")
    prompts, generated, rows = regenerate(target, ["the sea", "the night"])
    assert len(rows) == 1 and rows[0]["id"] == "c0"
    assert rows[0]["input_ids"] == prompts[1][1] + generated[1]
    assert sum(rows[0]["loss_mask"]) == len(generated[0]) + len(generated[1])


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_reply_cut_inside_reasoning_is_told_from_one_cut_in_its_answer(style, tmp_path):
    target = styled_target(tmp_path / style, style)
    reasoning = reasoning_of(target.tokenizer)
    assert reasoning is not None
    _, _, replies, expected = STYLES[style]
    prompt, reply = ids(target, expected[0]), ids(target, replies[0])
    answer_starts = {"qwen3": "</think>", "harmony": "<|end|>", "r1": "</think>"}[style]
    cut = len(ids(target, replies[0].split(answer_starts)[0]))
    health = Health(reasoning)
    health.add_reply(reply[:cut], [], stopped=False, context=prompt[-16:])        # inside the reasoning
    health.add_reply(reply, [], stopped=False, context=prompt[-16:])              # in the answer
    assert health.cut_in_reasoning == 1
    assert reply_message(target.tokenizer, reply[:cut])["content"] != "the sea"    # no answer yet: kept as text


def test_the_long_context_cost_script_runs_as_its_usage_line_says(tiny_target_dir):
    """scripts/long_context_cost.py with a tiny target and short lengths: a row per drafter and length,
    each with a finite loss, a time and the memory its step added."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "long_context_cost.py"
    run = subprocess.run([sys.executable, str(script), "--target", str(tiny_target_dir), "--lengths", "32",
                          "--kinds", "eagle3,p_eagle,dflash"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [(r["kind"], r["length"]) for r in rows] == [("eagle3", 32), ("p_eagle", 32), ("dflash", 32)]
    assert all(math.isfinite(r["loss"]) and r["seconds"] > 0 and r["peak_gib"] >= 0 for r in rows), rows
    assert all(r["estimate_gib"] is not None for r in rows), rows
    assert "| drafter | tokens | step s | peak GiB | process peak GiB | estimate GiB (train's check) |" in run.stdout
    # the stand-in of a configuration (its embedding and lm_head only), as `--shape llama-3.1-8b` builds it
    run = subprocess.run([sys.executable, str(script), "--shape", "tiny", "--lengths", "600", "--kinds", "eagle3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    row = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    assert row["shape"] == "tiny" and math.isfinite(row["loss"]) and row["peak_gib"] > 0
    assert 0.5 * row["peak_gib"] <= row["estimate_gib"] <= 2 * row["peak_gib"], row
    assert row["estimate_gib"] <= row["process_peak_gib"], row          # a lower bound of the whole process


def test_thinking_both_renders_each_conversation_one_way_half_and_half_and_records_which(tmp_path):
    """data.thinking=both: each conversation's prompt is rendered with the template's switch on or off (its
    side fixed by its id and the seed), the row says which, and the prefilled rows of data.mode=prefill
    are rendered the same way."""
    from draftsmith.data.distill import _as_is, fingerprint
    from draftsmith.data.settings import thinks
    target = styled_target(tmp_path / "q", "qwen3")
    settings, seed = DataSettings(thinking="both"), 3
    convs = [Conversation(f"c{i}", [{"role": "user", "content": "the time"},
                                    {"role": "assistant", "content": "the sea"}]) for i in range(40)]
    work = ShardWork(target, 0, convs, settings, seed=seed,
                     counts={"generated_tokens": 0, "skipped_long_prompts": 0, "truncated_prompts": 0})
    sides = []
    for position, conv in enumerate(convs):
        messages, prompt = work.next_job(position, 0)
        on = thinks(conv.id, seed)
        text = render(target.tokenizer, messages, True, {"enable_thinking": on})
        assert prompt.input_ids == ids(target, text)
        assert text.endswith("<think>\n\n</think>\n\n") is not on          # off: the empty block opens the reply
        reply = ids(target, "the sea") + [target.tokenizer.eos_token_id]
        work.take(position, messages, prompt, SimpleNamespace(token_ids=reply, stopped=True, features=None))
        sides.append(on)
    assert [row["thinking"] for row in work.result()] == sides
    assert 10 <= sum(sides) <= 30, sides                                     # both sides, about half each
    for conv, on in zip(convs, sides):
        (row,) = _as_is(target, conv, settings, seed)
        assert row["thinking"] is on
        assert row["input_ids"] == ids(target, render(target.tokenizer, conv.messages, False, {"enable_thinking": on}))
    identity = {"weights_sha256": "w"}
    assert fingerprint(settings, seed, identity) != fingerprint(DataSettings(), seed, identity)
    assert fingerprint(DataSettings(thinking="template", thinking_switch="enable_thinking"), seed, identity) == \
        fingerprint(DataSettings(), seed, identity)        # data made before the setting existed keeps its key


@pytest.mark.parametrize("thinking", ["on", "off"])
def test_thinking_on_or_off_renders_every_conversation_that_way(thinking, tmp_path):
    target = styled_target(tmp_path / "q", "qwen3")
    prompts, _, rows = regenerate(target, ["the sea", "the night"], thinking=thinking)
    first = [{"role": "user", "content": "the time"}]
    text = render(target.tokenizer, first, True, {"enable_thinking": thinking == "on"})
    assert prompts[0][1] == ids(target, text) and text.endswith("<think>\n\n</think>\n\n") is (thinking == "off")
    assert {row["thinking"] for row in rows} == {thinking == "on"}


def test_thinking_with_a_template_that_never_reads_the_switch_is_refused_before_any_work(tmp_path):
    from draftsmith.data.chat import ChatTemplateError
    from draftsmith.data.distill import make_data
    target = styled_target(tmp_path / "h", "harmony")
    out = tmp_path / "data"
    with pytest.raises(ChatTemplateError, match=r"'enable_thinking' \(data.thinking_switch\).*never reads it"):
        make_data(target, DataSettings(thinking="both"), out, seed=0, progress=False)
    assert not out.exists()
    with pytest.raises(ValueError, match="data.thinking must be one of template, on, off, both"):
        DataSettings(thinking="yes")
    assert DataSettings(thinking=True).thinking == "on" and DataSettings(thinking=False).thinking == "off"  # YAML


def test_the_padding_share_script_runs_as_its_usage_line_says(tmp_path, capsys):
    """Rows of 1, 2, 3 and 4 tokens in batches of 2: sorted by length inside the window, [1, 2] and [3, 4],
    10 tokens in 12 positions."""
    import sys
    from pathlib import Path

    import datasets
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from padding_share import main
    datasets.Dataset.from_dict({"input_ids": [[5] * n for n in (3, 1, 4, 2)]}).save_to_disk(tmp_path / "tokenized")
    assert main([str(tmp_path), "--batch-size", "2", "--max-seq-len", "1024", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert '"tokens": 10, "padded_slots": 12' in out and "padding 16.7%" in out and "at most 1.200x" in out


def test_the_long_context_acceptance_script_runs_as_its_usage_line_says(tiny_target_dir, tmp_path):
    """scripts/long_context_acceptance.py with a tiny target, short rows and one training step: both drafters
    trained and evaluated, the table printed with every context bucket the prompts reach."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "long_context_acceptance.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), "--target", str(tiny_target_dir),
                           "--lengths", "32,64", "--conversations", "4", "--train-steps", "1", "--prompt-tokens",
                           "200,1200", "--per-length", "1", "--max-new-tokens", "4", "--batch-tokens", "64"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "acceptance.json").read_text())
    assert set(result["results"]) == {"32", "64"} and len(result["prompt_tokens"]) == 2
    assert max(result["prompt_tokens"]) > 1024 and "| 1k-2k |" in done.stdout and "| 0-1k |" in done.stdout
    for run in result["results"].values():
        assert run["steps"] == 1 and run["greedy_exact"] is True


def test_a_length_whose_training_memory_exceeds_the_device_is_refused_before_any_work(tiny_target, tiny_target_dir,
                                                                                     tmp_path, monkeypatch, capsys):
    """The estimate is a lower bound close to the truth (the activations saved at the full length, measured
    here), and a length past the device's memory is refused with it before data is made."""
    import yaml
    from conftest import tiny_recipe
    from draftsmith.cli import main
    from draftsmith.train import plan
    from draftsmith.train.settings import recipe_from_dict

    raw = tiny_recipe(tmp_path, tiny_target_dir, eval_prompts=0)
    raw.update(method="eagle3", drafter={"draft_vocab_size": 64})
    raw["data"]["max_seq_len"] = 1024
    recipe = recipe_from_dict(raw)
    estimate = plan.sequence_memory(recipe, tiny_target)
    assert estimate["probe_tokens"] == [256, 512]
    truth = plan._saved_bytes(registry_drafter(recipe, tiny_target), tiny_target, 1024, False) * 4
    assert 0.6 * truth <= estimate["activations"] <= truth, (estimate["activations"], truth)
    short = plan.sequence_memory(recipe_from_dict({**raw, "data": {**raw["data"], "max_seq_len": 64}}), tiny_target)
    assert short["probe_tokens"] == [64] and short["activations"] < estimate["activations"] / 8

    fits = estimate["target"] + estimate["drafter_state"] + short["activations"] * 2
    monkeypatch.setattr(plan, "total_memory", lambda device: fits)      # the 64-token run fits, the 1024 does not
    assert plan.check_sequence_memory(recipe_from_dict({**raw, "data": {**raw["data"], "max_seq_len": 64}}),
                                      tiny_target)["needed"] <= fits
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", str(tmp_path / "r.yaml")]) == 2
    err = capsys.readouterr().err
    assert "training at data.max_seq_len 1024 with train.batch_size 4 needs at least" in err, err
    assert "lower data.max_seq_len or train.batch_size" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "data").exists()
    assert main(["train", "--dry-run", str(tmp_path / "r.yaml")]) == 2
    assert "needs at least" in capsys.readouterr().err


def registry_drafter(recipe, target):
    from draftsmith.heads.registry import registry
    torch.manual_seed(0)
    drafter = registry()[recipe.method](recipe.drafter, target)
    drafter.set_draft_vocabulary(torch.arange(recipe.drafter.draft_vocab_size))
    return drafter.train()
