"""Does draftsmith's engine compute what transformers computes?  Plain greedy decoding in the engine against
transformers' own greedy `generate` with the model's eager attention (docs/metrics.md, "Engine check").

"Greedy exact" compares speculative with plain decoding inside the same engine, so a defect the two
share (a dropped attention sink, a wrong mask, a recurrent state not carried) would pass as exact.  This
check has no engine code on its reference side.  In fp32 the two differ only where two tokens' logits
are within float rounding of each other: a first difference there is reported as a near-tie, and the
decodings are not compared past it (the texts part for a legitimate reason)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.runtime.target import Target

log = logging.getLogger(__name__)
NEAR_TIE = 1e-4
"""A first difference counts as a near-tie when the two tokens' eager logits differ by at most
NEAR_TIE x (1 + the largest |logit|) there."""


@dataclass
class EngineCheck:
    matches: bool
    prompts: int
    tokens: int                      # tokens compared, over all prompts
    first_mismatch: str | None = None    # "prompt <id>, token <i>: engine <a>, transformers <b>"
    near_ties: int = 0


def compare(target: Target, prompts, max_new_tokens: int, plain_outputs: list[list[int]] | None = None) -> EngineCheck:
    """prompts: [(id, token ids)]; target: an fp32 target; plain_outputs: the engine's plain greedy tokens
    for these prompts when already decoded (else decoded here)."""
    compared, ties = 0, 0
    for index, (prompt_id, prompt) in enumerate(prompts):
        ours = plain_outputs[index] if plain_outputs is not None else decode(target, prompt, max_new_tokens).tokens
        theirs = target.reference_greedy(prompt, max_new_tokens)
        n = min(len(ours), len(theirs))
        position = next((i for i in range(n) if ours[i] != theirs[i]), None)
        if position is None and len(ours) != len(theirs):
            position = n                 # one stopped where the other went on: a difference at token n
        if position is None:
            compared += n
            continue
        compared += position
        a = ours[position] if position < len(ours) else None
        b = theirs[position] if position < len(theirs) else None
        if a is not None and b is not None:
            gap, scale = target.logit_gap(prompt + ours[:position], a, b)
            if gap <= NEAR_TIE * (1 + scale):
                ties += 1
                log.info("engine check: prompt %s parts from transformers at a near-tie (token %d, logit gap %.2g)",
                         prompt_id, position, gap)
                continue
        where = f"prompt {prompt_id}, token {position}: engine {a}, transformers {b}"
        log.error("draftsmith's engine does not reproduce transformers' greedy generate on target '%s' (%s): every "
                  "figure of this evaluation would be wrong; please report it with the model type", target.name, where)
        return EngineCheck(False, index + 1, compared, where, ties)
    return EngineCheck(True, len(prompts), compared, None, ties)
