"""draftsmith's decoding engine: a preallocated KV cache and the attention that reads it.

Every target forward made while decoding (plain, speculative, batched data
generation) runs the Hugging Face model's own modules, but its attention goes
through `engine_attention`, registered with transformers' AttentionInterface
under the name "draftsmith".  The model is called without a transformers
cache; each attention layer instead writes its new keys/values into an
`EngineCache` handed down through the forward's keyword arguments, and attends
over the cached prefix plus the new block with a mask the cache built once for
the whole forward.  That gives three things the stock caches do not:

- a block of new tokens can carry any attention pattern (a token tree),
- the accepted path of a tree is compacted in place (`keep`), and
- no per-step `torch.cat` (on 2 CPU cores a grouped matmul attention over a
  preallocated cache decodes a batch of 64 about 2x faster than SDPA over a
  growing cache).

Outside the engine (training features, `generate`) the same registered name
falls back to SDPA, so one loaded model serves both.

Two kinds of layer need more than keys and values:
- attention with sinks (gpt-oss's `s_aux`): one learned logit per head joins each
  softmax and is dropped after it; both paths compute it (`attend_with_sinks`);
- recurrent layers (Qwen3-Next's gated DeltaNet, the Mamba layers of Granite-4 and
  Nemotron-H): their conv and recurrent states live in a transformers `Cache`
  (`EngineCache.recurrent`), recording each token's state during a block so a
  rejected draft is rolled back (`crop`) instead of recomputed.  A recurrent layer
  reads a block as a sequence, so over such a target a block must be a chain:
  trees are refused (`TreeOverRecurrentLayers`).
"""
from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ENGINE_ATTENTION = "draftsmith"
CACHE_KWARG = "draftsmith_cache"


