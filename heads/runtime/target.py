"""The frozen target model: loading, identity, features and the engine's block forward.

Layer ids follow docs/design.md: `i` is Hugging Face `hidden_states[i]`, the INPUT
of decoder layer i (0 = embeddings); `N` (the layer count) is the output
after the final norm.  transformers 5.x records the last layer's output
before the norm as `hidden_states[N]`, so layer N is always taken from
`last_hidden_state` here and never from that index.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.heads.infra.device import check_device_map, resolve_device
from draftsmith.heads.runtime import engine
from draftsmith.heads.runtime.adapter import Adapter
from draftsmith.heads.runtime.assets import resolve_target_path
from draftsmith.heads.runtime.cpu_linear import fbgemm_fp16_available, pack_linears
from draftsmith.heads.runtime.embedding_lm_head import load_embedding_and_lm_head
from draftsmith.heads.runtime.identity import TargetError, TargetIdentity, base_identity, text_config
from draftsmith.heads.runtime.prompt_format import apply_chat_settings

log = logging.getLogger(__name__)


@dataclass
class BlockOutput:
    """Result of one engine forward over n new tokens."""

    logits: torch.Tensor | None            # [b, n, v] (float32), None if not asked for
    hidden_states: dict[int, torch.Tensor]  # layer id -> [b, n, d]


def _require_causal_lm(model_dir: Path, path: str) -> None:
    """A saved config that names its architecture must name a causal LM (BERT's encoder is not one)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if architectures and not any("CausalLM" in a or "LMHead" in a or "ForConditionalGeneration" in a
                                 for a in architectures):
        raise TargetError(f"target '{path}' is not a causal LM (its config names {architectures}); draftsmith "
                          "needs a decoder-only model such as *ForCausalLM")


def _require_decodable_layers(model_dir: Path, trust_remote_code: bool) -> None:
    """Refuse, from the config alone, a target whose layers the engine cannot decode (layer_types_of)."""
    if not (model_dir / "config.json").is_file():
        return                                          # a GGUF file: checked once the model is built
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    except (ValueError, KeyError, OSError):
        return                                          # from_pretrained below names the problem
    config = config.get_text_config(decoder=True)
    layer_types_of(config, int(getattr(config, "num_hidden_layers", 0) or 0))


def layer_types_of(config, num_layers: int) -> list[str]:
    """Each decoder layer's kind in transformers' cache vocabulary (full_attention, sliding_attention,
    linear_attention, ...); a layer kind the engine cannot decode is refused by name (`TargetError`)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        types = list(get_layer_types_and_kwargs(config)[0])[:num_layers or None]
    except Exception:                    # an older transformers, or a custom config: what the config names
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)[:num_layers or None]
    known = engine.ATTENTION_LAYER_TYPES + engine.RECURRENT_LAYER_TYPES + ("dummy",)
    unknown = sorted(set(t for t in types if t not in known))
    if getattr(config, "kv_sharing_modes", None) or getattr(config, "num_kv_shared_layers", 0):
        unknown.append("KV-sharing")            # layers reading another layer's keys and values (Gemma-3n)
    if unknown:
        raise TargetError(
            f"target model type '{getattr(config, 'model_type', '?')}' has {unknown} layers, which draftsmith's "
            "engine cannot decode (it knows attention, sliding-window attention, and linear-attention/Mamba "
            "layers); training on a feature cache and data.mode=prefill do not decode, so they may still work. "
            "See docs/targets.md")
    if any(t in engine.RECURRENT_LAYER_TYPES for t in types):
        try:
            engine.recurrent_layer_classes()
        except RuntimeError as err:
            raise TargetError(f"target model type '{getattr(config, 'model_type', '?')}': {err}") from None
    return types


def preferred_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 where the device computes it natively (CUDA with bf16, CPUs with AVX512-BF16/AMX); on other
    x86 CPUs float16, i.e. fp16 weights packed for decoding with fp32 activations (heads/runtime/cpu_linear.py);
    else fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            return torch.bfloat16
        return torch.float16 if fbgemm_fp16_available() else torch.float32
    return torch.float32


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """'auto' | 'bfloat16' | 'float32' (or a torch dtype) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return preferred_dtype(device)
    if name not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got '{name}'")
    return getattr(torch, name)


