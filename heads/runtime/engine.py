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
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
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

    def __init__(self, batch_size: int, capacity: int, num_layers: int, device: torch.device | str = "cpu"):
        self.batch_size = batch_size
        self.capacity = capacity
        self.num_layers = num_layers
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
        if self._layers_written != self.num_layers:
            raise RuntimeError(
                f"only {self._layers_written} of {self.num_layers} attention layers used draftsmith's engine cache: "
                "this model's attention does not dispatch through transformers' AttentionInterface, "
                "so draftsmith cannot decode with it"
            )
        self.length += self._block
        self._mask = None
        self._block = 0

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
        if self.keys[layer] is None:
            b, h, _, d = key.shape
            self.keys[layer] = key.new_zeros(b, h, self.capacity, d)
            self.values[layer] = value.new_zeros(b, h, self.capacity, d)
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
        if not contiguous:
            for layer in range(self.num_layers):
                for store in (self.keys, self.values):
                    if store[layer] is not None:
                        store[layer][:, :, start:start + m] = store[layer][:, :, slots]
            self.positions[:, start:start + m] = self.positions[:, slots]
            self.valid[:, start:start + m] = self.valid[:, slots]
        self.truncate(start + m)

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on."""
        if length > self.length + self._block:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.valid[:, length:] = False
        self.length = length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave a batched generation)."""
        for layer in range(self.num_layers):
            for store in (self.keys, self.values):
                if store[layer] is not None:
                    store[layer] = store[layer][rows]
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]
        self.batch_size = int(rows.numel())


def cached_attention(cache: EngineCache, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float | None = None, softcap: float | None = None,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Append key/value to the cache and attend over it.

    query: [b, hq, n, d]; key, value: [b, hk, n, d] (RoPE applied).  Returns [b, n, hq, d].
    """
    keys, values = cache.append(layer, key, value)                        # [b, hk, t, d]
    mask = cache.mask_for(sliding_window).to(query.device)                # [b, 1, n, t]; a device_map's layer
    b, hq, n, d = query.shape
    hk, t = keys.shape[1], keys.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    if (n > 1 or b == 1) and not softcap:
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
    out = torch.matmul(probs, values).view(b, hk, groups, n, d).reshape(b, hq, n, d)
    return out.transpose(1, 2)


def engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     softcap=None, sliding_window=None, **kwargs):
    """transformers attention function: over the engine cache when one is passed, else plain SDPA."""
    cache: EngineCache | None = kwargs.pop(CACHE_KWARG, None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, softcap=softcap, sliding_window=sliding_window, **kwargs)
    return cached_attention(cache, module.layer_idx, query, key, value, scaling, softcap, sliding_window), None


AttentionInterface.register(ENGINE_ATTENTION, engine_attention)
AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)