class EngineCache:
    """Keys and values of the tokens committed so far, for a batch of sequences.

    Shape notation: b batch, h kv heads, c capacity, d head dim, n new tokens.
    Slot t of row r holds a token at position `positions[r, t]`; `valid[r, t]`
    is False for left padding.
    """

    def __init__(self, batch_size: int, capacity: int, num_layers: int, device: torch.device | str = "cpu",
                 recurrent: Cache | None = None, attention_layers: int | None = None):
        """recurrent: the transformers cache holding a hybrid target's recurrent layers (`recurrent_cache`);
        attention_layers: how many layers write keys/values each forward (default: all)."""
        self.batch_size = batch_size
        self.capacity = capacity
        self.num_layers = num_layers
        self.attention_layers = num_layers if attention_layers is None else attention_layers
        self.recurrent = recurrent
        self._recorded = False          # the recurrent layers hold the last block's per-token states
        self.length = 0
        self.keys: list[torch.Tensor | None] = [None] * num_layers    # each [b, h, c, d]
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)
        self._mask: torch.Tensor | None = None      # [b, 1, n, length + n] for the forward in flight
        self._block: int = 0
        self._layers_written = 0

    # -- called by the Target around one forward ---------------------------------
    def begin_block(self, positions: torch.Tensor, block_mask: torch.Tensor | None, valid: torch.Tensor | None,
                    prefix_mask: torch.Tensor | None = None) -> None:
        """Prepare the mask for a forward over n new tokens.

        positions: [b, n] position ids of the new tokens.
        block_mask: [b, n, n] bool, which new tokens each new token sees
            (None: causal).
        valid: [b, n] bool, False for padding among the new tokens (None: all valid).
        prefix_mask: [b, n, length] bool, which cached slots each new token
            sees (None: every valid one).  A drafter growing a tree uses it so a
            node sees its ancestors and not its cousins.
        """
        b, n = positions.shape
        if self.recurrent is not None:
            if block_mask is not None and not bool((block_mask == torch.ones(
                    n, n, dtype=torch.bool, device=block_mask.device).tril()).all()):
                raise TreeOverRecurrentLayers()
            self.commit_recurrent()
        if self.length + n > self.capacity:
            raise ValueError(
                f"engine cache overflow: {self.length} cached + {n} new tokens > capacity {self.capacity}; "
                "create the cache with a larger capacity (prompt length + max new tokens + tree size)"
            )
        start, end = self.length, self.length + n
        self.positions[:, start:end] = positions
        self.valid[:, start:end] = True if valid is None else valid
        if block_mask is None:
            block_mask = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril().expand(b, n, n)
        prefix = self.valid[:, None, :start].expand(b, n, start)                       # [b, n, length]
        if prefix_mask is not None:
            prefix = prefix & prefix_mask
        new_keys = block_mask & self.valid[:, None, start:end]                          # [b, n, n]
        mask = torch.cat([prefix, new_keys], dim=2)                                     # [b, n, length + n]
        # A padding query would see nothing and give NaN; let it see itself.
        mask[:, torch.arange(n), start + torch.arange(n)] = True
        self._mask = mask[:, None]                                                      # [b, 1, n, length + n]
        self._block = n
        self._layers_written = 0

    def end_block(self) -> None:
        if self._layers_written != self.attention_layers:
            raise RuntimeError(
                f"only {self._layers_written} of {self.attention_layers} attention layers used draftsmith's engine cache: "
                "this model's attention does not dispatch through transformers' AttentionInterface, "
                "so draftsmith cannot decode with it"
            )
        self.length += self._block
        self._recorded = self.recurrent is not None
        self._mask = None
        self._block = 0

    def commit_recurrent(self) -> None:
        """Drop the recorded per-token states of the last block: what it left stands."""
        if self._recorded:
            self.recurrent.crop(0)
            self._recorded = False

    def ensure_capacity(self, capacity: int) -> None:
        """Grow (by copying) so that `capacity` slots fit."""
        if capacity <= self.capacity:
            return
        capacity = max(capacity, 2 * self.capacity)
        extra = capacity - self.capacity
        for store in (self.keys, self.values):
            for layer, tensor in enumerate(store):
                if tensor is not None:
                    b, h, _, d = tensor.shape
                    store[layer] = torch.cat([tensor, tensor.new_zeros(b, h, extra, d)], dim=2)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(self.batch_size, extra)], dim=1)
        self.positions = torch.cat([self.positions, self.positions.new_zeros(self.batch_size, extra)], dim=1)
        self.capacity = capacity

    # -- called by each attention layer -----------------------------------------
    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this block's key/value [b, h, n, d] and return the whole window [b, h, length + n, d]."""
        if self.keys[layer] is None:            # MLA: values may have another head dim than keys
            self.keys[layer] = key.new_zeros(*key.shape[:2], self.capacity, key.shape[3])
            self.values[layer] = value.new_zeros(*value.shape[:2], self.capacity, value.shape[3])
        end = self.length + key.shape[2]
        self.keys[layer][:, :, self.length:end] = key
        self.values[layer][:, :, self.length:end] = value
        self._layers_written += 1
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        if not sliding_window:
            return self._mask
        end = self.length + self._block
        query_pos = self.positions[:, self.length:end, None]                 # [b, n, 1]
        key_pos = self.positions[:, None, :end]                              # [b, 1, length + n]
        return self._mask & (query_pos - key_pos < sliding_window)[:, None]

    # -- bookkeeping between forwards ------------------------------------------
    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep, after `start`, only the cache slots `slots` (ascending), moved to start, start+1, ...

        Used after tree verification: the root and the accepted path stay, the
        rejected branches go.  slots: [m] long, absolute slot indices, same for
        every row (speculative decoding runs at batch 1).
        """
        m = slots.numel()
        contiguous = bool((slots == torch.arange(start, start + m, device=slots.device)).all())
        if not contiguous and self.recurrent is not None:
            raise TreeOverRecurrentLayers()
        if not contiguous:
            for layer in range(self.num_layers):
                for store in (self.keys, self.values):
                    if store[layer] is not None:     # a spread target: each layer's store on its own device
                        store[layer][:, :, start:start + m] = store[layer][:, :, slots.to(store[layer].device)]
            self.positions[:, start:start + m] = self.positions[:, slots]
            self.valid[:, start:start + m] = self.valid[:, slots]
        self.truncate(start + m)

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on."""
        if length > self.length + self._block:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if self.recurrent is not None and length < self.length:
            self._roll_back(self.length - length)
        self.valid[:, length:] = False
        self.length = length

    def _roll_back(self, tokens: int) -> None:
        """The recurrent layers forget the last `tokens` tokens of the last block (their recorded states)."""
        if not self._recorded or tokens > ROLLBACK_LIMIT:
            raise ValueError(f"a recurrent layer's state can be rolled back by at most {ROLLBACK_LIMIT} tokens of "
                             f"the last block; {tokens} tokens were asked"
                             + ("" if self._recorded else " after that block was committed"))
        self.recurrent.crop(-tokens)
        self._recorded = False

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave a batched generation)."""
        if self.recurrent is not None:        # beam search's row reordering is a row selection too
            self.commit_recurrent()
            self.recurrent.reorder_cache(rows)
        for layer in range(self.num_layers):
            for store in (self.keys, self.values):
                if store[layer] is not None:
                    store[layer] = store[layer][rows.to(store[layer].device)]
        self.valid = self.valid[rows.to(self.valid.device)]
        self.positions = self.positions[rows.to(self.positions.device)]
        self.batch_size = int(rows.numel())


class TreeOverRecurrentLayers(ValueError):
    """A token tree asked of a target with recurrent layers."""

    def __init__(self):
        super().__init__(
            "this target has recurrent (linear-attention or Mamba) layers, which read a block of tokens as one "
            "sequence, so a token tree cannot be verified over them: use a chain (eval.proposal=chain, "
            "and no eval.lookup)")


RECURRENT_LAYER_TYPES = ("linear_attention", "conv")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


ROLLBACK_LIMIT = 64
"""The most tokens of a block a recurrent layer can roll back: the per-token states of a block's last
ROLLBACK_LIMIT tokens are recorded (a real hybrid's state is MBs a layer, so a long prefill records no more)."""


HYBRID_TRANSFORMERS = "5.23"
"""The first transformers release whose cache carries (and records) linear-attention and Mamba states."""


@functools.cache
def recurrent_layer_classes():
    """transformers' recurrent cache layers by layer kind, its empty layer, and the engine's pass-through for an
    attention layer's place: an attention layer keeps nothing there (the engine holds its keys and values) and
    gets the new block's keys and values back.  Imported here, not at the top: an older transformers (vLLM's
    pin, which imports draftsmith for data.backend=vllm) has none of them and never decodes a hybrid target."""
    try:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, DummyLayer
    except ImportError as missing:
        import transformers
        raise RuntimeError(
            f"a target with recurrent layers needs transformers >= {HYBRID_TRANSFORMERS} (this environment has "
            f"{transformers.__version__}, whose cache has no recurrent layers: {missing}); install a newer "
            "transformers in this environment") from None

    class RecurrentPassThrough(DummyLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states

        def get_seq_length(self) -> int:
            return 0

    return DYNAMIC_LAYER_TYPE_MAPPING, DummyLayer, RecurrentPassThrough


def recurrent_cache(layer_types: list[str], block_limit: int = ROLLBACK_LIMIT, like: Cache | None = None) -> Cache | None:
    """A transformers cache for the recurrent layers of a hybrid target (None when it has none), recording
    the per-token states of a block's last `block_limit` tokens so a rejected tail can be cropped.
    like: an existing one whose layer classes to repeat (layer_types are then ignored)."""
    if like is not None:
        layers = [type(layer)() for layer in like.layers]
    elif not any(t in RECURRENT_LAYER_TYPES for t in layer_types):
        return None
    else:
        mapping, dummy, pass_through = recurrent_layer_classes()
        layers = [mapping[t]() if t in RECURRENT_LAYER_TYPES else
                  pass_through() if t in ATTENTION_LAYER_TYPES else dummy() for t in layer_types]
    cache = Cache(layers=layers)
    cache.activate_past_recording(recurrent_states_to_keep=block_limit)
    return cache


def merge_recurrent(parts: list[tuple["EngineCache", torch.Tensor]]) -> Cache:
    """One recurrent cache holding `rows` of each part's, in order (data generation's continuous batching).
    A recurrent state has no time axis, so unlike keys and values no row needs aligning."""
    for cache, _ in parts:
        cache.commit_recurrent()
    first = parts[0][0].recurrent
    merged = recurrent_cache([], ROLLBACK_LIMIT, like=first)
    for index, layer in enumerate(merged.layers):
        if not hasattr(layer, "recurrent_states"):
            continue
        sources = [(cache.recurrent.layers[index], rows) for cache, rows in parts]
        model = sources[0][0]
        for state in range(layer.number_of_states):
            if model.is_conv_states_initialized[state]:
                layer.conv_states[state] = torch.cat([src.conv_states[state][rows] for src, rows in sources])
                layer.conv_kernel_size[state] = model.conv_kernel_size[state]
                layer.is_conv_states_initialized[state] = True
            if model.is_recurrent_states_initialized[state]:
                layer.recurrent_states[state] = torch.cat([src.recurrent_states[state][rows] for src, rows in sources])
                layer.is_recurrent_states_initialized[state] = True
            layer.has_previous_state[state] = model.has_previous_state[state]
        layer.device, layer.dtype = model.device, model.dtype
        layer.cumulative_length_linear = model.cumulative_length_linear.clone()
    return merged


def attend_with_sinks(query, keys, values, mask, scaling, sinks, softcap=None) -> torch.Tensor:
    """Attention whose softmax also sees one learned logit per query head (gpt-oss's sinks), dropped after.

    query [b, hq, n, d]; keys, values [b, hk, t, d]; mask [b, 1, n, t] bool (True: seen) or None (causal,
    the queries being the last n of the t); sinks [hq].  Returns [b, n, hq, dv]."""
    b, hq, n, _ = query.shape
    hk, t = keys.shape[1], keys.shape[2]
    keys = keys.repeat_interleave(hq // hk, dim=1)
    values = values.repeat_interleave(hq // hk, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scaling            # [b, hq, n, t]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(n, t, dtype=torch.bool, device=query.device).tril(t - n)[None, None]
    elif mask.dtype != torch.bool:           # an additive float mask
        mask = mask > torch.finfo(mask.dtype).min / 2
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().reshape(1, hq, 1, 1).expand(b, hq, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values).transpose(1, 2)


def cached_attention(cache: EngineCache, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float | None = None, softcap: float | None = None,
                     sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Append key/value to the cache and attend over it.

    query: [b, hq, n, d]; key, value: [b, hk, n, d] (RoPE applied; MLA's values have their own head dim);
    sinks: [hq] (gpt-oss) or None.  Returns [b, n, hq, dv].
    """
    keys, values = cache.append(layer, key, value)                        # [b, hk, t, d]
    mask = cache.mask_for(sliding_window).to(query.device)                # [b, 1, n, t]; a device_map's layer
    b, hq, n, d = query.shape
    hk, t = keys.shape[1], keys.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    if sinks is not None:
        return attend_with_sinks(query, keys, values, mask, scaling, sinks, softcap)
    if (n > 1 or b == 1) and not softcap and values.shape[-1] == d:
        # Blocks (prefill, trees) and batch 1: SDPA's fused kernel (measured faster there).
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=hq != hk)
        return out.transpose(1, 2)
    groups = hq // hk
    # Batched decoding, one new token per row: query heads that share a kv head are
    # stacked along the query axis, one matmul per kv head, no repeat_kv copy.
    grouped_query = query.reshape(b, hk, groups * n, d)                   # [b, hk, g*n, d]
    scores = torch.matmul(grouped_query, keys.transpose(-1, -2)).float() * scaling   # [b, hk, g*n, t]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, hk, groups, n, t).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(b, hk, groups * n, t)
    dv = values.shape[-1]
    out = torch.matmul(probs, values).view(b, hk, groups, n, dv).reshape(b, hq, n, dv)
    return out.transpose(1, 2)


def engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     softcap=None, sliding_window=None, **kwargs):
    """transformers attention function: over the engine cache when one is passed, else plain SDPA."""
    cache: EngineCache | None = kwargs.pop(CACHE_KWARG, None)
    sinks = kwargs.pop("s_aux", None)
    if cache is None:
        if sinks is not None:          # SDPA has no sinks: computed here, as transformers' eager path does
            scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
            return attend_with_sinks(query, key, value, attention_mask, scaling, sinks, softcap), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, softcap=softcap, sliding_window=sliding_window, **kwargs)
    return cached_attention(cache, module.layer_idx, query, key, value, scaling, softcap, sliding_window,
                            sinks), None


AttentionInterface.register(ENGINE_ATTENTION, engine_attention)
AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)
