"""A recipe's `data:` section: what the data step reads, how the target labels it, and its limits."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from . import sources
from .health import limits_from
from .vllm_backend import engine_settings


@dataclass
class DataSettings:
    """How training data is made (the recipe's `data:` section)."""

    source: str = "sharegpt"
    """sharegpt, mt-bench, humaneval, a .jsonl/.json/.parquet/.arrow/.csv file, a datasets directory, or a
    dataset id already in the local Hugging Face cache (e.g. HuggingFaceH4/ultrachat_200k)."""
    split: str = "train"
    """The split of a `datasets` source (a file through load_dataset, or a cached dataset id)."""
    messages_field: str | None = None
    """The column holding each chat's turns (OpenAI or ShareGPT style); null: messages or conversations."""
    prompt_field: str | None = None
    """Instead: the column holding one user prompt per record (the target writes the reply)."""
    streaming: bool = False
    """Read a `datasets` source as a stream (large corpora: nothing is converted to Arrow first)."""
    backend: str = "transformers"
    """Who regenerates: transformers (draftsmith's batched engine; keeps the features) or vllm (optional extra)."""
    max_conversations: int | None = 2000
    """Conversations taken from the source (after shuffling with the seed), rounded up to whole batches; null = all."""
    mode: str = "regenerate"
    """regenerate (the target rewrites replies), prefill (the target reads the source's replies, all
    turns, and labels them with its own distribution) or mix (regenerate_share of the batches regenerated)."""
    regenerate_share: float = 0.25
    """mode=mix: the fraction of batches the target regenerates; the rest are prefilled."""
    regenerate: bool | None = None
    """Deprecated: true is mode=regenerate, false is mode=prefill."""
    max_turns: int = 1
    """Assistant turns regenerated per conversation; later turns are dropped."""
    max_prompt_tokens: int = 384
    """Longest rendered prompt (chat so far) given to the target."""
    long_prompts: str = "skip"
    """What to do with longer prompts: skip (counted) or truncate (the user turn is cut)."""
    max_new_tokens: int = 256
    """Longest regenerated assistant turn."""
    temperature: float = 0.0
    """0 = greedy regeneration; > 0 samples (seeded per batch)."""
    top_p: float = 1.0
    """Nucleus sampling mass when temperature > 0."""
    batch_size: int | str = 64
    """Conversations generated together (the transformers backend's rows), and a shard's conversations;
    auto: the rows that fit data.memory_gb (shards of 64), the choice logged."""
    memory_gb: float | None = None
    """batch_size=auto: the memory the generation may use for its cache and features (null: 80% of what is
    free on the device when the run starts, the target already loaded)."""
    shard_mb: float = 2048
    """A shard's largest size on disk (features + JSONL): a larger shard is written as parts of it."""
    vllm: dict = field(default_factory=dict)
    """data.backend=vllm: the engine's gpu_memory_utilization (0.85), tensor_parallel_size (1),
    data_parallel_size (null: the launch's processes, one engine each), max_num_seqs, kv_cache_gb (CPU),
    chunk_shards (16: shards fed to the engine per call)."""
    health: dict = field(default_factory=dict)
    """Data-health limits overriding the shipped ones ({figure}_warn / {figure}_stop, e.g. loop_share_stop:
    0.7; null: never), docs/metrics.md "Data health"."""
    allow_degenerate: bool = False
    """Keep data past the data-health stopping limits (a warning instead of an error)."""
    max_minutes: float | None = None
    """Stop generating after this many minutes (every finished conversation is kept; a rerun continues);
    null = no cap."""
    max_seq_len: int = 1024
    """Training sequences are cut to this many tokens."""
    thinking: str | bool = "template"
    """Whether the target reasons in the data: template (as target.chat_template_kwargs render it), on, off,
    or both (each conversation one or the other, half and half, chosen by its id and the seed).  on/off/both
    set the template argument data.thinking_switch in the data step only.  on and off need no quotes (YAML
    reads them as true and false, taken here as on and off)."""
    thinking_switch: str = "enable_thinking"
    """The template argument that turns reasoning on and off (Qwen3-style templates: enable_thinking)."""

    def __post_init__(self):
        if self.regenerate is not None:                     # the old switch, kept readable
            self.mode, self.regenerate = ("regenerate" if self.regenerate else "prefill"), None
        if self.mode not in ("regenerate", "prefill", "mix"):
            raise ValueError(f"data.mode must be regenerate, prefill or mix, got '{self.mode}'")
        if not 0 <= self.regenerate_share <= 1:
            raise ValueError(f"data.regenerate_share must be in [0, 1], got {self.regenerate_share}")
        if self.backend not in ("transformers", "vllm"):
            raise ValueError(f"data.backend must be transformers or vllm, got '{self.backend}'")
        if self.long_prompts not in ("skip", "truncate"):
            raise ValueError(f"data.long_prompts must be 'skip' or 'truncate', got '{self.long_prompts}'")
        if isinstance(self.batch_size, str) and self.batch_size != "auto":
            raise ValueError(f"data.batch_size must be a whole number or auto, got '{self.batch_size}'")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ValueError(f"data.memory_gb must be > 0, or null for 80% of the free memory; got {self.memory_gb}")
        if not self.shard_mb > 0:
            raise ValueError(f"data.shard_mb must be > 0 (megabytes per shard on disk), got {self.shard_mb}")
        limits_from(self.health)
        engine_settings(self.vllm)
        for name in ("max_turns", "max_prompt_tokens", "max_new_tokens", "max_seq_len") + (
                ("batch_size",) if isinstance(self.batch_size, int) else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"data.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"data.temperature must be >= 0, got {self.temperature}")
        if self.max_conversations is not None and self.max_conversations < 1:
            raise ValueError(f"data.max_conversations must be >= 1, or null for the whole source; "
                             f"got {self.max_conversations}")
        if self.messages_field and self.prompt_field:
            raise ValueError(f"data.messages_field ('{self.messages_field}') and data.prompt_field "
                             f"('{self.prompt_field}') name two ways to read a chat: set one")
        if isinstance(self.thinking, bool):          # YAML reads a bare on/off as true/false
            self.thinking = "on" if self.thinking else "off"
        if self.thinking not in THINKING:
            raise ValueError(f"data.thinking must be one of {', '.join(THINKING)}, got '{self.thinking}'")
        if not self.thinking_switch.isidentifier():
            raise ValueError(f"data.thinking_switch must be the name of a template argument (enable_thinking), "
                             f"got '{self.thinking_switch}'")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"data.max_minutes must be > 0, or null for no cap; got {self.max_minutes}")


    def template_kwargs(self, conversation_id: str, seed: int) -> dict | None:
        """The template arguments of one conversation's rendering in the data step (over the target's own):
        none for data.thinking=template; for both, the conversation's side, stable under resume and any
        process count."""
        if self.thinking == "template":
            return None
        on = self.thinking == "on" or (self.thinking == "both" and thinks(conversation_id, seed))
        return {self.thinking_switch: on}


THINKING = ("template", "on", "off", "both")


def thinks(conversation_id: str, seed: int) -> bool:
    """data.thinking=both: whether this conversation is rendered with reasoning on (half of them)."""
    return hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()[0] & 1 == 1


# settings added after data was first made: at these values, absent from the fingerprint (same shards)
COLUMN_DEFAULTS = {"split": "train", "messages_field": None, "prompt_field": None, "streaming": False,
                   "thinking": "template", "thinking_switch": "enable_thinking"}


def columns(settings: DataSettings) -> sources.Columns:
    return sources.Columns(split=settings.split, messages_field=settings.messages_field,
                           prompt_field=settings.prompt_field, streaming=settings.streaming)
