"""Chat-template rendering and the assistant-only loss mask.

The mask is found from the template itself, so it is right for any chat
template and any number of turns: the characters an assistant turn adds are
those between the rendering of the chat before it (with the generation
prompt) and the rendering of the chat through it.  Tokens whose characters
start inside such a span are trained on; system and user tokens, the
template's role headers and generation prompts never are.

Templates that rewrite earlier turns (reasoning models drop earlier <think>
blocks from the history) do not render a chat as a growing prefix: in the full
text an earlier reply is not what the model produced.  Such a reply is trained
in a row of its own, its own history rendered with it as the last turn
(`tokenize_turns`), as the model saw it when it wrote it.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import jinja2

from draftsmith.heads.runtime.prompt_format import PLAIN_SEPARATOR


class ChatTemplateError(ValueError):
    """A tokenizer whose chat template cannot give an assistant mask."""


@dataclass
class TokenizedChat:
    input_ids: list[int]
    loss_mask: list[int]      # 1 on assistant tokens (the ones a drafter learns to predict)
    truncated: bool


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None = None) -> str:
    """The chat as the target's template renders it, with the target's template arguments
    (target.chat_template_kwargs), `kwargs` over them (data.thinking: one conversation's switch)."""
    if getattr(tokenizer, "draftsmith_plain_text", False):       # a base model: the turns as one running text
        text = PLAIN_SEPARATOR.join(m["content"] for m in messages)
        return text + PLAIN_SEPARATOR if add_generation_prompt and messages else text
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer '{getattr(tokenizer, 'name_or_path', '?')}' has no chat template; draftsmith renders chats "
            "with the target's own template. For a base model set target.chat_template=none (plain text), or give "
            "a template: target.chat_template=FILE.jinja")

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **{**getattr(tokenizer, "draftsmith_template_kwargs", {}),
                                                **(kwargs or {})})
    except jinja2.exceptions.SecurityError as err:
        raise ChatTemplateError(f"the chat template tried something the sandbox forbids ({err}); draftsmith renders "
                                "templates sandboxed: use a template that only formats the messages") from None
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template failed while rendering a chat ({type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else 'no message'}); fix the template "
                                "(target.chat_template)") from None


def check_thinking_switch(tokenizer, thinking: str, switch: str) -> None:
    """data.thinking on/off/both sets the template argument `switch`: refused, before any work, for a
    template that never reads it (every conversation would render alike) or for plain text."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):          # named templates: any of them may read it
        source = "\n".join(source.values())
    if getattr(tokenizer, "draftsmith_plain_text", False) or not isinstance(source, str):
        raise ChatTemplateError(f"data.thinking={thinking} switches reasoning through the chat template, and this "
                                "target renders plain text (no template): set data.thinking=template, or give a "
                                "reasoning template (target.chat_template)")
    if not re.search(rf"\b{re.escape(switch)}\b", source):
        raise ChatTemplateError(
            f"data.thinking={thinking} sets the template argument '{switch}' (data.thinking_switch), but the chat "
            f"template of '{getattr(tokenizer, 'name_or_path', '?')}' never reads it, so reasoning would not change: "
            "set data.thinking_switch to the argument the template reads (Qwen3: enable_thinking; DeepSeek-V3.1: "
            "thinking), or data.thinking=template")


@dataclass
class RenderedChat:
    text: str                       # the whole chat, rendered
    spans: list[tuple[int, int]]    # character spans of the assistant turns it holds as written
    rewritten: list[int]            # indices of the assistant turns it does not (the template rewrote them)


def assistant_spans(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                    kwargs: dict | None = None) -> RenderedChat:
    """The rendered chat and where its assistant turns are."""
    text = render(tokenizer, messages, add_generation_prompt, kwargs)
    spans, rewritten = [], []
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], True, kwargs)
        through = render(tokenizer, messages[: i + 1], False, kwargs)
        if text.startswith(before) and text.startswith(through) and len(through) > len(before):
            spans.append((len(before), len(through)))
        elif i == last and i == len(messages) - 1:       # the reply being trained: it must be found
            raise ChatTemplateError(
                "the chat template does not render a conversation as a growing prefix even for its last reply "
                f"(turn {i}), so assistant tokens cannot be located; give a template that does "
                "(target.chat_template)")
        else:       # rewritten later (reasoning models drop earlier <think> blocks): trained in a row of its own
            rewritten.append(i)
    return RenderedChat(text, spans, rewritten)


def tokenize_turns(tokenizer, messages: list[dict], max_length: int | None = None,
                   kwargs: dict | None = None) -> list[TokenizedChat]:
    """Every assistant turn marked once: the whole chat, plus one row per turn the template rewrites
    later (its history and it, only it marked).  One row for templates that render a growing prefix."""
    full = assistant_spans(tokenizer, messages, kwargs=kwargs)
    rows = [_tokenize(tokenizer, full.text, full.spans, max_length)]
    for i in full.rewritten:
        own = assistant_spans(tokenizer, messages[: i + 1], kwargs=kwargs)     # turn i last: held as written
        rows.append(_tokenize(tokenizer, own.text, own.spans[-1:], max_length))
    return rows


def tokenize_chat(tokenizer, messages: list[dict], max_length: int | None = None,
                  add_generation_prompt: bool = False, kwargs: dict | None = None) -> TokenizedChat:
    """Token ids of the rendered chat and a mask that is 1 on assistant tokens only.

    With add_generation_prompt the chat ends ready for the next reply (a prompt
    whose earlier assistant turns are still marked)."""
    rendered = assistant_spans(tokenizer, messages, add_generation_prompt, kwargs)
    return _tokenize(tokenizer, rendered.text, rendered.spans, max_length)


def _tokenize(tokenizer, text: str, spans: list[tuple[int, int]], max_length: int | None) -> TokenizedChat:
    """`text` as token ids, with 1 in the mask on the tokens that start inside one of `spans`."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    mask = [0] * len(ids)
    span_index = 0
    for j, (start, end) in enumerate(offsets):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= start < spans[span_index][1] and end > start:
            mask[j] = 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedChat(ids, mask, truncated)


