"""A precision remedy must keep training: no rung of the default ladder may leave most weights unable to move.

The tiny model is trained a few steps at TRL's learning rate (1e-6) with exactly the optimizer transformers builds
for the knobs each precision rung produces, and the share of weights that moved is measured. bf16 weights with
AdamW and no float32 master copy freeze almost all of them, so ``bf16_load`` must not be offered there; where it is
offered (a learning rate large enough for the weights' scale) the weights must move.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oomguard.child.precision import moving_share  # noqa: E402
from oomguard.decide.experiment import kept_of, precision_warning  # noqa: E402
from oomguard.decide.ladder import load_ladder  # noqa: E402
from oomguard.strategies import Context  # noqa: E402
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts  # noqa: E402

LR = 1e-6  # TRL's GRPOConfig default


def _load(model_dir: str, dtype: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))


def _moved_after_training(model_dir: str, knobs: Knobs, steps: int = 3) -> float:
    """Train the model ``steps`` steps with the optimizer transformers builds for ``knobs`` (its ``optim``, the
    learning rate, the load dtype) on a language-model loss, and return the share of weights that changed."""
    model = _load(model_dir, knobs.dtype or "float32")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(output_dir="unused", optim=knobs.optim, learning_rate=knobs.learning_rate,
                                          use_cpu=True, report_to=[])
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    opt = cls(model.parameters(), **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    moved = total = 0
    for n, p in model.named_parameters():
        moved += int((p.detach() != before[n]).sum())
        total += p.numel()
    return moved / total


def _facts(model_dir: str, lr: float) -> RunFacts:
    """What the training process reports for this model at ``lr`` (child/precision.py on the float32 load)."""
    return RunFacts(model_source="string", bf16_moving=moving_share(_load(model_dir, "float32"), lr))


def _precision_rungs():
    return [r for r in load_ladder("default").rungs if r.cost == "precision"]


@pytest.mark.e2e
def test_no_precision_rung_of_the_default_ladder_freezes_the_weights_at_trl_s_learning_rate(tiny_model):
    user = TRL_DEFAULTS  # TRL's defaults: float32 load, adamw_torch_fused, lr 1e-6
    facts = _facts(tiny_model, LR)
    assert facts.bf16_moving is not None and facts.bf16_moving < 0.1  # bf16 would round away almost every update
    offered = []
    for rung in _precision_rungs():
        ctx = Context(knobs=user, facts=facts)
        why = rung.blocked(ctx)
        if why is not None:
            assert rung.name == "bf16_load" and "bfloat16's resolution" in why, (rung.name, why)
            continue
        knobs = rung.apply(ctx)
        offered.append(rung.name)
        assert _moved_after_training(tiny_model, knobs) > 0.5, rung.name
    assert "optimizer_8bit" in offered
    # what bf16_load was refused for is real: trained as it would be, the weights barely move
    frozen = _moved_after_training(tiny_model, user.replace(dtype="bfloat16", optim="adamw_torch"))
    assert frozen < 0.1
    # and the measurement the supervisor relies on agrees with training within a few points
    assert abs(frozen - facts.bf16_moving) < 0.05


@pytest.mark.e2e
def test_bf16_weights_are_offered_where_updates_survive_and_then_train(tiny_model):
    lr = 1e-3
    facts = _facts(tiny_model, lr)
    user = TRL_DEFAULTS.replace(learning_rate=lr)
    rung = next(r for r in _precision_rungs() if r.name == "bf16_load")
    assert rung.blocked(Context(knobs=user, facts=facts)) is None
    knobs = rung.apply(Context(knobs=user, facts=facts))
    assert _moved_after_training(tiny_model, knobs.replace(optim="adamw_torch")) > 0.5


def test_lora_and_zero_keep_bf16_updates():
    """Under LoRA (float32 adapters) or DeepSpeed ZeRO (a float32 master copy) bf16 weights do not freeze training."""
    facts = RunFacts(model_source="string", bf16_moving=0.02)
    rung = next(r for r in _precision_rungs() if r.name == "bf16_load")
    assert rung.blocked(Context(knobs=TRL_DEFAULTS, facts=facts)) is not None
    assert rung.blocked(Context(knobs=TRL_DEFAULTS.replace(lora_r=16), facts=facts)) is None
    assert rung.blocked(Context(knobs=TRL_DEFAULTS.replace(zero_stage=2), facts=facts)) is None
    assert rung.blocked(Context(knobs=TRL_DEFAULTS, facts=facts.replace(bf16_supported=False))) is not None


def test_the_end_of_a_run_never_says_a_frozen_full_fine_tune_was_kept():
    facts = RunFacts(bf16_moving=0.02)
    user = TRL_DEFAULTS.replace(dtype="bfloat16")
    assert "a full fine-tune" not in kept_of(user, user, facts=facts)
    assert "a full fine-tune" in kept_of(TRL_DEFAULTS, TRL_DEFAULTS, facts=facts)
    assert "a full fine-tune" in kept_of(user, user, facts=RunFacts(bf16_moving=0.9))
    line = precision_warning(user, facts)
    assert line is not None and line.startswith("98% of the weights' updates are below bfloat16's resolution")
