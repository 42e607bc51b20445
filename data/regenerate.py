"""Regeneration of a shard's conversations, turn by turn, by the target.

A `ShardWork` holds one planned shard: for each conversation the chat so far and its record (the
last turn's prompt + reply as ids, with the features of that forward).  `next_job` gives a
conversation's next prompt (or None when it is done); `take` files a finished reply.  Two engines
drive it:
- draftsmith's (`regenerate_shards`): every shard in flight shares one continuously refilled batch
  (data/stream.py); a shard is written as soon as its last conversation finishes, and each
  conversation turn samples with its own seeded generator, so a resumed run reproduces an
  uninterrupted one;
- vLLM (`regenerate_with_vllm`): many shards at a time, each turn one vLLM call for all of them.
"""
from __future__ import annotations

import time

import torch

from draftsmith.heads.runtime.target import Target

from . import sources
from .chat import reply_message, tokenize_chat
from .stream import Job, Stream


def fit_prompt(target: Target, messages: list[dict], settings, counts: dict, kwargs: dict | None = None):
    """The prompt's ids and mask (earlier replies marked), or None if it is too long and cannot be cut.
    kwargs: template arguments of this conversation's over the target's (data.thinking)."""
    chat = tokenize_chat(target.tokenizer, messages, add_generation_prompt=True, kwargs=kwargs)
    if len(chat.input_ids) <= settings.max_prompt_tokens:
        return chat
    if settings.long_prompts == "skip":
        counts["skipped_long_prompts"] += 1
        return None
    # truncate: cut the last user turn's text until the rendered prompt fits
    overflow = len(chat.input_ids) - settings.max_prompt_tokens
    content_ids = target.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
    if overflow + 8 >= len(content_ids):
        counts["skipped_long_prompts"] += 1
        return None
    messages[-1] = dict(messages[-1], content=target.tokenizer.decode(content_ids[: len(content_ids) - overflow - 8]))
    counts["truncated_prompts"] += 1
    chat = tokenize_chat(target.tokenizer, messages, add_generation_prompt=True, kwargs=kwargs)
    return chat if len(chat.input_ids) <= settings.max_prompt_tokens else None


class ShardWork:
    """One planned shard's conversations while their turns are regenerated."""

    def __init__(self, target: Target, index: int, batch: list[sources.Conversation], settings, seed: int,
                 counts: dict, exclude: set[str] = frozenset()):
        self.target, self.index, self.batch, self.settings, self.counts = target, index, batch, settings, counts
        self.exclude = exclude            # conversations an earlier run kept as parts of this shard
        self.seed = seed
        self.chats = {c.id: [] for c in batch}
        self.records: dict[str, dict] = {}
        self.open = 0                     # jobs handed out and not yet taken back
        self.finished: set[int] = set()   # positions whose conversation is complete

    def next_job(self, position: int, turn: int):
        """(messages, prompt) for conversation `position`'s turn, or None if it has no such turn or it does not fit."""
        conv = self.batch[position]
        users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
        if turn >= min(len(users), self.settings.max_turns):
            return None
        head = conv.messages[: users[0]] if turn == 0 else []        # a system turn before the first question
        messages = self.chats[conv.id] + head + [dict(conv.messages[users[turn]])]
        prompt = fit_prompt(self.target, messages, self.settings, self.counts,
                            self.settings.template_kwargs(conv.id, self.seed))
        return None if prompt is None else (messages, prompt)

    def seed_of(self, position: int, turn: int) -> int:
        return ((self.seed * 1_000_003 + self.index) * 4099 + position) * 131 + turn

    def generator(self, position: int, turn: int) -> torch.Generator | None:
        if self.settings.temperature <= 0:
            return None
        return torch.Generator(device=self.target.device).manual_seed(self.seed_of(position, turn) % (2 ** 63))

    def take(self, position: int, messages: list[dict], prompt, out) -> bool:
        """File a finished reply; True if the conversation goes on to its next turn."""
        conv = self.batch[position]
        reply_ids = [t for t in out.token_ids if t not in self.target.eos_token_ids]
        reply = reply_message(self.target.tokenizer, reply_ids)
        if not any(text.strip() for role, text in reply.items() if role != "role"):       # nothing written
            return False
        self.counts["generated_tokens"] += len(out.token_ids)
        self.chats[conv.id] = messages + [reply]
        record = {"id": conv.id, "messages": self.chats[conv.id], "input_ids": prompt.input_ids + out.token_ids,
                  "loss_mask": prompt.loss_mask + [1] * len(out.token_ids), "features": out.features}
        kwargs = self.settings.template_kwargs(conv.id, self.seed)
        if kwargs is not None:          # data.thinking: whether this conversation was rendered reasoning
            record["thinking"] = kwargs[self.settings.thinking_switch]
        rows = self.records.setdefault(conv.id, [])
        if rows and record["input_ids"][:len(rows[-1]["input_ids"])] == rows[-1]["input_ids"]:
            rows.pop()                # the new row holds the last one whole, its reply marked: one row
        elif rows:                    # the template rewrote the last reply (dropped its reasoning): a row of its own
            rows[-1]["id"] = f"{conv.id}#turn{sum(m['role'] == 'assistant' for m in rows[-1]['messages'])}"
        rows.append(record)
        return out.stopped            # a reply cut at max_new_tokens ends the conversation

    def result(self) -> list[dict]:
        return [row for c in self.batch for row in self.records.get(c.id, [])]


