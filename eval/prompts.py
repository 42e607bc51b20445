"""The prompts an evaluation decodes: the first turns of a benchmark or a traffic sample, fitted to the
target's context."""
from __future__ import annotations

from draftsmith.data import sources
from draftsmith.data.chat import fit_context, prompt_ids
from draftsmith.heads.runtime.target import Target


def read_prompts(source: str, limit: int) -> list:
    """The first `limit` conversations of `source`, read (and a bad file refused) before any target loads."""
    convs = list(sources.conversations(source, limit=limit))
    if not convs:
        raise ValueError(f"no prompts in '{source}'")
    return convs


def load_prompts(target: Target, source: str, limit: int, max_new_tokens: int = 0,
                 long_prompts: str = "truncate", convs: list | None = None) -> list[tuple[str, list[int]]]:
    """(id, prompt ids) of the first `limit` prompts (`convs`: read_prompts' already), each fitted to the
    target's context with room for `max_new_tokens` (cut or refused: eval.long_prompts)."""
    convs = sources.conversations(source, limit=limit) if convs is None else convs
    out = []
    for conv in convs:
        messages = conv.messages
        if messages[-1]["role"] == "assistant":      # a traffic sample with replies: ask the first question
            messages = messages[: next(i for i, m in enumerate(messages) if m["role"] == "user") + 1]
        out.append((conv.id, prompt_ids(target.tokenizer, messages)))
    if not out:
        raise ValueError(f"no prompts in '{source}'")
    if target.context_length:
        fitted = fit_context([(pid, ids, max_new_tokens) for pid, ids in out], target.context_length, long_prompts,
                             "eval.long_prompts")
        out = [(pid, ids) for (pid, _), ids in zip(out, fitted)]
    return out