@dataclass(frozen=True)
class ReasoningFormat:
    """How a reasoning target marks its reasoning in what it writes (matched as token sequences, so a
    tokenizer's decoding spaces do not matter)."""
    name: str
    open: str              # opens the reasoning
    close: str             # closes it
    answer: str            # what opens the answer after it ("": the answer follows `close`)
    key: str               # the message field the family's templates read earlier reasoning from
    tokens: tuple          # vocabulary tokens that say a target writes this format


REASONING_FORMATS = (
    ReasoningFormat("think", "<think>", "</think>", "", "reasoning_content", ("<think>", "</think>")),   # Qwen3, R1
    ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>", "<|channel|>final<|message|>", "thinking",
                    ("<|channel|>", "<|message|>", "<|end|>")),                                           # gpt-oss
)


def _find(ids: list[int], part: list[int], start: int = 0, last: bool = False) -> int:
    """Where `part` occurs in `ids` at or after `start` (the last occurrence with last=True), or -1."""
    found = -1
    for i in range(start, len(ids) - len(part) + 1):
        if part and ids[i:i + len(part)] == part:
            if not last:
                return i
            found = i
    return found


class Reasoning:
    """A target's reasoning format, read in token ids."""

    def __init__(self, form: ReasoningFormat, tokenizer):
        self.form, self.tokenizer = form, tokenizer
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.open, self.close, self.answer = ids(form.open), ids(form.close), ids(form.answer)

    def inside(self, ids) -> bool:
        """Whether `ids` end inside reasoning: a last `open` with no `close` after it."""
        ids = list(ids)
        opened = _find(ids, self.open, last=True)
        return opened >= 0 and _find(ids, self.close, opened + len(self.open)) < 0

    def reply_message(self, ids: list[int]) -> dict | None:
        """The assistant message a chat client sends back for a reply the target wrote: its answer as the
        content and its reasoning under the family's field (templates drop or keep it as the server does);
        None when the reply holds no complete reasoning block."""
        ids = list(ids)
        opened = _find(ids, self.open)
        start = opened + len(self.open) if opened >= 0 else 0     # the template may have opened it
        closed = _find(ids, self.close, start)
        if closed < 0:
            return None
        if self.answer:
            answer = _find(ids, self.answer, closed)
            if answer < 0:
                return None
            content = ids[answer + len(self.answer):]
        else:
            content = ids[closed + len(self.close):]
        reasoning = ids[start:closed]
        text = lambda part: self.tokenizer.decode(part, skip_special_tokens=True).strip()  # noqa: E731
        return {"role": "assistant", "content": text(content), self.form.key: text(reasoning)}


def reasoning_of(tokenizer) -> Reasoning | None:
    """The reasoning format of a target's tokenizer (the first known one whose tokens it has), or None;
    found once and kept on the tokenizer (a real vocabulary is 100k+ entries, and every reply asks)."""
    if tokenizer is None:
        return None
    if not hasattr(tokenizer, "draftsmith_reasoning"):
        vocab = tokenizer.get_vocab()
        tokenizer.draftsmith_reasoning = next(
            (Reasoning(form, tokenizer) for form in REASONING_FORMATS if all(t in vocab for t in form.tokens)), None)
    return tokenizer.draftsmith_reasoning


def reply_message(tokenizer, ids: list[int]) -> dict:
    """The assistant turn a regenerated reply becomes in the chat's history: answer and reasoning apart
    where the target writes a known reasoning format, else the reply's text."""
    reasoning = reasoning_of(tokenizer)
    message = reasoning.reply_message(ids) if reasoning else None
    return message or {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat ending with the generation prompt, ready for the assistant's reply."""
    return tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


LONG_PROMPTS = ("truncate", "refuse")


def fit_context(prompts: list[tuple[str, list[int], int]], context: int, policy: str, setting: str) -> list[list[int]]:
    """Each (id, prompt ids, new tokens) fitted to a target context of `context` positions: a prompt that
    leaves no room for its new tokens keeps its last context - new tokens ids (the generation prompt
    survives) under policy "truncate", with one warning; under "refuse" it is an error naming it."""
    out, cut = [], []
    for rid, ids, new_tokens in prompts:
        room = context - new_tokens
        if len(ids) <= room:
            out.append(ids)
            continue
        if policy == "refuse" or room < 1:
            raise ValueError(f"prompt '{rid}' has {len(ids)} tokens, and with {new_tokens} new tokens it does not fit "
                             f"the target's context of {context}; shorten it, lower the new tokens, or set "
                             f"{setting} to truncate")
        cut.append((rid, len(ids)))
        out.append(ids[-room:])
    if cut:
        logging.getLogger("draftsmith").warning(
            "%d prompt(s) longer than the target's context of %d (less the new tokens) were cut to their last "
            "tokens, e.g. '%s' (%d tokens); set %s to refuse to stop instead", len(cut), context, cut[0][0],
            cut[0][1], setting)
    return out
