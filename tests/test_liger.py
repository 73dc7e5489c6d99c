"""Liger's chunked GRPO loss (``use_liger_kernel``): counted by the memory model where it changes the head (TRL 0.29 to
1.14, which otherwise materialise the logits), and offered as a rung only where it can run (Liger installed, a CUDA
device with Triton). Liger needs Triton on a GPU, so none of this runs it: the rung's conditions and the model's term
are what is tested here."""

from __future__ import annotations

from oomguard.memory.estimate import ModelSpec, estimate
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts

QWEN_1_5B = ModelSpec(151936, 1536, 28, 12, 2, 128, 8960, True)  # a 150k vocabulary: the logits dominate
K = TRL_DEFAULTS.replace(per_device_train_batch_size=8, max_completion_length=1024, dtype="bfloat16", lora_r=16)


def test_liger_removes_the_materialised_logits_of_trl_before_1_15_and_changes_nothing_after():
    logits = estimate(QWEN_1_5B, K, head="logits")
    liger = estimate(QWEN_1_5B, K.replace(use_liger_kernel=True), head="logits")
    fused = estimate(QWEN_1_5B, K, head="fused")
    assert logits.breakdown["logits"] > 10 * 2**30 and liger.peak_bytes < logits.peak_bytes / 2
    # chunked like TRL 1.15's own head on a GPU: the same prediction
    assert liger.peak_bytes == fused.peak_bytes
    assert estimate(QWEN_1_5B, K.replace(use_liger_kernel=True), head="fused").peak_bytes == fused.peak_bytes


GPU_OLD_TRL = RunFacts(trl_version="1.10.0", trl_head="logits", gpu_kernels=True)


def test_the_rung_is_offered_only_where_liger_can_run_and_matters():
    r = make_remedy("liger_kernel")
    assert r.foreign(Context(knobs=K, facts=GPU_OLD_TRL)) is None
    assert r.blocked(Context(knobs=K, facts=GPU_OLD_TRL)) is None
    assert r.apply(Context(knobs=K, facts=GPU_OLD_TRL)).use_liger_kernel is True
    assert "chunks already" in r.foreign(Context(knobs=K, facts=GPU_OLD_TRL.replace(trl_head="fused",
                                                                                     trl_version="1.16.0")))
    assert "Triton on a CUDA GPU" in r.blocked(Context(knobs=K, facts=GPU_OLD_TRL.replace(gpu_kernels=False)))
    assert "pip install liger_kernel" in r.blocked(
        Context(knobs=K, facts=GPU_OLD_TRL.replace(missing_packages=("liger_kernel",))))
    assert r.blocked(Context(knobs=K.replace(use_liger_kernel=True), facts=GPU_OLD_TRL)) == "use_liger_kernel is already on"
    assert r.cost == "speed"


def test_a_guided_choice_on_an_old_trl_takes_liger_before_any_quality_trade():
    """On a 24 GiB card a TRL 1.10 run of a 1.5B model with LoRA is over only because of its logits: the choice is
    Liger's loss (speed), not shorter completions or fewer generations."""
    from oomguard.decide.plan import make_plan

    p = make_plan(QWEN_1_5B, K, 24 * 2**30, facts=GPU_OLD_TRL)
    # predicted 7% over the card, within the logits head's error on a GPU: `oomguard run` probes it as it is, and
    # where the probe runs out of memory its choice is Liger's loss
    assert p.estimate.peak_bytes > 24 * 2**30 and p.launches() == {"first": "probe", "then": "probe"}
    assert p.suggest == {"use_liger_kernel": True}, p.suggest
    # the same run on TRL 1.16 (its fused head) is sure to fit as it is
    assert make_plan(QWEN_1_5B, K, 24 * 2**30, facts=GPU_OLD_TRL.replace(trl_head="fused")).first == "run"
