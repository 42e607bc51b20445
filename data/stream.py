"""Continuous batching for data generation: the batch stays full.

`generate_batch` (data/generate.py) decodes a fixed set of prompts and the batch shrinks as rows
finish, so the tail of every batch runs a few rows at a time. Here up to `rows` sequences decode
together and a finished row's place goes to the next waiting prompt (the vLLM/TGI idea, written for
draftsmith's engine cache). New prompts are prefilled together, then the cache is repacked:
every row's valid slots are moved to the end of the time axis (left padding), so the cache is
as long as the longest live row, not as long as the run.

Each job samples with its own generator, so what a conversation gets does not depend on which
others shared its batch: a resumed run reproduces an uninterrupted one, and greedy output equals
one-by-one decoding token for token (tests/test_data.py).
"""
from __future__ import annotations

import time

from dataclasses import dataclass, field

import torch

from draftsmith.heads.decoding.sampling import next_token
from draftsmith.heads.runtime.engine import EngineCache
from draftsmith.heads.runtime.target import Target

from .generate import Generation, merge_rows, prefill_prompts, stack_layers


@dataclass
class Job:
    key: object                       # the caller's handle (returned with the result)
    prompt: list[int]
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False
    prompt_features: torch.Tensor | None = None     # [prompt, layers, d]
    step_features: list = field(default_factory=list)   # [layers, d] per generated token fed back


