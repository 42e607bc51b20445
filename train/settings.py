"""Recipes: typed settings read from YAML, with key=value overrides.

A recipe has the sections target, data, drafter (the method's own config
dataclass), train and eval, plus a few top-level keys.  Every section is a
dataclass checked on construction; an unknown key anywhere is an error that
names it and lists the valid keys.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from draftsmith.data.distill import DataSettings
from draftsmith.heads.decoding.settings import EvalSettings
from draftsmith.heads.infra import strict_yaml
from draftsmith.heads.infra.config import ConfigError, coerce, config_from_dict
from draftsmith.heads.infra.device import DeviceError, check_device_map, resolve_device
from draftsmith.heads.registry import registry
from draftsmith.heads.runtime.adapter import Adapter, AdapterError
from draftsmith.heads.runtime.prompt_format import TEMPLATE_SYNTAX, TemplateError, template_text
from draftsmith.heads.runtime.target import Target


class RecipeError(ConfigError):
    """A recipe that does not describe a valid run."""


@dataclass
class TargetSettings:
    path: str = "smollm2-135m"
    """A local HF directory, a hub id in the local cache, a .gguf file, or 'smollm2-135m'."""
    dtype: str = "auto"
    """Target weights: auto (bf16 where native; float16 = packed fp16 weights on other x86 CPUs), bfloat16,
    float16 or float32."""
    device: str = "auto"
    """Where the target, drafter and data live: auto (cuda when present, else cpu), cpu, cuda or cuda:N."""
    trust_remote_code: bool = False
    """Run the model repository's own code (only if you trust it)."""
    adapter: str | None = None
    """A peft LoRA adapter directory on the target (base + adapter is the target everywhere); null = none."""
    merge_adapter: bool = True
    """Merge the adapter into the weights (same outputs, the base's speed); false keeps peft's LoRA layers."""
    chat_template: str | None = None
    """How prompts are rendered everywhere (data, eval, bench): null = the model's own template; a Jinja
    string or file; or none = plain text continuation, for base models without a template."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Passed to apply_chat_template, e.g. {enable_thinking: false} for Qwen3-style reasoning templates."""
    stop_tokens: list = field(default_factory=list)
    """Extra end-of-turn tokens (strings from the vocabulary, or ids) for templates whose turn end is not EOS."""
    device_map: str | dict | None = None
    """A target bigger than one device: auto, balanced, balanced_low_0, sequential, or {module: device}
    (transformers' big-model loading), for data, evaluation and feature extraction; null = target.device."""

    def __post_init__(self):
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise RecipeError(f"target.dtype must be auto, bfloat16, float16 or float32, got '{self.dtype}'")
        try:
            resolve_device(self.device)
        except DeviceError as err:
            raise RecipeError(f"target.device: {err}") from None
        try:
            self.device_map = check_device_map(self.device_map)
        except DeviceError as err:
            raise RecipeError(f"target.device_map: {err}") from None
        if self.chat_template not in (None, "none"):
            try:
                template_text(self.chat_template)
            except TemplateError as err:
                raise RecipeError(str(err)) from None
        if self.adapter is not None:
            try:
                Adapter.read(self.adapter)                  # a bad adapter is named before anything loads
            except AdapterError as err:
                raise RecipeError(str(err)) from None

    def load(self, device=None, layers: bool = True):
        """The target these settings describe, on `device` (default: target.device); layers=False: its
        embedding and lm_head only, where that is possible (heads/runtime/embedding_lm_head.py)."""
        return Target.load(self.path, self.dtype, resolve_device(self.device if device is None else device),
                           trust_remote_code=self.trust_remote_code, adapter=self.adapter,
                           merge_adapter=self.merge_adapter, layers=layers, device_map=self.device_map,
                           chat=self.chat)

    @property
    def chat(self) -> dict | None:
        chat = {"template": self.chat_template, "kwargs": dict(self.chat_template_kwargs),
                "stop_tokens": list(self.stop_tokens)}
        return {k: v for k, v in chat.items() if v not in (None, {}, [])} or None


