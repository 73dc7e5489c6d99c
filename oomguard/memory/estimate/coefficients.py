"""The uncertain coefficients of the memory model, fitted to real measurements, and the measured errors of its
predictions that the pre-flight check and the Judge add as margins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# How far above the measured device use the built-in fit's device-level prediction reached on the 22 H100 rows
# (tests/fixtures/h100/calibration*.jsonl; `python bench/preflight_margin.py`): q3b-fp32-lora32 was predicted 6.3%
# over what it used. A config predicted up to this much over a card may still fit it.
DEVICE_OVERPREDICTION = 0.064
# The same on the simulated device: the allocated peak is within 1.0% (bench/cpu_calibrate.py), and the smallest
# budget each configuration fits in was 1.05 to 1.26 times its allocated peak (bench/min_budget.py) against the fitted
# 1 + f_frag = 1.14: up to 1.14 / 1.05 * 1.01 - 1 = 9.7% over.
SIMULATED_OVERPREDICTION = 0.097
# The other side: how far a config can need more than predicted there: 1.26 / 1.14 * 1.013 - 1 = 12%. Fragmentation
# on a device of a few hundred MiB depends on the order and sizes of allocations (a real run's varying prompt lengths
# fragment more than its probe), so a config predicted within this much of the device may run out of memory.
SIMULATED_UNDERPREDICTION = 0.12
# Added to the measured error to make the pre-flight's stop margin: errors on configurations not measured run a little
# beyond those on the measured ones.
STOP_ALLOWANCE = 0.02
# The largest errors of the allocated peak on the simulated device, per LM head (RunFacts.trl_head): "fused" (TRL 1.15
# on) and "logits" (TRL 0.29 to 1.14), measured by bench/cpu_calibrate.py under each tested release (the rows are
# tests/fixtures/trl/cpu-rows-*.json, checked by tests/test_trl_range.py), and "rowchunk" (Unsloth's CPU backend,
# measured by bench/cpu_calibrate.py --stack unsloth: tests/fixtures/stacks/cpu-rows-unsloth.json, checked by
# tests/test_unsloth_units.py): (the largest over-prediction, the largest under-prediction), as fractions of the
# measured peak.
SIMULATED_HEAD_ERROR = {"fused": (0.005, 0.015), "logits": (0.277, 0.03), "rowchunk": (0.104, 0.004)}
# How each head is named in a margin's source.
HEAD_NAMES = {"fused": "the fused LM head of TRL 1.15 on", "logits": "the logits LM head of TRL 0.29-1.14",
              "rowchunk": "Unsloth's row-chunked CPU LM head"}
# A TRL newer than the newest tested release: its memory behaviour is unmeasured. The largest change measured between
# releases on one config is 2.95x (TRL 1.16's CPU head against 0.29-1.14's logits, the README job: 499 against 169
# MiB), so the pre-flight stops such a config only when it is predicted over this many times the device.
UNTESTED_FACTOR = 3.0
# What a config the memory model is sure of leaves free of the device beyond the model's measured under-prediction:
# room for what no term counts (a long tail of small allocations, a late step's longer prompts within the measured
# maximum, a framework's own buffers). `oomguard run` starts such a config's real run without a probe first
# (the rule: ``fitverdict.verdict``).
SURE_HEADROOM = 0.10


@dataclass(frozen=True)
class ModelError:
    """How far the memory model's device peak may be from the truth: ``over`` (predicted above what a config needs:
    the pre-flight stops only beyond it, plus STOP_ALLOWANCE) and ``under`` (needs more than predicted: relaxing stops
    that far from the edge), and where the figures come from."""

    over: float
    under: float
    source: str


def measured_error(*, simulated: bool, head: str | None = None, untested: bool = False) -> ModelError:
    """The memory model's measured error for a device and the installed TRL's LM head (None: the newest, fused).

    On the simulated device: the allocated peak's error for that head and the fragmentation measured by
    bench/min_budget.py (smallest fitting budget 1.05 to 1.26 times the allocated peak, against the fitted 1.14). On a
    GPU: the H100 rows, fitted under TRL 1.16 (fused head); the logits head of TRL 0.29 to 1.14 is not measured on a
    GPU, so its simulated-device error is added on top. A TRL newer than the newest tested (``untested``): over by up
    to UNTESTED_FACTOR, the largest change measured between releases.

    >>> e = measured_error(simulated=True)
    >>> e.over, e.under
    (0.097, 0.12)
    >>> measured_error(simulated=False, untested=True).over
    2.0
    """
    h = head if head in SIMULATED_HEAD_ERROR else "fused"
    err_over, err_under = SIMULATED_HEAD_ERROR[h]
    if simulated:
        if h == "fused":
            over, under = SIMULATED_OVERPREDICTION, SIMULATED_UNDERPREDICTION
        else:
            over = math.ceil(1000 * (1.14 / 1.05 * (1 + err_over) - 1)) / 1000
            under = math.ceil(1000 * (1.26 / 1.14 * (1 + err_under) - 1)) / 1000
        which = "" if h == "fused" else f" for {HEAD_NAMES[h]}"
        source = f"the simulated device's fit{which}: up to {100 * over:.1f}% over"
    elif h == "fused":
        over, under = DEVICE_OVERPREDICTION, DEVICE_OVERPREDICTION
        source = f"the built-in fit: up to {100 * over:.1f}% over on the H100 rows"
    else:
        over = math.ceil(1000 * ((1 + DEVICE_OVERPREDICTION) * (1 + err_over) - 1)) / 1000
        under = math.ceil(1000 * ((1 + DEVICE_OVERPREDICTION) * (1 + err_under) - 1)) / 1000
        source = (f"the built-in fit with {HEAD_NAMES[h]} (H100 rows; that head measured on the simulated device "
                  f"only): up to {100 * over:.1f}% over")
    if untested:
        return ModelError(UNTESTED_FACTOR - 1, under, f"a TRL newer than the tested releases: only beyond "
                                                      f"{UNTESTED_FACTOR:g} times the device, the largest change "
                                                      "measured between releases")
    return ModelError(over, under, source)


@dataclass(frozen=True)
class Coefficients:
    """The uncertain coefficients of research §8. The defaults are fitted to real H100 measurements (2026-11-22:
    torch 2.11 + CUDA 13, TRL 1.16, 18 GRPO configurations of ``tests/fixtures/h100/calibration.jsonl`` and the run
    reports next to it) by ``python bench/gpu_calibrate.py --from-jsonl tests/fixtures/h100/calibration.jsonl``.
    With them the allocated peak is within 0.8% (median) and 4.7% (worst) of every row, the reserved peak within
    1.9% and 6.4% (``tests/test_gpu_rows.py``).

    - ``c_act``: scale of the derived activation bytes. Fitted 0.89 (smallest worst-case error of the allocated
      peak); the research prior was 0.9.
    - ``k_logits``: bytes per tile element of the chunked LM head's torch-fallback temporaries in backward. TRL 1.16
      only takes that path without Triton (CPU, the simulated device); on CUDA the Triton kernels work in place and
      the term is unused. The default 12 is the research prior for the old materialised-logits backward.
    - ``k_full_logits``: TRL 0.29 to 1.14 (materialised logits): bytes per ``[B, C, V]`` element at the peak of the
      loss's backward, in units of a 4-byte log-softmax (halved for 16-bit weights without autocast). Measured on the
      simulated device under TRL 0.29.1 and 1.10.0 (tests/fixtures/trl/): four fp32 ``[B, C, V]`` tensors, 16. Not
      measured on a GPU (the H100 rows ran TRL 1.16).
    - ``f_frag`` / ``f_frag_expandable``: reserved-but-unallocated margin, as a fraction of the allocated peak.
      Measured reserved/allocated: 1.02-1.17 over the 17 rows without expandable segments (least squares 1.061,
      median 1.086); 0.105 gives the smallest worst-case error of the reserved peak (the research prior 0.25 made
      every device prediction 11-20% high). With ``expandable_segments:True`` one calibration row (Qwen2.5-0.5B,
      1.079, against 1.115 without) and six Qwen2.5-3B run-report attempts (1.004-1.027) exist: 0.05 sits between.
    - ``m_ctx``: device memory outside the caching allocator (CUDA context, cuDNN, NCCL); 0 on the simulated device
      (``estimate(context=...)`` gives a measured context, or the one the simulated device models).
      The calibration rows' own context figures counted other processes sharing the GPU, so it comes from the real
      OOMs of the 24 GiB-capped Qwen2.5-3B runs: NVML's "this process has 24.74 GiB in use" against 23.96 GiB
      reserved (``memory_stats``), 0.785 GiB; and 24.25 against 23.48 GiB, 0.772 GiB. So 800 MiB.
    - ``m_workspace``: cuBLAS workspaces, which torch allocates through the caching allocator (so inside the
      allocated peak): 32 MiB per handle and stream on Hopper (``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:8``,
      ``aten/src/ATen/cuda/CublasHandlePool.cpp``), one handle for the forward's thread and one for autograd's
      backward thread. Every phase of every row was 63-100 MiB above the model without it.
    - ``scale``: online calibration, measured/predicted of the last attempt, applied to the allocated peak.
    """

    c_act: float = 0.89
    k_logits: float = 12.0
    k_full_logits: float = 16.0
    f_frag: float = 0.105
    f_frag_expandable: float = 0.05
    m_ctx: int = 800 * 2**20
    scale: float = 1.0
    m_workspace: int = 64 * 2**20

    def calibrated(self, measured_peak: int, predicted_peak_alloc: int) -> Coefficients:
        """A copy whose ``scale`` makes the last prediction match the last measurement (clamped to [0.25, 4]).

        ``predicted_peak_alloc`` is what these coefficients predicted, so the new scale is
        ``scale · measured / predicted``.

        >>> Coefficients().calibrated(150, 100).scale, Coefficients(scale=2.0).calibrated(10**9, 1).scale
        (1.5, 4.0)
        """
        if measured_peak <= 0 or predicted_peak_alloc <= 0:
            return self
        s = self.scale * measured_peak / predicted_peak_alloc
        return replace(self, scale=min(4.0, max(0.25, s)))

    @classmethod
    def for_simulated(cls) -> Coefficients:
        """Coefficients fitted on the simulated device by ``bench/cpu_calibrate.py --fit`` (26 real TRL GRPO
        configurations, with and without bf16 autocast, max |error| 1.3% of the allocated peak): ``c_act = 0.92`` of
        the itemised activation bytes and ``k_logits = 29`` bytes per tile element for the chunked head's torch
        fallback (counting its temporaries gives about 33). No CUDA context or cuBLAS workspace. Fragmentation from
        ``bench/min_budget.py`` (the smallest budget each config fits in, replayed through the allocator model): 106
        MiB for a 93.5 MiB allocated peak and 150 MiB for 132.7 MiB, so ``f_frag = 0.14`` (measured 0.13). Expandable
        segments save nothing reliable on a device this small: the large pool is mapped in 20 MiB granules, a sixth
        of a 120 MiB device, and the smallest budgets were 1.07, 1.12, 1.14 and 1.15 times the allocated peak with
        them (1.10, 1.14, 1.17 without, on the same configs), so ``f_frag_expandable`` is ``f_frag`` too.
        ``k_full_logits = 16`` (TRL 0.29 to 1.14) is the count measured there (see the class's notes).
        """
        return cls(c_act=0.92, k_logits=29.0, f_frag=0.14, f_frag_expandable=0.14, m_ctx=0, m_workspace=0)
