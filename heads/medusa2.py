"""Medusa-2: Medusa heads trained jointly with a LoRA on the target's backbone (peft).

The backbone changes, so the speculative output is exact for the ADAPTED model, not the original.
Self-distillation keeps the two close: the base loss is the KL from the original model's next-token
distribution (the same model with the adapter disabled) to the adapted one, at every reply
position; the heads' Medusa loss is added with a coefficient that rises along a sine ramp
(Medusa paper: 0.01 under self-distillation; heads learning rate x4).  Stage 1 trains the heads
alone on the frozen backbone (`heads_only_steps`), then both train together.

The checkpoint is an ordinary Medusa checkpoint (kind `medusa`: eval, bench and export read it as
one) whose target is base + the LoRA adapter it trained, saved beside the heads in peft's own format
(`adapter/adapter_config.json`, `adapter/adapter_model.safetensors`, loadable by
`peft.PeftModel.from_pretrained`).  The checkpoint names it (`target_adapter: adapter`), so every verb
loads the adapted target (heads/runtime/adapter.py), and `draftsmith eval` reports the drift from the original.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from draftsmith.heads.drafter import StepOutput, divide, term_denominators
from draftsmith.heads.infra.files import write_atomic
from draftsmith.heads.infra.kept import read_kept_json
from draftsmith.heads.medusa import Medusa, MedusaConfig
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.adapter import Adapter
from draftsmith.heads.runtime.target import Target

ADAPTER_DIR = "adapter"
STATE_FILE = "medusa2.json"
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Medusa2Config(MedusaConfig):
    lora_r: int = 32
    """LoRA rank on the backbone (Medusa-2: 32)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (Medusa-2: 16)."""
    lora_modules: list[str] = field(default_factory=lambda: list(LORA_MODULES))
    """Backbone linear layers that get a LoRA (Medusa-2: attention and MLP projections)."""
    heads_coefficient: float = 0.01
    """Weight of the heads' loss beside the KL in the joint stage (Medusa-2 self-distillation: 0.01)."""
    ramp_steps: int = 100
    """Micro-batches over which that weight rises along a sine ramp from 0."""
    heads_only_steps: int = 50
    """Stage 1: micro-batches that train the heads alone on the frozen backbone."""
    heads_lr_scale: float = 4.0
    """The heads' learning rate is train.lr times this; the LoRA's is train.lr."""

    def __post_init__(self):
        super().__post_init__()
        if self.conditioning != "none":
            raise ValueError("medusa2 trains plain Medusa heads (drafter.conditioning: none)")
        if self.lora_r < 1 or not self.lora_modules:
            raise ValueError(f"medusa2 needs lora_r >= 1 and lora_modules, got {self.lora_r}, {self.lora_modules}")
        if self.heads_coefficient <= 0 or self.ramp_steps < 0 or self.heads_only_steps < 0:
            raise ValueError("medusa2 needs heads_coefficient > 0, ramp_steps >= 0 and heads_only_steps >= 0")

    def medusa(self) -> MedusaConfig:
        """The heads' own settings: what the checkpoint records (it loads as plain Medusa)."""
        names = {f.name for f in dataclasses.fields(MedusaConfig)}
        return MedusaConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


