"""What `draftsmith bench` is asked to measure (BenchSettings, checked when built), and what one measured
request is (Run): shared by the three engines (eval/bench.py, bench_vllm.py, bench_endpoint.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

NGRAM = "ngram"                  # in place of a checkpoint: vLLM's prompt-lookup speculation, nothing trained
AGAINST = ("plain", NGRAM)        # what the drafter is timed against: no speculation, or vLLM's ngram
ENGINES = ("draftsmith", "vllm", "endpoint")

class BenchError(ValueError):
    """Bad bench settings or traffic."""


@dataclass
class Run:
    """One request decoded once in one mode."""
    request: str
    category: str
    temperature: float
    repeat: int
    mode: str                         # plain | speculative
    seconds: float
    first_token_seconds: float
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    concurrency: int = 1
    prompt_tokens: int = 0


@dataclass
class BenchSettings:
    traffic: str = "mt-bench"
    limit: int = 5
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0,)
    repeats: int = 3
    cost_per_hour: float | None = None
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    target: str | None = None
    adapter: str | None = None                # LoRA adapter on the target (default: the checkpoint's; none: bare)
    engine: str = "draftsmith"
    concurrency: tuple[int, ...] = (1,)
    vllm_python: str | None = None
    num_speculative_tokens: int = 3
    endpoint: str | None = None               # a running server with the drafter (engine "endpoint")
    baseline_endpoint: str | None = None      # the same target served without it
    lookup: int = 0                           # draftsmith engine: context-lookup tokens merged into each tree
    chain: int | None = None                  # draftsmith engine: propose a chain of this many (default: its own)
    against: str = "plain"                    # vllm engine: the baseline engine, plain or ngram (vLLM's prompt lookup)
    long_prompts: str = "truncate"            # a request longer than the target's context: truncate or refuse

    def __post_init__(self):
        self.temperatures = tuple(float(t) for t in self.temperatures)
        self.concurrency = tuple(int(c) for c in self.concurrency)
        if self.engine not in ENGINES:
            raise BenchError(f"--engine must be one of {', '.join(ENGINES)}, got '{self.engine}'")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise BenchError(f"--concurrency values must be >= 1 (requests in flight), got {list(self.concurrency)}")
        if self.engine == "endpoint" and not (self.endpoint and self.baseline_endpoint):
            raise BenchError("--endpoint (the server with the drafter) needs --baseline-endpoint (the same target "
                             "served without it), and the other way round: a running server cannot switch "
                             "speculation off")
        if self.engine != "endpoint" and (self.endpoint or self.baseline_endpoint):
            raise BenchError(f"--endpoint and --baseline-endpoint are measured by the endpoint engine, not "
                             f"'{self.engine}': drop --engine")
        if self.engine == "draftsmith" and self.concurrency != (1,):
            raise BenchError("the draftsmith engine serves one request at a time: --concurrency above 1 needs "
                             "--engine vllm")
        if self.lookup < 0 or (self.lookup and self.engine != "draftsmith"):
            raise BenchError(f"--lookup must be >= 0 and is draftsmith's own (its verifier merges the lookup into "
                             f"the drafter's tree); got {self.lookup} with engine '{self.engine}'")
        if self.chain is not None and (self.chain < 1 or self.engine != "draftsmith" or self.lookup):
            raise BenchError(f"--chain K proposes a chain of K drafts in draftsmith's engine (K >= 1, without "
                             f"--lookup); got {self.chain} with engine '{self.engine}'"
                             + (" and --lookup" if self.lookup else "")
                             + ("; vLLM's is --num-speculative-tokens" if self.engine != "draftsmith" else ""))
        if self.num_speculative_tokens < 1:
            raise BenchError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.long_prompts not in ("truncate", "refuse"):
            raise BenchError(f"--long-prompts must be truncate or refuse, got '{self.long_prompts}'")
        if self.against not in AGAINST:
            raise BenchError(f"--against must be one of {', '.join(AGAINST)}, got '{self.against}'")
        if self.against != "plain" and self.engine != "vllm":
            raise BenchError(f"--against {self.against} is vLLM's own speculation: it needs --engine vllm, not "
                             f"'{self.engine}'")
        for name in ("limit", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise BenchError(f"--temperature values must be >= 0 (0 is greedy), got {list(self.temperatures)}")
        if self.cost_per_hour is not None and self.cost_per_hour <= 0:
            raise BenchError(f"--cost-per-hour must be > 0 (the machine's price per hour), got {self.cost_per_hour}")