def regenerate_with_vllm(engine, works: list[ShardWork], on_tokens) -> None:
    """vLLM: the conversations of many shards, each turn one call for all of them (the engine batches
    and schedules them itself; a conversation's next turn waits for its reply)."""
    alive = [(work, p) for work in works for p, conv in enumerate(work.batch) if conv.id not in work.exclude]
    for turn in range(max(w.settings.max_turns for w in works) if works else 0):
        jobs = [(work, p, job) for work, p in alive if (job := work.next_job(p, turn)) is not None]
        if not jobs:
            break
        outs = engine.generate([prompt.input_ids for _, _, (_, prompt) in jobs],
                               [work.seed_of(p, turn) % (2 ** 31) for work, p, _ in jobs], works[0].settings,
                               on_tokens)
        alive = [(work, p) for (work, p, (messages, prompt)), out in zip(jobs, outs)
                 if work.take(p, messages, prompt, out)]


class Regenerator:
    """Regenerates shards through one continuously refilled batch of `rows` rows (data.batch_size);
    `write(index, records)` is called as each shard completes (not necessarily in index order).
    A new shard is admitted when the queue empties, so at most the live rows are in flight.

    Past `deadline` (time.time()) decoding stops within one decode step, a first shard written or not.  The conversations
    of the shards in flight that had finished are kept: `write_part(index, records)` writes them as a
    part of their shard, and a rerun admits the shard again without them (`exclude`), so the cap costs
    only the rows that were still decoding.  Every conversation turn samples with its own seeded
    generator, so the parts and the rest together hold what an uninterrupted run writes."""

    def __init__(self, target: Target, settings, seed: int, counts: dict, on_tokens, capture_layers, write,
                 deadline: float | None = None, write_part=None, rows: int | None = None):
        self.target, self.settings, self.seed, self.counts, self.write = target, settings, seed, counts, write
        self.deadline, self.write_part = deadline, write_part
        self.written = 0
        self.stream = Stream(target, settings.max_new_tokens, rows or settings.batch_size, settings.temperature,
                             settings.top_p, capture_layers, on_tokens)
        self.stream.deadline = deadline
        self.inflight: dict[int, ShardWork] = {}
        self.kept_parts = 0                       # finished conversations written as parts at the cap

    def admit(self, index: int, batch: list[sources.Conversation], exclude: set[str] = frozenset()) -> None:
        """Start a shard's conversations (but those in `exclude`, kept by an earlier run's part), then decode
        until the queue is empty (rows still busy): the next shard refills the batch without a gap, and a
        time cap waits for the live rows only."""
        work = ShardWork(self.target, index, batch, self.settings, self.seed, self.counts)
        self.inflight[index] = work
        for position, conv in enumerate(batch):
            if conv.id not in exclude and not self._hand_out(work, position, 0, first=False):
                work.finished.add(position)
        if work.open == 0:                       # nothing in it fits: an empty shard, still written
            self._complete(work)
        self._drain(until_queue_empty=True)

    def finish(self) -> None:
        """Decode everything admitted to the end, or to the deadline: then the finished conversations of
        the shards in flight are written as parts."""
        self._drain(until_queue_empty=False)
        if self.write_part is None:
            return
        for index, work in list(self.inflight.items()):
            records = [row for p, c in enumerate(work.batch) if p in work.finished
                       for row in work.records.get(c.id, [])]
            if records:
                self.write_part(index, records)
                self.kept_parts += len(records)

    def _hand_out(self, work: ShardWork, position: int, turn: int, first: bool) -> bool:
        job = work.next_job(position, turn)
        if job is None:
            return False
        messages, prompt = job
        work.open += 1
        self.stream.add(Job((work.index, position, turn, messages, prompt), prompt.input_ids,
                            work.generator(position, turn)), first=first)
        return True

    def _complete(self, work: ShardWork) -> None:
        self.write(work.index, work.result())
        del self.inflight[work.index]
        self.written += 1

    @property
    def out_of_time(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def _drain(self, until_queue_empty: bool) -> None:
        while self.stream.busy and (not until_queue_empty or self.stream.queue) and not self.out_of_time:
            for (index, position, turn, messages, prompt), out in self.stream.run():
                work = self.inflight[index]
                work.open -= 1
                if not (work.take(position, messages, prompt, out)
                        and self._hand_out(work, position, turn + 1, first=True)):
                    work.finished.add(position)
                if work.open == 0:
                    self._complete(work)