@register("medusa2")
class Medusa2(Medusa):
    title = "Medusa-2 heads"
    checkpoint_kind = "medusa"
    checkpoint_marker = "medusa2"         # config.json holds this key: the card says Medusa-2
    checkpoint_files = (STATE_FILE,)      # kept beside the weights (and pushed with them)
    config_class = Medusa2Config
    trains_target_adapter = True

    def __init__(self, config: Medusa2Config, target: Target):
        super().__init__(config.medusa(), target)
        self.joint = config
        self.metadata["medusa2"] = dataclasses.asdict(config)
        self.micro_steps = 0          # micro-batches trained (the ramp's clock; saved beside the adapter)
        self.backbone: nn.Module | None = None          # the LoRA-wrapped target, once training attaches it

    def attach_backbone(self) -> None:
        """Training only: put the LoRA into the target's own modules (the target is then base + LoRA)."""
        if self.backbone is None:
            self.backbone = self._attach_lora(self.target)

    # build_drafter sets this for greedy data; Medusa-2's labels are always the adapted model's own choices
    data_is_target_greedy = property(lambda self: False, lambda self, value: None)

    def _attach_lora(self, target: Target) -> nn.Module:
        if target.adapter is not None:
            raise ValueError("method medusa2 trains its own LoRA adapter on the target: leave target.adapter empty "
                             "(merge an existing adapter into the model and give that as target.path)")
        frozen = [name for name, m in target.model.named_modules() if type(m).__name__ == "PackedLinear"]
        if frozen or not target.dtype.is_floating_point or target.dtype == torch.float16:
            raise ValueError(f"method medusa2 trains the target's backbone, but this target cannot take gradients "
                             f"({target.precision}): load it with target.dtype=float32 (or bfloat16 where the "
                             "hardware has it); quantized or packed weights cannot be trained")
        settings = LoraConfig(r=self.joint.lora_r, lora_alpha=self.joint.lora_alpha, lora_dropout=0.0,
                              target_modules=list(self.joint.lora_modules), bias="none")
        try:
            model = get_peft_model(target.model, settings)      # LoRA layers put into the target's own modules
        except ValueError as err:
            raise ValueError(f"drafter.lora_modules {list(self.joint.lora_modules)} do not fit this target: {err}") from None
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
        return model

    # -- what is saved: the heads in model.safetensors, the LoRA in adapter/ ------------------------
    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        for key in [k for k in state if "backbone." in k]:
            del state[key]
        return state

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if not k.startswith("backbone.")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"medusa2 state does not fit: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
        return result

    def save_adapter(self, directory: Path) -> str:
        """Write the LoRA in peft's format into directory/adapter; returns the adapter's hash."""
        self.backbone.save_pretrained(str(Path(directory) / ADAPTER_DIR), safe_serialization=True)
        write_atomic(Path(directory) / STATE_FILE, json.dumps({"micro_steps": self.micro_steps}))
        return Adapter.read(Path(directory) / ADAPTER_DIR).sha256

    def load_adapter(self, directory: Path) -> None:
        """Resume: the LoRA weights saved in directory/adapter."""
        weights = load_file(str(Path(directory) / ADAPTER_DIR / "adapter_model.safetensors"))
        set_peft_model_state_dict(self.backbone, weights)
        self.micro_steps = read_kept_json(Path(directory) / STATE_FILE, "Medusa-2's LoRA warm-up position",
                                          "Start without resume=true, or restore the file from a copy",
                                          {"micro_steps": int})["micro_steps"]

    def param_groups(self, lr: float) -> list[dict]:
        """One optimizer, two learning rates: the heads at lr x heads_lr_scale, the LoRA at lr."""
        lora = [p for n, p in self.named_parameters() if p.requires_grad and n.startswith("backbone.")]
        heads = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("backbone.")]
        return [{"params": heads, "lr": lr * self.joint.heads_lr_scale}, {"params": lora, "lr": lr}]

    # -- training ----------------------------------------------------------------------------------
    def heads_weight(self, micro_step: int) -> float:
        """0 in stage 1 (the heads' loss alone is trained), then heads_coefficient * sin ramp."""
        joint_step = micro_step - self.joint.heads_only_steps
        if joint_step < 0:
            return 0.0
        ramp = 1.0 if self.joint.ramp_steps == 0 else min(1.0, (joint_step + 1) / self.joint.ramp_steps)
        return self.joint.heads_coefficient * math.sin(0.5 * math.pi * ramp)

    def enable_gradient_checkpointing(self) -> bool:
        """The adapted backbone's decoder layers are recomputed in backward (transformers' own
        checkpointing, non-reentrant).  It acts in train mode only, so the decoder is put in train mode
        for the joint forward, with every dropout at 0: the same computation as in eval mode."""
        if self.backbone is None:
            raise RuntimeError("enable_gradient_checkpointing needs attach_backbone() first (training does it)")
        model = self.target.model
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        for key in ("attention_dropout", "hidden_dropout", "dropout"):
            if getattr(model.config, key, 0):
                setattr(model.config, key, 0.0)
        if hasattr(model, "activation_checkpointing_enable"):        # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.gradient_checkpointing = True
        return True

    def _adapted_hidden(self, batch: dict, grad: bool) -> torch.Tensor:
        decoder = self.target.decoder
        checkpointed = grad and self.gradient_checkpointing
        if checkpointed:
            decoder.train()                 # transformers checkpoints only in train mode (dropout is 0)
        try:
            with torch.set_grad_enabled(grad):
                return decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               use_cache=False).last_hidden_state
        finally:
            if checkpointed:
                decoder.eval()

    def distill_kl(self, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
        """Summed KL(original || adapted) of the next-token distribution over the reply positions."""
        scored = batch["loss_mask"][:, 1:].bool().nonzero(as_tuple=True)   # t predicts reply token t+1
        with torch.no_grad(), self.backbone.disable_adapter():
            original = self._adapted_hidden(batch, grad=False)[:, :-1][scored]
        adapted = hidden[:, :-1][scored]
        total = adapted.new_zeros((), dtype=torch.float32)
        for a, o in zip(adapted.split(512), original.split(512)):
            log_p = F.log_softmax(self.target.compute_logits(o).float(), -1)
            log_q = F.log_softmax(self.target.compute_logits(a).float(), -1)
            total = total + F.kl_div(log_q, log_p, log_target=True, reduction="sum")
        return total

    def loss(self, batch: dict) -> StepOutput:
        if self.backbone is None:
            raise RuntimeError("Medusa2.loss needs attach_backbone() first (training does it)")
        step = self.micro_steps
        if self.training:
            self.micro_steps += 1
        joint = self.heads_weight(step) > 0 and self.training
        given = batch.get("features", {}).get(self.target.num_layers)     # validation: the adapted target's
        hidden = given if given is not None and not joint else self._adapted_hidden(batch, grad=joint)
        given_denominators = batch.get("loss_denominators")
        heads_batch = {**batch, "features": {self.target.num_layers: hidden if joint else hidden.detach()}}
        if given_denominators is not None:
            heads_batch["loss_denominators"] = given_denominators[1:]
        heads = super().loss(heads_batch)
        if not joint:
            return heads
        kl = divide(self.distill_kl(batch, hidden), term_denominators(batch, self.loss_counts(batch))[0])
        return StepOutput(loss=kl + self.heads_weight(step) * heads.loss, correct=heads.correct, counted=heads.counted)

    def loss_counts(self, batch: dict) -> torch.Tensor:
        """[1 + k]: the reply positions the KL term averages over, then the heads' (Medusa's)."""
        kl_positions = batch["loss_mask"][:, 1:].bool().sum().float()[None]
        return torch.cat([kl_positions, self._head_counts(batch).to(kl_positions.device)])

    @torch.no_grad()
    def topk_hits(self, batch: dict | None, top: int = 10):
        if batch is not None and self.target.num_layers not in batch.get("features", {}):
            batch = {**batch, "features": {self.target.num_layers: self._adapted_hidden(batch, grad=False)}}
        return super().topk_hits(batch, top)

    @property
    def required_layers(self) -> tuple[int, ...]:
        """Training computes its own features (with gradients through the LoRA); none are cached or
        handed in.  Evaluation reads the (adapted) target's final layer, as Medusa does."""
        return () if self.training else (self.target.num_layers,)