@dataclass
class TrainSettings:
    epochs: float = 1.0
    """Passes over the training conversations (fractions allowed)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (null: epochs decide)."""
    seed: int | None = None
    """The training seed (the drafter's initial weights and the batch order); null: the recipe's `seed`.
    Another value trains again on the same data with the same held-out split (those follow the recipe's
    seed, which the data is checked against), e.g. to measure a setting over two seeds."""
    max_minutes: float | None = None
    """Stop after this many minutes; the checkpoint at the cap is a normal checkpoint."""
    batch_size: int = 8
    """Sequences per micro-batch (per process)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    optimizer: str = "adamw"
    """adamw, or muon: Muon on the drafter's hidden matrices and AdamW on the rest (train/optimizers.py;
    DDP or one process: FSDP and DeepSpeed keep AdamW)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW's; Muon's too unless muon_lr is given)."""
    muon_lr: float | None = None
    """Muon's peak learning rate with train.optimizer muon (null: train.lr, speculators 0.9.0's rule; its
    later trainer uses 10 x lr)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 20
    """Linear warmup steps, then cosine decay to zero."""
    grad_clip: float = 1.0
    """Gradient norm clip (0 disables)."""
    mixed_precision: str = "auto"
    """auto (under accelerate launch the launcher's mixed_precision, else bf16 where supported), bf16 or no."""
    heldout_fraction: float = 0.05
    """Conversations held out for evaluation and tree calibration."""
    eval_every: int = 0
    """Held-out evaluation every N steps (0: only at the end)."""
    eval_prompts: int = 3
    """Held-out prompts decoded with the drafter at each evaluation (real tau and per-position acceptance)."""
    eval_max_new_tokens: int = 48
    """Tokens generated per held-out prompt at each evaluation."""
    save_every: int = 100
    """Checkpoint (with resume state) every N steps, and always at the end."""
    log_every: int = 10
    """Log training metrics every N steps."""
    features: str = "cache"
    """cache: target hidden states stored once (captured while generating the data); online: computed every step."""
    report_to: str = "none"
    """none, wandb or tensorboard (through accelerate's trackers)."""
    wandb_project: str = "draftsmith"
    """W&B project name."""
    dist_timeout_minutes: float = 120.0
    """How long a process waits for the others at a collective (accelerate's InitProcessGroupKwargs)
    before the launch is failed; the 10-minute default of torch.distributed is too short for a
    feature cache built or verified at scale."""
    verify_cache: str = "first-use"
    """When the feature cache's checksums are recomputed: first-use (once per shard, the first run that
    reads it; a stamp beside it records the check), always (every run) or never (header checks only)."""
    allow_reshard: bool = False
    """Resume under another number of processes (hence another global batch) than the run was saved with:
    refused unless true.  The data position is carried over in examples (batches x processes)."""
    gradient_checkpointing: bool = False
    """Recompute the drafter's activations (EAGLE's draft layer per test-time step, Medusa-2's backbone)
    in backward instead of keeping them: less memory at long sequences, the same gradients, more time."""
    loader_workers: int | None = None
    """DataLoader worker processes gathering and padding batches (features included); null: 4 on CUDA, 0 on CPU."""

    def __post_init__(self):
        self.betas = tuple(self.betas)
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise RecipeError(f"train.mixed_precision must be auto, bf16 or no, got '{self.mixed_precision}'")
        if self.optimizer not in ("adamw", "muon"):
            raise RecipeError(f"train.optimizer must be adamw or muon, got '{self.optimizer}'")
        if self.features not in ("cache", "online"):
            raise RecipeError(f"train.features must be cache or online, got '{self.features}'")
        if self.report_to not in ("none", "wandb", "tensorboard"):
            raise RecipeError(f"train.report_to must be none, wandb or tensorboard, got '{self.report_to}'")
        if self.verify_cache not in ("first-use", "always", "never"):
            raise RecipeError(f"train.verify_cache must be first-use, always or never, got '{self.verify_cache}'")
        if not self.dist_timeout_minutes > 0:
            raise RecipeError(f"train.dist_timeout_minutes must be a number of minutes > 0, got "
                              f"{self.dist_timeout_minutes}")
        if self.loader_workers is not None and self.loader_workers < 0:
            raise RecipeError(f"train.loader_workers must be >= 0, or null for the device's default; got "
                              f"{self.loader_workers}")
        if not 0 <= self.heldout_fraction < 1:
            raise RecipeError(f"train.heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        for name in ("batch_size", "grad_accum", "save_every", "log_every", "eval_max_new_tokens"):
            if getattr(self, name) < 1:
                raise RecipeError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not self.epochs > 0:
            raise RecipeError(f"train.epochs must be > 0 (fractions allowed), got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise RecipeError(f"train.max_steps must be >= 1, or null to let train.epochs decide; got {self.max_steps}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise RecipeError(f"train.max_minutes must be > 0, or null for no cap; got {self.max_minutes}")
        if self.muon_lr is not None and not self.muon_lr > 0:
            raise RecipeError(f"train.muon_lr must be > 0, or null for train.lr; got {self.muon_lr}")
        for name in ("lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every", "eval_prompts"):
            if getattr(self, name) < 0:
                raise RecipeError(f"train.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class Recipe:
    method: str
    """Drafter kind: medusa, medusa2, eagle or eagle3."""
    output_dir: str = "runs/default"
    """Where the run writes data/, checkpoint/, logs and eval.json."""
    seed: int = 0
    """Seeds data order, sampling, initialisation and batching."""
    resume: bool = False
    """Continue training from output_dir/checkpoint's saved state."""
    overwrite: bool = False
    """Train a new drafter over a trained checkpoint in output_dir (without it, train refuses to)."""
    target: TargetSettings = field(default_factory=TargetSettings)
    data: DataSettings = field(default_factory=DataSettings)
    drafter: object = None
    train: TrainSettings = field(default_factory=TrainSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)

    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for section in ("target", "data", "train", "eval"):     # what a run sets for itself is not a setting
            settable = {f.name for f in dataclasses.fields(getattr(self, section)) if f.init}
            d[section] = {k: v for k, v in d[section].items() if k in settable}
        for section in ("train", "eval"):
            for key, value in d[section].items():
                if isinstance(value, tuple):
                    d[section][key] = list(value)
        return d


SECTIONS = {"target": TargetSettings, "data": DataSettings, "train": TrainSettings, "eval": EvalSettings}


def _section(cls, values, name: str):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise RecipeError(f"recipe section '{name}' must be a mapping, got {type(values).__name__}")
    try:
        return config_from_dict(cls, values, f"recipe section '{name}'")
    except ValueError as err:
        raise RecipeError(str(err)) from None


def recipe_from_dict(raw: dict) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError("a recipe must be a YAML mapping")
    top = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise RecipeError(f"unknown recipe key(s) {unknown}; valid keys: {sorted(top)}")
    kinds = registry()
    method = raw.get("method")
    if method not in kinds:
        raise RecipeError(f"recipe 'method' must be one of {sorted(kinds)}, got {method!r}")
    values = {k: v for k, v in raw.items() if k not in SECTIONS and k != "drafter"}
    hints = typing.get_type_hints(Recipe)
    try:
        values = {k: coerce(v, hints[k], f"recipe key '{k}'") for k, v in values.items()}
    except ConfigError as err:
        raise RecipeError(str(err)) from None
    sections = {name: _section(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    drafter = _section(kinds[method].config_class, raw.get("drafter"), "drafter")
    recipe = Recipe(**values, **sections, drafter=drafter)
    check = getattr(drafter, "check_recipe", None)       # a drafter setting bounded by another section's
    if check is not None:
        try:
            check(recipe)
        except ValueError as err:
            raise RecipeError(str(err)) from None
    return recipe


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """key=value and section.key=value, values parsed as YAML (numbers, true/false, null, lists)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override '{item}' must look like key=value or section.key=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override '{item}': '{part}' is not a section")
        if any(mark in value for mark in TEMPLATE_SYNTAX):    # inline Jinja (target.chat_template): as given
            node[parts[-1]] = value
            continue
        try:
            node[parts[-1]] = strict_yaml.load(value) if value.strip() else None
        except (yaml.YAMLError, strict_yaml.StrictYAMLError) as err:
            raise RecipeError(f"override '{item}' is not a valid YAML value: {strict_yaml.one_line(err)}; quote "
                              "it, or close its brackets") from None
    return raw


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """A recipe file, or the name of one shipped with draftsmith (`draftsmith recipes`), with key=value
    overrides applied."""
    path = Path(path)
    if not path.is_file():
        shipped = resources.files("draftsmith.recipes").joinpath(f"{path.name.removesuffix('.yaml')}.yaml")
        if len(path.parts) != 1 or not shipped.is_file():
            raise RecipeError(f"recipe '{path}' does not exist (neither a file nor a shipped recipe: "
                              "see `draftsmith recipes`)")
        path = Path(str(shipped))
    try:
        raw = strict_yaml.load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, strict_yaml.StrictYAMLError) as err:
        raise RecipeError(f"recipe '{path}' is not valid YAML: {strict_yaml.one_line(err)}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"recipe '{path}' is not UTF-8 text") from None
    return recipe_from_dict(apply_overrides(raw, list(overrides)))


def save_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def loader_workers(settings, device) -> int:
    """train.loader_workers, or the device's default: 4 processes feeding a GPU, none on CPU (where
    they would take the cores the step runs on)."""
    if settings.loader_workers is not None:
        return settings.loader_workers
    return 4 if device.type == "cuda" else 0
