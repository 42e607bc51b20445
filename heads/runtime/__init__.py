"""The target runtime: loading a Hugging Face causal LM (any source), its identity, its prompt format, LoRA
adapters, and the decoding engine's KV cache and attention."""
