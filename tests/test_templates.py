"""Chat formats: reasoning templates that rewrite earlier turns, template arguments, base models
without a template (plain text), and extra stop tokens; recorded in checkpoints, applied everywhere."""
import json

import pytest
from draftsmith.data.chat import ChatTemplateError, prompt_ids, tokenize_chat
from draftsmith.heads.runtime.target import Target, TargetError

# Like Qwen3's: an assistant turn before the last user message loses its reasoning ("think ... stop"),
# and enable_thinking=false opens the reply with an empty reasoning block.
REASONING = (
    "{% set last = namespace(i=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < last.i and 'stop' in c %}{% set c = c.split('stop')[-1] %}"
    "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if not (enable_thinking | default(true)) %}{{ 'think stop ' }}{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "think two stop three"},
        {"role": "user", "content": "four"}, {"role": "assistant", "content": "think five stop six"}]


def words(target, ids):
    return target.tokenizer.convert_ids_to_tokens(ids)


def test_a_template_that_strips_earlier_reasoning_trains_the_last_reply_whole(tiny_target_dir):
    target = Target.load(str(tiny_target_dir), "float32", "cpu", chat={"template": REASONING})
    chat = tokenize_chat(target.tokenizer, CHAT)
    marked = [w for w, m in zip(words(target, chat.input_ids), chat.loss_mask) if m]
    assert marked == ["think", "five", "stop", "six", "<|im_end|>"]       # the last reply, its reasoning included
    assert "two" not in words(target, chat.input_ids)                      # the earlier one, as the template shows it
    plain = Target.load(str(tiny_target_dir), "float32", "cpu")            # the model's own (prefix-growing) template
    both = [w for w, m in zip(words(plain, tokenize_chat(plain.tokenizer, CHAT).input_ids),
                              tokenize_chat(plain.tokenizer, CHAT).loss_mask) if m]
    assert both.count("think") == 2


def test_template_arguments_reach_every_rendering(tiny_target_dir):
    thinking = Target.load(str(tiny_target_dir), "float32", "cpu", chat={"template": REASONING})
    direct = Target.load(str(tiny_target_dir), "float32", "cpu",
                         chat={"template": REASONING, "kwargs": {"enable_thinking": False}})
    question = CHAT[:1]
    assert words(direct, prompt_ids(direct.tokenizer, question))[-2:] == ["think", "stop"]
    assert words(thinking, prompt_ids(thinking.tokenizer, question))[-1] == "assistant"


def test_a_base_model_renders_plain_text_and_its_checkpoint_remembers(tiny_target_dir, tmp_path):
    from draftsmith.heads.drafter import checkpoint_target, read_config
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import recipe_from_dict
    from conftest import tiny_recipe

    bare = Target.load(str(tiny_target_dir), "float32", "cpu")
    bare.tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="target.chat_template=none"):
        prompt_ids(bare.tokenizer, CHAT[:1])
    base = Target.load(str(tiny_target_dir), "float32", "cpu", chat={"template": "none"})
    chat = tokenize_chat(base.tokenizer, CHAT[:2])
    assert words(base, chat.input_ids) == ["one", "think", "two", "stop", "three"]
    assert [w for w, m in zip(words(base, chat.input_ids), chat.loss_mask) if m] == ["think", "two", "stop", "three"]
    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=1, eval_prompts=1)
    raw["target"].update(chat_template="none", stop_tokens=["stop"])
    report = fit(recipe_from_dict(raw), progress=False)
    config = read_config(report.checkpoint)
    assert config["target_chat"] == {"template": "none", "stop_tokens": ["stop"]}
    again = checkpoint_target(config, "float32", "cpu")
    assert getattr(again.tokenizer, "draftsmith_plain_text", False)
    assert again.tokenizer.convert_tokens_to_ids("stop") in again.eos_token_ids
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    raw["target"].update(chat_template=None, stop_tokens=[])         # the same data, another prompt format
    with pytest.raises(ValueError, match=r"holds data made with other settings \(the target's prompt format "
                                         r"\(target.chat_template, chat_template_kwargs, stop_tokens\): on disk "
                                         r"\{'template': 'none', 'stop_tokens': \['stop'\]\}, recipe None\)"):
        fit(recipe_from_dict({**raw, "overwrite": True}), progress=False)
    assert manifest["fingerprint"]


def test_a_stop_token_the_vocabulary_lacks_is_named(tiny_target_dir):
    with pytest.raises(TargetError, match=r"target.stop_tokens: '<think>' is not a token of target"):
        Target.load(str(tiny_target_dir), "float32", "cpu", chat={"stop_tokens": ["<think>"]})


def test_every_reply_of_a_rewriting_template_is_trained_once_as_the_model_saw_it(tiny_target_dir):
    """The earlier reply, whose reasoning the template strips from later renderings, gets a row of its own
    (its history, it last, whole); the full chat's row trains the last reply; nothing is trained twice."""
    from draftsmith.data.chat import tokenize_turns

    target = Target.load(str(tiny_target_dir), "float32", "cpu", chat={"template": REASONING})
    rows = tokenize_turns(target.tokenizer, CHAT)
    marked = [[w for w, m in zip(words(target, r.input_ids), r.loss_mask) if m] for r in rows]
    assert marked == [["think", "five", "stop", "six", "<|im_end|>"], ["think", "two", "stop", "three", "<|im_end|>"]]
    plain = Target.load(str(tiny_target_dir), "float32", "cpu")        # a growing-prefix template: one row
    assert len(tokenize_turns(plain.tokenizer, CHAT)) == 1


def test_thinking_asked_of_a_template_without_reasoning_is_warned_once(tiny_target_dir, caplog, monkeypatch):
    import logging

    from draftsmith.heads.runtime import prompt_format
    monkeypatch.setattr(prompt_format, "_warned", set())            # once per process: not yet, here
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            Target.load(str(tiny_target_dir), "float32", "cpu", chat={"kwargs": {"enable_thinking": True}})
    warned = [r.getMessage() for r in caplog.records if "ask for reasoning" in r.getMessage()]
    assert len(warned) == 1 and "enable_thinking=True" in warned[0] and str(tiny_target_dir) in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        marked = REASONING.replace("'think stop '", "'<think> </think> '")          # a template with a marker
        Target.load(str(tiny_target_dir), "float32", "cpu",
                    chat={"template": marked, "kwargs": {"enable_thinking": True}})
        Target.load(str(tiny_target_dir), "float32", "cpu", chat={"kwargs": {"enable_thinking": False}})
    assert "ask for reasoning" not in caplog.text