class Stream:
    """Decode jobs `rows` at a time, refilling finished rows from the queue."""

    def __init__(self, target: Target, max_new_tokens: int, rows: int, temperature: float = 0.0,
                 top_p: float = 1.0, capture_layers=(), on_tokens=None):
        self.target = target
        self.max_new_tokens = max_new_tokens
        self.rows = rows
        self.temperature, self.top_p = temperature, top_p
        self.capture_layers = sorted(set(capture_layers))
        self.on_tokens = on_tokens
        self.queue: list[Job] = []
        self.live: list[Job] = []          # one per cache row
        self.cache: EngineCache | None = None
        self.logits: torch.Tensor | None = None      # [rows, v] for the next token of each live row
        self.next_pos: torch.Tensor | None = None    # [rows]
        self.stops = set(target.eos_token_ids)

    def add(self, job: Job, first: bool = False) -> None:
        """Queue a job (at the front with first=True: a conversation's next turn, so its shard completes)."""
        if first:
            self.queue.insert(0, job)
        else:
            self.queue.append(job)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(not job.stopped and len(job.tokens) < self.max_new_tokens
                                       for job in self.live)

    def _done(self, job: Job) -> bool:
        return job.stopped or len(job.tokens) >= self.max_new_tokens

    def _sample(self, logits: torch.Tensor, jobs: list[Job]) -> torch.Tensor:
        """One token per row: greedy for all rows at once, or per row with each job's own generator."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        return torch.stack([next_token(logits[i], self.temperature, self.top_p, job.generator)
                            for i, job in enumerate(jobs)])

    def _record(self, tokens: torch.Tensor, jobs: list[Job]) -> list[Job]:
        """Append each unfinished row's token; returns the jobs this finished."""
        finished = []
        produced = 0
        for token, job in zip(tokens.tolist(), jobs):
            if self._done(job):
                continue
            job.tokens.append(token)
            produced += 1
            if token in self.stops:
                job.stopped = True
            if self._done(job):
                finished.append(job)
        if self.on_tokens is not None and produced:
            self.on_tokens(produced)
        return finished

    def _refill(self) -> list[Job]:
        """Drop finished rows, prefill queued jobs into their places, repack the cache."""
        keep = [i for i, job in enumerate(self.live) if not self._done(job)]
        room = self.rows - len(keep)
        new_jobs, self.queue = self.queue[:room], self.queue[room:]
        prefilled = prefill_prompts(self.target, [job.prompt for job in new_jobs], self.max_new_tokens,
                             self.capture_layers)
        if self.capture_layers:
            prompt_part = torch.cat(prefilled.features, dim=1)                         # [n, longest, L, d]
            longest = prompt_part.shape[1]
            for i, job in enumerate(new_jobs):
                job.prompt_features = prompt_part[i, longest - len(job.prompt):]
        device = self.target.device
        parts, logits, positions = [], [], []
        if keep and self.cache is not None:
            rows = torch.tensor(keep, device=device)
            parts.append((self.cache, rows))
            logits.append(self.logits[rows])
            positions.append(self.next_pos[rows])
        parts.append((prefilled.cache, torch.arange(len(new_jobs), device=device)))
        new_logits = prefilled.last.logits[:, -1]
        logits.append(new_logits)
        positions.append(prefilled.positions[:, -1] + 1)
        self.cache = merge_rows(parts, self.max_new_tokens + 1)
        self.live = [self.live[i] for i in keep] + new_jobs
        self.logits = torch.cat(logits)
        self.next_pos = torch.cat(positions)
        # the new rows' first tokens come from their prefill
        first = self._sample(new_logits, new_jobs)
        finished = self._record(first, new_jobs)
        self._pending = torch.cat([self._pending[torch.tensor(keep, device=device)], first]) \
            if keep and self._pending is not None else first
        return finished

    def run(self) -> list[tuple[object, Generation]]:
        """Decode until at least one job finishes (or nothing is left); returns (key, Generation) for each."""
        finished: list[Job] = []
        while not finished and self.busy:
            if self.deadline is not None and time.time() > self.deadline:
                break                              # data.max_minutes: the caller keeps what finished
            if not self.live or self.cache is None:
                self._pending = None
                finished += self._refill()
                continue
            if self._pending is None:              # tokens sampled from the last logits, not yet fed
                self._pending = self._sample(self.logits, self.live)
                finished += self._record(self._pending, self.live)
            open_rows = sum(not self._done(job) for job in self.live)
            if self.queue and (self.rows - open_rows >= max(1, self.rows // 4) or open_rows == 0):
                finished += self._refill()
                open_rows = sum(not self._done(job) for job in self.live)
            if open_rows == 0:
                self.live, self.cache, self._pending = [], None, None
                continue
            if not self.queue and (len(self.live) - open_rows) * 4 >= len(self.live):
                self._shrink()             # nothing left to start: finished rows leave (one copy of the cache)
            self._forward()
        return [(job.key, self._result(job)) for job in finished]

    _pending: torch.Tensor | None = None
    deadline: float | None = None            # time.time() past which run() returns what finished, maybe nothing

    def _shrink(self) -> None:
        keep = [i for i, job in enumerate(self.live) if not self._done(job)]
        rows = torch.tensor(keep, device=self.target.device)
        self.cache.select_rows(rows)
        self.live = [self.live[i] for i in keep]
        self.logits, self.next_pos, self._pending = self.logits[rows], self.next_pos[rows], self._pending[rows]

    def _forward(self) -> None:
        """Feed each row's pending token; the logits give the next one."""
        self.cache.ensure_capacity(self.cache.length + 1)
        out = self.target.forward_block(self.cache, self._pending[:, None], self.next_pos[:, None], logits="last",
                                        layer_ids=self.capture_layers)
        if self.capture_layers:
            feats = stack_layers(out, self.capture_layers)[:, 0]                            # [rows, L, d]
            for i, job in enumerate(self.live):
                if not self._done(job):
                    job.step_features.append(feats[i])
        self.logits = out.logits[:, -1]
        self.next_pos = self.next_pos + 1
        self._pending = None

    def _result(self, job: Job) -> Generation:
        features = None
        if self.capture_layers:
            fed = job.step_features[: len(job.tokens) - 1]
            last = torch.zeros_like(job.prompt_features[:1])                         # the final token: never fed
            features = torch.cat([job.prompt_features] + [f[None] for f in fed] + [last])
        return Generation(job.tokens, job.stopped, features)


def generate_stream(target: Target, prompts: list[list[int]], max_new_tokens: int, rows: int,
                    temperature: float = 0.0, top_p: float = 1.0, generators=None, on_tokens=None,
                    capture_layers=()) -> list[Generation]:
    """Every prompt through one Stream; results in prompt order."""
    stream = Stream(target, max_new_tokens, rows, temperature, top_p, capture_layers, on_tokens)
    for i, prompt in enumerate(prompts):
        stream.add(Job(i, prompt, None if generators is None else generators[i]))
    results: dict[int, Generation] = {}
    while stream.busy:
        results.update(stream.run())
    return [results[i] for i in range(len(prompts))]
