"""What a run may do that the memory model does not count, or counts without a GPU measurement: said in one line
each, and never judged "sure".

The memory model predicts one GRPO step of TRL's own trainer on the training device. Some runs move memory where no
term follows it: a vLLM server generates on a GPU of its own, Unsloth offloads the checkpointed layer inputs to the
host and computes its loss in chunks of its own, and its standby mode sizes vLLM's share itself; packed or
padding-free batches have no padded rows. Some families' terms are measured on the simulated device only: a vision
tower, experts, DeepSeek's latent attention (``docs/limitations.md``); on a GPU their error is not known, and the
dense models' measured error does not bound it (a Qwen2.5-VL-3B full fine-tune under ZeRO-3 predicted at a third of
its 96 GB cards ran out of memory: ``bench/reports.py``, ``swift-4311``). A prediction for such a run may be far off
either way, so it says so (``Estimate.unmodelled``, printed by `oomguard plan`) and the verdict is at best "probe
first": a short worst-case probe measures what the model cannot.

The keys come from the knobs (:func:`from_knobs`: vLLM in server mode), from the model on a GPU (:func:`from_model`)
and from what the run reports or the user tells `oomguard plan` (``RunFacts.unmodelled``: ``--stack unsloth``,
``--padding-free``).

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> from_knobs(TRL_DEFAULTS.replace(use_vllm=True, vllm_mode="server"))
('vllm_server',)
>>> print(NOT_MODELLED["padding_free"])
packed or padding-free batches (no padded rows): the model counts every row padded to the longest
"""

from __future__ import annotations

from collections.abc import Iterable

from ...vocab.knobs import Knobs
from .model import ModelSpec

# One line each, for `oomguard plan` and the run's report.
NOT_MODELLED: dict[str, str] = {
    "vllm_server": "a vLLM server's own GPU (vllm_mode=server): this prediction covers the training device only",
    "unsloth_standby": "Unsloth's vLLM standby mode (UNSLOTH_VLLM_STANDBY=1), which sizes vLLM's share itself",
    "unsloth_offloaded_checkpointing": "Unsloth's offloaded gradient checkpointing "
                                       "(use_gradient_checkpointing=\"unsloth\"): the layers' inputs wait in host RAM",
    "unsloth_chunked_loss": "Unsloth's chunked GRPO loss in its generated trainer",
    "padding_free": "packed or padding-free batches (no padded rows): the model counts every row padded to the longest",
    "vision_gpu": "a vision tower on a GPU: its memory is measured on the simulated device only",
    "moe_gpu": "experts (MoE) on a GPU: their memory is measured on the simulated device only",
    "mla_gpu": "DeepSeek's latent attention on a GPU: its memory is measured on the simulated device only",
}

# Those under which vLLM's own memory is not the reservation the model counts (a server's GPU, Unsloth's standby
# sizing its share itself): a shortfall the model computes for vLLM's share is no reason to stop the config.
VLLM_NOT_MODELLED = frozenset({"vllm_server", "unsloth_standby"})


def from_knobs(k: Knobs) -> tuple[str, ...]:
    """What the knobs themselves say the model cannot count: vLLM generating in a server."""
    return ("vllm_server",) if k.use_vllm and k.vllm_mode == "server" else ()


def from_model(spec: ModelSpec, *, simulated: bool, images: bool) -> tuple[str, ...]:
    """What a model's families leave unmeasured on a GPU (none on the simulated device, where each was measured): its
    vision tower when the run has images, its experts, its latent attention.

    >>> from .model import ModelSpec
    >>> from_model(ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True), simulated=False, images=False)
    ()
    """
    if simulated:
        return ()
    return (("vision_gpu",) if spec.vision is not None and images else ()) + (
        ("moe_gpu",) if spec.moe is not None else ()) + (("mla_gpu",) if spec.mla is not None else ())


def unmodelled(k: Knobs, reported: Iterable[str] = (), model: Iterable[str] = ()) -> tuple[str, ...]:
    """The keys of :data:`NOT_MODELLED` that apply to a run: the knobs', the model's (:func:`from_model`) and those
    reported, once each, in the table's order; an unknown key is kept last (a newer training process may report one
    this version cannot name).

    >>> from oomguard.vocab.knobs import TRL_DEFAULTS
    >>> unmodelled(TRL_DEFAULTS, ["padding_free", "unsloth_chunked_loss", "padding_free"])
    ('unsloth_chunked_loss', 'padding_free')
    """
    keys = set(from_knobs(k)) | set(reported) | set(model)
    return tuple(key for key in NOT_MODELLED if key in keys) + tuple(sorted(keys - set(NOT_MODELLED)))


def not_modelled(keys: Iterable[str]) -> list[str]:
    """The line of each key (an unknown key as it is)."""
    return [NOT_MODELLED.get(key, key) for key in keys]


__all__ = ["NOT_MODELLED", "VLLM_NOT_MODELLED", "from_knobs", "from_model", "not_modelled", "unmodelled"]
