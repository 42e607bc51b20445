"""Tiny models built in-process: 2 layers, hidden 64, a word-level vocabulary of a few hundred tokens.

Nothing is downloaded.  A tiny target is saved to a temporary directory with
its tokenizer, so tests load it through the same path as a user's local
Hugging Face directory.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["the", "a", "an", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as", "I", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "not", "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new", "work", "part", "take", "get", "place", "made", "live", "where", "after", "back", "little", "only", "round", "man", "year", "came", "show", "every", "good", "me", "give", "our", "under", "name", "very", "through", "just", "form", "sentence", "great", "think", "say", "help", "low", "line", "differ", "turn", "cause", "much", "mean", "before", "move", "right", "boy", "old", "too", "same", "tell", "does", "set", "three", "want", "air", "well", "also", "play", "small", "end", "put", "home", "read", "hand", "port", "large", "spell", "add", "even", "land", "here", "must", "big", "high", "such", "follow", "act", "why", "ask", "men", "change", "went", "light", "kind", "off", "need", "house", "picture", "try", "us", "again", "animal", "point", "mother", "world", "near", "build", "self", "earth", "father", "head", "stand", "own", "page", "should", "country", "found", "answer", "school", "grow", "study", "still", "learn", "plant", "cover", "food", "sun", "four", "between", "state", "keep", "eye", "never", "last", "let", "thought", "city", "tree", "cross", "farm", "hard", "start", "might", "story", "saw", "far", "sea", "draw", "left", "late", "run", "don't", "while", "press", "close", "night", "real", "life", "few", "north", "open", "seem", "together", "next", "white", "children", "begin", "got", "walk", "example", "ease", "paper", "group", "always", "music", "those", "both", "mark", "often", "letter", "until", "mile", "river", "car", "feet", "care", "second", "book", "carry", "took", "science", "eat", "room", "friend", "began", "idea", "fish", "mountain", "stop", "once", "base", "hear", "horse", "cut", "sure", "watch", "color", "face", "wood", "main", "enough", "plain", "girl", "usual", "young", "ready", "above", "ever", "red", "list", "though", "feel", "talk", "bird", "soon", "body", "dog", "family", "direct", "pose", "leave", "song", "measure", "door", "product", "black", "short", "numeral", "class", "wind", "question", "happen", "complete", "ship", "area", "half", "rock", "order", "fire", "south", "problem", "piece", "told", "knew", "pass", "since", "top", "whole", "king", "space", "heard", "best", "hour", "better", "true", "during", "hundred", "five", "remember", "step", "early", "hold", "west", "ground", "interest", "reach", "fast", "verb", "sing", "listen", "six", "table", "travel", "less", "morning", "ten", "simple", "several", "vowel", "toward", "war", "lay", "against", "pattern", "slow", "center", ".", ",", "?", "!", ":", "(", ")", "def", "return", "print", "=", "+", "-", "*", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
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


def make_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 2):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2,
                  pad_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(family)


def build_tiny_target(directory: Path, family: str = "llama", seed: int = 0, vocab_size: int | None = None,
                      sharpen: float = 4.0, layers: int = 2):
    """Save a random tiny causal LM + tokenizer to `directory`; `sharpen` scales the output head so
    the model's distributions are peaked like a trained model's (and greedy runs are not all ties)."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(vocab_size)
    torch.manual_seed(seed)
    config = make_config(family, len(tok), layers=layers)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from draftsmith.heads.target import Target

    return Target.load(str(tiny_target_dir), "float32")


# -- the real default target (slow and serving tests) ------------------------------------------

@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """Self-distilled data on SmolLM2-135M, then 45 s of training each for an EAGLE-3, a Medusa and a
    Medusa-2 drafter.  Medusa scores the full vocabulary (vLLM 0.32 cannot load a Medusa token_map)."""
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import recipe_from_dict

    out = tmp_path_factory.mktemp("default-run")
    common = {
        "output_dir": str(out), "seed": 0, "target": {"path": "smollm2-135m"},
        "data": {"max_conversations": 64, "batch_size": 32, "max_new_tokens": 96, "max_prompt_tokens": 128},
        "train": {"batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "epochs": 20, "max_minutes": 0.75,
                  "save_every": 1000, "heldout_fraction": 0.1},
    }
    runs = {}
    medusa = {"num_heads": 3, "lm_head": "shared", "draft_vocab_size": None}
    for method, drafter in (("eagle3", {"layer_ids": [2, 15, 27], "draft_vocab_size": 2048, "ttt_steps": 2,
                                         "tree": {"depth": 3, "top_k": 1, "total_tokens": 3}}),
                            ("medusa", medusa),
                            ("medusa2", {**medusa, "lora_r": 8, "lora_alpha": 16, "heads_only_steps": 5,
                                         "ramp_steps": 5})):
        spec = {**common, "method": method, "drafter": drafter, "output_dir": str(out / method)}
        if method == "medusa2":  # its backbone takes gradients: an unpacked target
            spec["target"] = {"path": "smollm2-135m", "dtype": "float32"}
        if method != "eagle3":   # the same data (and cache: layer 30 is among EAGLE-3's), no second generation
            import shutil
            shutil.copytree(out / "eagle3" / "data", out / method / "data")
        report = fit(recipe_from_dict(spec), progress=False)
        runs[method] = report.checkpoint
    return runs


def kill_at_step(proc, checkpoint: Path, step: int, group: bool = False, timeout: float = 300) -> dict:
    """SIGKILL `proc` (its whole process group with group=True) once the checkpoint in `checkpoint`
    has saved `step` steps; returns the saved progress (what a resume starts from)."""
    import json
    import signal
    import time

    progress = Path(checkpoint) / "state" / "progress.json"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if progress.exists() and json.loads(progress.read_text() or "{}").get("step", 0) >= step:
            break
        time.sleep(0.01)
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    return json.loads(progress.read_text())