class Target:
    """A frozen Hugging Face causal LM (with its LoRA adapter, if any) with what drafters need from it."""

    def __init__(self, model: nn.Module, tokenizer, name: str, identity: TargetIdentity | None = None):
        """identity: given when `model` carries a LoRA adapter (the base's hashes and the adapter's)."""
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.config = text_config(model)
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.decoder = model.get_decoder()
        self.embed_tokens: nn.Module = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.identity = identity or base_identity(model, name)
        self.adapter: Adapter | None = None                    # set by load()
        self.layers_loaded = True      # False: embedding and lm_head only (heads/runtime/embedding_lm_head.py)
        self.chat: dict | None = None  # set_chat(): a template, its arguments and stop tokens of the recipe's own
        self.eos_token_ids = self._eos_ids()
        self.source = name
        self.precision = str(self.dtype).replace("torch.", "")     # what the forwards compute in
        self.dtype_setting: str = self.precision    # what was asked ('auto', ...): load() sets it
        self.layer_types = layer_types_of(self.config, self.num_layers)
        self.recurrent = any(t in engine.RECURRENT_LAYER_TYPES for t in self.layer_types)

    # -- loading ---------------------------------------------------------------
    @classmethod
    def load(cls, path: str = "smollm2-135m", dtype: str | torch.dtype = "auto",
             device: str | torch.device | None = "auto", trust_remote_code: bool = False,
             adapter: str | Path | None = None, merge_adapter: bool = True, layers: bool = True,
             device_map=None, chat: dict | None = None) -> Target:
        """Load a target from a local HF directory, a hub id in the local cache, a .gguf file or 'smollm2-135m'.

        device: 'auto' (cuda when present, else cpu), or a device name (heads/infra/device.py);
        dtype 'auto' is bf16 where that device computes it natively; adapter: a peft LoRA directory
        put on the model (merged into its weights unless merge_adapter is false); layers=False: only
        the embedding and lm_head, when the files allow it and there is no adapter (heads/runtime/embedding_lm_head.py);
        device_map: spread the layers over several devices (heads/infra/device.py, check_device_map); inputs
        then go to the embedding's device, and hidden states and logits come back there."""
        device = resolve_device(device)
        lora = Adapter.read(adapter, merge_adapter) if adapter else None      # checked before the model loads
        model_dir, name = resolve_target_path(path, trust_remote_code=trust_remote_code)
        _require_causal_lm(Path(model_dir), path)
        _require_decodable_layers(Path(model_dir), trust_remote_code)        # before any weight is read
        torch_dtype = resolve_dtype(dtype, device)
        device_map = check_device_map(device_map)
        if not layers and lora is None:
            heads_dtype = torch.float32 if torch_dtype == torch.float16 and device.type == "cpu" else torch_dtype
            loaded = load_embedding_and_lm_head(Path(model_dir), name, heads_dtype, device, trust_remote_code)
            if loaded is not None:
                target = cls(loaded.model, loaded.tokenizer, name, loaded.identity)
                target.layers_loaded = False
                target.dtype_setting = str(dtype).replace("torch.", "")
                target.source = path if not Path(path).expanduser().exists() else str(Path(path).expanduser().resolve())
                target.set_chat(chat)
                return target
        # float16 on a CPU: fp32 weights, plus fp16 copies packed for small blocks (heads/runtime/cpu_linear.py)
        packed = torch_dtype == torch.float16 and device.type == "cpu"
        # onto an accelerator straight from the files: built on the host first, 8 ranks of an 8B target would
        # hold about 128 GB of host memory at once
        placement = device_map or ({"": str(device)} if device.type == "cuda" else None)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32 if packed else torch_dtype, attn_implementation=engine.ENGINE_ATTENTION,
                trust_remote_code=trust_remote_code, local_files_only=True,
                # transformers >= 5.20 swaps in hub kernels (remote code) on CUDA unless told not to: they
                # would replace layers the engine reads (rotary) and fail offline; tests/test_gpu_shaped.py
                use_kernels=False, **({"device_map": placement} if placement else {}))
        except (ValueError, KeyError) as err:
            raise TargetError(f"target '{path}' ({model_dir}) does not load as a causal LM: {err}") from err
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)
        if not placement:
            model = model.to(device)
        identity = None
        if lora is not None:
            identity = dataclasses.replace(base_identity(model, name), adapter_sha256=lora.sha256)
            model = lora.apply(model, name)
        precision = str(torch_dtype).replace("torch.", "")
        if packed:
            if fbgemm_fp16_available():
                pack_linears(model)
                precision = "float16 (fp16 weights packed for CPU decoding, fp32 activations)"
            else:
                log.warning("float16 on this CPU needs FBGEMM, which this PyTorch lacks: using float32")
                precision = "float32"
        target = cls(model, tokenizer, name, identity)
        target.adapter = lora
        target.precision = precision
        target.dtype_setting = str(dtype).replace("torch.", "")
        # where it came from, to find it again (an embedded name, or an absolute local path)
        target.source = path if not Path(path).expanduser().exists() else str(Path(path).expanduser().resolve())
        target.set_chat(chat)
        target.self_check()
        return target

    def set_chat(self, chat: dict | None) -> None:
        """How this target is prompted (target.chat_template, chat_template_kwargs, stop_tokens): on its
        tokenizer, which every verb renders through, and in its end-of-turn ids.  `self.chat` is what a
        checkpoint and the data fingerprint record (None: the model's own template and EOS)."""
        chat = {k: v for k, v in (chat or {}).items() if v not in (None, {}, [], ())}
        apply_chat_settings(self.tokenizer, chat.get("template"), chat.get("kwargs"))
        extra = []
        for token in chat.get("stop_tokens", []):
            token_id = token if isinstance(token, int) else self.tokenizer.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or token_id < 0 or token_id >= self.vocab_size or (
                    isinstance(token, str) and token_id == self.tokenizer.unk_token_id):
                raise TargetError(f"target.stop_tokens: {token!r} is not a token of target '{self.name}'; give "
                                  "a token string from its vocabulary (e.g. '<|im_end|>') or a token id")
            extra.append(token_id)
        self.eos_token_ids = sorted(set(self.eos_token_ids) | set(extra))
        self.chat = chat or None

    def _eos_ids(self) -> list[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update([value] if isinstance(value, int) else list(value))
        return sorted(ids)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def context_length(self) -> int | None:
        """The positions the target was built for (max_position_embeddings), where its config says."""
        value = getattr(self.config, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) and value > 0 else None

    # -- pieces drafters reuse -------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target logits from final (normed) hidden states, as the model's own head computes them.

        hidden: [..., d] -> [..., v]
        """
        # Flattened to 2D: a strided 3D input makes linear() expand the weight per row.
        weight = self.lm_head.weight                  # on another device than the input under a device_map
        flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.device, weight.dtype)
        logits = self.lm_head(flat).view(*hidden.shape[:-1], -1).to(hidden.device)
        scale = getattr(self.config, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def require_layers(self, what: str) -> None:
        if not self.layers_loaded:
            raise TargetError(f"{what} needs the target's layers, but target '{self.name}' was loaded with its "
                              "embedding and lm_head only (cache-mode training, export): load it whole")

    def check_layer_ids(self, layer_ids, what: str = "layer ids") -> tuple[int, ...]:
        layer_ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise TargetError(
                f"{what} {list(layer_ids)}: {bad} out of range for target '{self.name}' with {self.num_layers} "
                f"layers; valid ids are 0 (embeddings) .. {self.num_layers} (final normed output)")
        return layer_ids

    # -- forwards --------------------------------------------------------------
    def _collect(self, out, layer_ids) -> dict[int, torch.Tensor]:
        hidden = {}
        for i in layer_ids:             # all on the target's (its embedding's) device, even under a device_map
            hidden[i] = (out.last_hidden_state if i == self.num_layers else out.hidden_states[i]).to(self.device)
        return hidden

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 layer_ids) -> dict[int, torch.Tensor]:
        """Hidden states for training: input_ids [b, s] -> {layer id: [b, s, d]} (no grad)."""
        self.require_layers("computing hidden states")
        layer_ids = self.check_layer_ids(layer_ids)
        need_all = any(i != self.num_layers for i in layer_ids)
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                           output_hidden_states=need_all)
        return self._collect(out, layer_ids)

    def new_cache(self, batch_size: int, capacity: int) -> engine.EngineCache:
        """An engine cache; for a hybrid target it also carries the recurrent layers' states (recording the
        last tokens of each block, so a rejected draft can be rolled back)."""
        recurrent = engine.recurrent_cache(self.layer_types) if self.recurrent else None
        attention = sum(t in engine.ATTENTION_LAYER_TYPES for t in self.layer_types)
        return engine.EngineCache(batch_size, capacity, self.num_layers, device=self.device, recurrent=recurrent,
                                  attention_layers=attention)

    @torch.no_grad()
    def forward_block(self, cache: engine.EngineCache, input_ids: torch.Tensor, positions: torch.Tensor,
                      block_mask: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                      layer_ids=(), logits: str = "all") -> BlockOutput:
        """One cached forward over a block of n new tokens; their keys/values stay in the cache.

        input_ids, positions: [b, n]; block_mask: [b, n, n] bool among the new
        tokens (None = causal); valid: [b, n] (None = all real tokens).
        logits: "all" ([b, n, v]), "last" ([b, 1, v]) or "none".
        """
        self.require_layers("decoding")
        need_all = any(i != self.num_layers for i in layer_ids)
        cache.begin_block(positions, block_mask, valid)
        b, n = input_ids.shape
        dummy_mask = torch.ones(b, 1, n, 1, dtype=torch.bool, device=input_ids.device)  # 4D: skips HF mask building
        recurrent = {"cache": cache.recurrent, "use_cache": True} if cache.recurrent is not None else {
            "use_cache": False}
        if cache.recurrent is not None and valid is not None and not bool(valid.all()):
            raise TargetError(f"target '{self.name}' has recurrent layers, which would read left padding as tokens: "
                              "decode its prompts one at a time (no padded batches)")
        out = self.decoder(input_ids=input_ids, position_ids=positions, attention_mask=dummy_mask,
                           output_hidden_states=need_all, **recurrent, **{engine.CACHE_KWARG: cache})
        cache.end_block()
        # The decoder is called directly, past the hook accelerate puts on the top-level model only: under a
        # device_map its output is on the final norm's device; the logits go back to the caller's device.
        hidden = out.last_hidden_state
        result = None
        if logits == "all":
            result = self.compute_logits(hidden).float().to(input_ids.device)
        elif logits == "last":
            result = self.compute_logits(hidden[:, -1:]).float().to(input_ids.device)
        return BlockOutput(logits=result, hidden_states=self._collect(out, layer_ids))

    @torch.no_grad()
    def reference_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers' own greedy `generate`, with the model's own eager attention and transformers' cache
        (nothing of draftsmith's engine): the tokens after `prompt`, the stop token included."""
        ids = torch.tensor([prompt], device=self.device)
        self.model.set_attn_implementation("eager")
        try:
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.eos_token_ids,
                                      pad_token_id=self.eos_token_ids[0], top_k=None, top_p=None, temperature=None)
        finally:
            self.model.set_attn_implementation(engine.ENGINE_ATTENTION)
        tokens = out[0, len(prompt):].tolist()
        stop = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)
        return tokens if stop is None else tokens[:stop + 1]

    @torch.no_grad()
    def logit_gap(self, ids: list[int], a: int, b: int) -> tuple[float, float]:
        """The eager model's next-token logits after `ids`: (|logit a - logit b|, the largest |logit|)."""
        self.model.set_attn_implementation("eager")
        try:
            logits = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False).logits[0, -1]
        finally:
            self.model.set_attn_implementation(engine.ENGINE_ATTENTION)
        return abs(float(logits[a] - logits[b])), float(logits.abs().max())

    def self_check(self) -> None:
        """The engine and `compute_logits` must reproduce the model's own forward."""
        ids = torch.tensor([[1, 2, 3, 4, 5]], device=self.device) % self.vocab_size
        with torch.no_grad():
            reference = self.model(input_ids=ids, use_cache=False).logits.float()
            cache = self.new_cache(1, 8)
            try:
                first = self.forward_block(cache, ids[:, :3], torch.arange(3, device=self.device)[None]).logits
                second = self.forward_block(cache, ids[:, 3:], torch.arange(3, 5, device=self.device)[None]).logits
            except RuntimeError as err:      # a layer that neither attends through the engine nor is recurrent
                raise TargetError(f"target '{self.name}' ({self.config.model_type}) cannot be decoded by "
                                  f"draftsmith's engine: {err}. See docs/targets.md") from err
        ours = torch.cat([first, second], dim=1)
        if self.dtype == torch.float32:
            err = (ours - reference).abs().max().item()
            ok = err <= 1e-4 * (1.0 + reference.abs().max().item())
        else:  # bf16 alone moves logits by several units: compare directions
            err = 1.0 - torch.nn.functional.cosine_similarity(ours, reference, dim=-1).min().item()
            ok = err <= 5e-3
        if not ok:
            raise TargetError(
                f"draftsmith's engine disagrees with target '{self.name}' ({self.config.model_type}) by {err:.3g} "
                "in logits: this architecture computes something the engine does not know about "
                "(custom attention or output head); please report it with the model type")
