"""What `draftsmith eval`, and evaluation during training, measure and how: one settings type for the
command line (flags and `key=value` overrides), a recipe's `eval:` section, the quickstart and the
Python API."""
from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.heads.infra.config import ConfigError
from draftsmith.heads.infra.device import DeviceError, check_device_map, resolve_device

PROPOSALS = ("default", "chain", "tree")
RULES = ("auto", "greedy", "sampling", "typical")
DTYPES = ("auto", "bfloat16", "float16", "float32")
BASELINES = ("plain", "generate", "prompt-lookup")


@dataclass
class EvalSettings:
    prompts: str = "mt-bench"
    """mt-bench, humaneval, or a JSONL file of chats/prompts (your traffic)."""
    limit: int = 20
    """Prompts evaluated (>= 1)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt (>= 1)."""
    proposal: str = "default"
    """default (the drafter's), chain, or tree."""
    chain_length: int | None = None
    """Draft tokens per step for proposal=chain (>= 1; default: the drafter's depth)."""
    tree_size: int | None = None
    """Nodes of the static tree for proposal=tree (>= 1; default: tuned to the measured forward cost)."""
    lookup: int = 0
    """Also propose up to this many tokens copied from the context each step (prompt lookup), merged into
    the drafter's tree and verified in the same forward (0 = off; heads/decoding/lookup.py)."""
    lookup_ngram: int = 3
    """The longest n-gram the lookup matches (it tries n down to 1)."""
    temperature: float = 0.0
    """0 = greedy (exactness checked); > 0 samples losslessly."""
    top_p: float = 1.0
    """Nucleus mass when sampling, in (0, 1]."""
    rule: str = "auto"
    """Acceptance rule: auto, greedy, sampling, or typical (Medusa's, NOT lossless)."""
    dtype: str = "auto"
    """Speed runs in this dtype: auto (bf16 where native, else packed float16 on x86 CPUs), bfloat16,
    float16, float32."""
    baselines: tuple[str, ...] = ("plain", "generate")
    """Timed side by side: plain (draftsmith's engine, always), generate and prompt-lookup (transformers)."""
    exact_prompts: int = 3
    """Prompts whose greedy output is checked for exactness in fp32 (>= 0)."""
    seed: int = 0
    """Seeds sampling."""
    cost_per_hour: float | None = None
    """Machine price per hour, for the cost per request (> 0)."""
    target: str | None = None
    """Target path (default: the one the checkpoint names)."""
    adapter: str | None = None
    """LoRA adapter on the target (default: the one the checkpoint was trained with; none: the bare target)."""
    device: str = "auto"
    """auto (cuda when present, else cpu), cpu, cuda or cuda:N."""
    device_map: str | None = None
    """A target bigger than one device: auto, balanced, balanced_low_0 or sequential (transformers'
    big-model loading); null: the whole target on `device`."""
    long_prompts: str = "truncate"
    """A prompt that, with max_new_tokens, does not fit the target's context: truncate (keep its last
    tokens, with a warning) or refuse (an error naming it)."""
    require_checksum: bool = False
    """Refuse a checkpoint whose config.json records no weights checksum (by default: a warning)."""
    max_minutes: float | None = None
    """Fit the timed runs into this many minutes: prompts (then tokens) are cut from a measured forward cost."""
    choose: bool = True
    """With proposal=default: choose the proposal by predicted tokens per second on this machine, plain decoding
    among the choices (chains, the drafter's tuned tree, each with the lookup off or on; eval/decision.py);
    false: the drafter's own shape as tuned."""
    tree_depth_topk_total: tuple | None = field(default=None, init=False, repr=False)
    """Set by evaluation: the dynamic tree the tuner chose (the fp32 exactness check reuses it)."""

    def __post_init__(self):
        if self.long_prompts not in ("truncate", "refuse"):
            raise ConfigError(f"eval.long_prompts must be truncate or refuse, got {self.long_prompts!r}")
        self.baselines = tuple(self.baselines)
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown or "plain" not in self.baselines:
            raise ConfigError(f"eval.baselines must include 'plain' and only {', '.join(BASELINES)}; got "
                              f"{','.join(self.baselines)}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        for name, allowed in (("proposal", PROPOSALS), ("rule", RULES), ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"eval.{name} must be one of {', '.join(allowed)}, got '{getattr(self, name)}'")
        if self.device_map is not None:
            try:
                check_device_map(self.device_map)
            except DeviceError as err:
                raise ConfigError(f"eval.device_map: {err}") from None
        if self.lookup < 0:
            raise ConfigError(f"eval.lookup must be >= 0 (0 = off), got {self.lookup}")
        for name in ("limit", "max_new_tokens", "lookup_ngram"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("chain_length", "tree_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"eval.{name} must be >= 1 (or left out for the default), got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"eval.top_p must be in (0, 1], got {self.top_p}")
        if self.exact_prompts < 0:
            raise ConfigError(f"eval.exact_prompts must be >= 0, got {self.exact_prompts}")
        for name in ("cost_per_hour", "max_minutes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"eval.{name} must be > 0 (or left out), got {getattr(self, name)}")
        try:
            resolve_device(self.device)
        except DeviceError as err:
            raise ConfigError(f"eval.device: {err}") from None
