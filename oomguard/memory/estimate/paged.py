"""transformers' continuous batching (TRL's ``use_transformers_continuous_batching``): the paged cache a generation
round allocates.

When a round starts, transformers 5.24 (``generation/continuous_batching/cache.py``, ``PagedAttentionMemoryHandler``)
empties the allocator's cache and takes ``max_memory_percent`` of the device memory then free (``available``:
``total - max(in use, reserved)``, TRL's default share 0.5). It splits that share into what is allocated at once, for
the round, and what it keeps for the round's own activations:

- per cache token: the key and value of every layer (the cache tensor, in the model's dtype), its read index (8
  bytes), and with SDPA or eager attention its column of the attention mask (``max_batch_tokens`` values); kept, not
  allocated: the keys and values read back at the attention's peak (SDPA repeats them to every query head);
- per batch token (``max_batch_tokens``, 8192 by default): its input and output rows; kept: the larger of the
  attention's and (without ``logits_to_keep``) the LM head's peak;
- once: two trash sectors of cache, the ``[max_batch_tokens, max_batch_tokens]`` corner of the mask; kept: the
  logits of up to ``max_requests_per_batch`` rows (the round's requests, at most 1024) where the model slices them.

The cache tokens fill what is left, so the round allocates ``available`` less what it keeps (:func:`paged_cache`), and
the round's activations then use part of what it kept. The cache is freed when the round ends (TRL passes no
``persistent_manager``), so only the generation phase (and an evaluation's) holds it. Measured on the simulated
device with transformers 5.24 (oomguard's adapter sizes it as on a GPU of the device's size: ``child/stacks/paged.py``):
a tiny Llama at 0.01 of 64 GiB allocated 591.7 MiB where this predicts 594.8 MiB (of 655.2 MiB available).

>>> from .model import ModelSpec
>>> tiny = ModelSpec(724, 256, 4, 8, 2, 32, 1024, True)
>>> round(paged_cache(tiny, available=687_026_995, dtype_bytes=4, requests=16, sequence=43) / 2**20, 1)
594.8
>>> paged_cache(tiny, available=0, dtype_bytes=4, requests=16, sequence=43)
0
"""

from __future__ import annotations

import math

from .model import ModelSpec

MAX_BATCH_TOKENS = 8192  # PagedAttentionMemoryHandler._default_max_batch_tokens
PAGE_SIZE = 256  # ContinuousBatchingConfig.page_size
MAX_REQUESTS = 1024  # FALLBACK_DEFAULTS["max_requests_per_batch"]
TRASH_SECTORS = 2


def paged_cache(spec: ModelSpec, *, available: int, dtype_bytes: int, requests: int, sequence: int,
                max_batch_tokens: int | None = None, flash: bool = False, logits_to_keep: bool = True) -> int:
    """Bytes a continuous-batching round allocates when transformers may use ``available`` bytes (its share of the
    free memory): the cache of every layer, its indices and attention masks, and the batch's input and output rows.
    ``dtype_bytes``: the model's dtype (its cache's and activations'); ``requests``: the round's sequences (TRL's
    generation batch, each prompt repeated per generation); ``sequence``: the longest prompt plus completion;
    ``max_batch_tokens``: the config's (None: transformers' 8192); ``flash``: flash attention (no mask, the keys and
    values read back per KV head)."""
    if available <= 0:
        return 0
    a = dtype_bytes
    h, hd, nh, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    m = int(max_batch_tokens or MAX_BATCH_TOKENS)
    masks = 0 if flash else 1
    kv_read = (2 * nkv if flash else 2 * nh + nkv) * hd * a  # the read-back at the attention's peak: kept
    kv_token = spec.num_layers * 2 * nkv * hd * a  # one token of every layer's cache: allocated
    per_cache_token = kv_token + kv_read + 8 + masks * a * m
    blocks = math.ceil(sequence / PAGE_SIZE) + 1
    blocks += blocks % 2
    io = 7 * 4 + 4 + blocks * 4 + 8 + 8  # bulk inputs, output ids, block table, write and read indices
    attention = a * (h + nh * hd + 2 * nkv * hd + (2 * nkv if flash else 2 * nh + nkv) * hd)
    head = 0 if logits_to_keep else h * a + spec.vocab_size * 4
    rows = min(max(1, requests), MAX_REQUESTS)
    logit_rows = rows * (h * a + spec.vocab_size * 4) if logits_to_keep else 0  # kept
    trash = TRASH_SECTORS * PAGE_SIZE * kv_token
    corner = masks * a * m * m
    kept = m * max(attention, head) + logit_rows
    cache_tokens = max(0, available - trash - logit_rows - m * (max(attention, head) + io) - corner) // per_cache_token
    return max(0, min(available, available - kept - cache_tokens * kv_read))


__all__ = ["MAX_BATCH_TOKENS", "paged_cache"]
