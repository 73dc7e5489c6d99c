"""The TRL users already have: the supported range, what is read from the installed TRL, and the refusal below it.

oomguard runs on TRL 0.29 to 1.x (``oomguard.vocab.trlrange``). What differs between releases is read from the
installed code (``oomguard.child.trlcompat``): GRPOConfig's fields, GRPOTrainer's arguments, the LM head. The tests
marked ``core`` run under the oldest supported TRL too (``tests/compat.sh``), so each assertion here holds on both
ends of the range.
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
from pathlib import Path

import pytest

from oomguard.child import trlcompat
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import Exhausted, load_ladder
from oomguard.memory.estimate import SIMULATED_HEAD_ERROR, Coefficients, ModelSpec, estimate, measured_error
from oomguard.strategies import Context
from oomguard.vocab.knobs import STACK_ONLY, TRL_DEFAULTS, RunFacts
from oomguard.vocab.trlrange import FLOOR, TESTED, head_of, support

from helpers import ROOT, run_oomguard

# ---------------------------------------------------------------------------------------------------------------
# What is read from the installed TRL


def lacking(config_fields: frozenset[str]) -> set[str]:
    """What every tested TRL lacks: the knobs only a stack around TRL takes, and continuous batching's memory share and
    batch tokens before GRPOConfig had ``transformers_continuous_batching_config`` (TRL 1.10)."""
    cb = {"cb_max_memory_percent", "cb_max_batch_tokens"}
    return set(STACK_ONLY) | (set() if "transformers_continuous_batching_config" in config_fields else cb)


@pytest.mark.core
def test_the_installed_trl_is_read_from_its_code_and_is_in_the_tested_range():
    """Under either end of the range: every knob reaches this TRL, its LM head is the one its release is known to
    have, and a 4-bit load of a model given by name goes where this TRL takes it."""
    import trl

    f = trlcompat.read()
    assert f.version == trl.__version__ and support(f.version).status == "tested"
    assert set(f.lacks()) == lacking(f.config_fields)
    assert f.head == head_of(f.version)
    assert f.quantization_via == ("quantization_config" if f.takes("quantization_config") else "model_init_kwargs")
    assert {"peft_config", "callbacks", "processing_class", "train_dataset"} <= f.trainer_args
    # oomguard's own patch of GRPOTrainer keeps TRL's signature, so the arguments are read the same once it is in
    import trl.trainer.grpo_trainer as module

    from oomguard.child import patches
    from oomguard.child.runtime import Runtime
    from oomguard.vocab.protocol import Plan

    patches.patch_grpo_trainer(Runtime(Plan()), module)
    try:
        assert trlcompat.read().trainer_args == f.trainer_args
    finally:
        patches.remove()


@pytest.mark.core
@pytest.mark.slow
@pytest.mark.e2e
def test_the_readme_job_first_choice_is_predicted_within_the_measured_error(tmp_path):
    """The README's main job under the installed TRL: the training process reports its TRL, and the first config
    oomguard probes (the user's own where it is predicted to fit, else the climb's choice) is predicted within the
    simulated device's measured error for that TRL's LM head of what the probe then measures (the worst case: the
    longest prompt, full completions). Slow: about a minute; CI runs it under both ends of the range."""
    import trl

    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "300MiB", "--always-probe",
                            str(ROOT / "examples" / "grpo_gsm8k.py"),
                            env={"OOMGUARD_EXAMPLE_CACHE": str(tmp_path / "cache")}, timeout=1500)
    assert out.returncode == 0 and rep["status"] == "stable", out.stderr[-3000:]
    facts = rep["facts"]
    assert facts["trl_version"] == trl.__version__
    assert facts["trl_lacks"] == sorted(lacking(trlcompat.read().config_fields))
    assert facts["trl_head"] == head_of(trl.__version__)
    first = next(a for a in rep["attempts"] if a["kind"] == "probe" and a["outcome"] == "ok")
    over, under = SIMULATED_HEAD_ERROR[facts["trl_head"]]
    predicted_alloc = first["predicted_bytes"] / (1 + Coefficients.for_simulated().f_frag)
    err = predicted_alloc / first["peak_bytes"] - 1
    assert -under <= err <= over, (err, first)
    run = rep["attempts"][-1]
    assert run["kind"] == "run" and run["peak_bytes"] <= first["peak_bytes"]  # the worst case was probed


def _fake(fields: set[str], params: tuple[str, ...], fused: bool) -> tuple[types.ModuleType, types.ModuleType]:
    cfg, trainer = types.ModuleType("grpo_config"), types.ModuleType("grpo_trainer")
    cfg.GRPOConfig = type("GRPOConfig", (), {"__dataclass_fields__": dict.fromkeys(fields)})
    args = ", ".join(("self", *params))
    ns: dict = {}
    exec(f"def __init__({args}): pass", ns)
    trainer.GRPOTrainer = type("GRPOTrainer", (), {"__init__": ns["__init__"]})
    if fused:
        trainer.add_fused_lm_head = lambda *a, **k: None
    return cfg, trainer


def test_a_trl_without_a_field_or_argument_reports_the_knobs_that_cannot_reach_it():
    """A release without ``steps_per_generation`` or the trainer's ``quantization_config`` (as before TRL 1.10):
    the knob that cannot reach it is reported, and a 4-bit load goes through model_init_kwargs instead."""
    fields = set(TRL_DEFAULTS.to_dict()) - {"steps_per_generation"} | {
        "activation_checkpointing", "deepspeed", "fsdp", "model_init_kwargs", "transformers_continuous_batching_config"}
    f = trlcompat.read(*_fake(fields, ("model", "args", "train_dataset", "peft_config"), fused=False))
    assert f.lacks() == ("steps_per_generation",) and f.head == "logits"
    assert f.quantization_via == "model_init_kwargs"
    assert f.facts()["trl_lacks"] == ["steps_per_generation"]
    f = trlcompat.read(*_fake(fields, ("model", "args", "train_dataset"), fused=True))
    assert set(f.lacks()) == {"steps_per_generation", "lora_r", "lora_alpha", "lora_target_modules"}
    assert f.head == "fused"


def test_a_rung_whose_knob_this_trl_lacks_is_passed_over_with_the_reason():
    """As a rung whose knobs the command never reads: the climb goes on to the next one, and says why."""
    lad = load_ladder("fastest")  # shorter_sequences is its first rung after the allocator's
    facts = RunFacts(trl_version="9.1.0", trl_lacks=("max_completion_length",))
    ctx = Context(knobs=TRL_DEFAULTS, facts=facts, used={"expandable_segments": 1, "empty_cache": 1})
    step = lad.next(ctx)
    assert not isinstance(step, Exhausted) and step.remedy.name != "shorter_sequences"
    why = dict(step.skipped)["shorter_sequences"]
    assert why == "the installed TRL (9.1.0) has no way to take max_completion_length"
    # without the fact, the same climb takes it
    assert lad.next(Context(knobs=TRL_DEFAULTS, used=ctx.used)).remedy.name == "shorter_sequences"


def test_support_names_the_range_and_reads_prereleases():
    assert FLOOR == "0.29" and TESTED[0].startswith("0.29") and TESTED[-1] == "1.16.0"
    assert [support(v).status for v in ("0.29.0", "0.29.0rc1", "1.14.2", "1.16.1", "1.17.0.dev0", "2.0.0")] == [
        "tested", "tested", "tested", "newer", "newer", "newer"]
    old = support("0.27.2")
    assert old.refused and "0.27.2" in old.message and "0.29" in old.message and 'pip install "trl>=0.29,<2"' in old.message
    assert support("1.17.0").message.startswith("TRL 1.17.0 is newer than the newest release oomguard was tested with")
    assert [head_of(v) for v in ("1.15.0", "1.14.2", "0.29.1")] == ["fused", "logits", "logits"]


# ---------------------------------------------------------------------------------------------------------------
# The memory model per LM head, and the margins per release

TINY = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True)


def test_the_memory_model_counts_the_head_the_installed_trl_has():
    """The README job's config: on the simulated device (no Triton) TRL 1.16's chunked head scores every position in
    4096-token tiles with fp32 temporaries, 0.29-1.14 materialise logits over the completion positions only; the
    measured peaks are 499 and 169 MiB (tests/fixtures/trl/readme-job.json)."""
    k = TRL_DEFAULTS.replace(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_completion_length=256,
                             bf16=False)
    fused = estimate(TINY, k, prompt_tokens=98, simulated=True, head="fused")
    logits = estimate(TINY, k, prompt_tokens=98, simulated=True, head="logits")
    assert fused.peak_alloc_bytes > 2.5 * logits.peak_alloc_bytes
    assert estimate(TINY, k, prompt_tokens=98, simulated=True).peak_alloc_bytes == fused.peak_alloc_bytes
    with pytest.raises(ValueError, match="head must be one of"):
        estimate(TINY, k, head="chunky")


def test_the_preflight_margin_is_the_measured_error_of_the_installed_trls_head():
    from oomguard.memory.estimate.fitverdict import stop_margin

    g = Judge(300 * 2**20, simulated=True)
    js = g.judge_spec()  # what the training process judges with: each head's measured error, and the untested factor
    assert set(js.errors) == {"fused", "logits", "rowchunk"}
    untested = stop_margin(js, "logits", untested=True)
    assert untested[0] == pytest.approx(2.02) and "newer than the tested" in untested[1]
    assert stop_margin(js, "logits")[0] == pytest.approx(measured_error(simulated=True, head="logits").over + 0.02)
    g.set_trl("logits", untested=False)
    assert g.stop_margin()[0] == pytest.approx(stop_margin(js, "logits")[0]) and g.doubt == g.stop_margin()[0]
    g.set_trl("fused", untested=True)  # a newer TRL: the pre-flight waits for 3x, the doubt stays its head's
    assert g.stop_margin()[0] == pytest.approx(2.02) and g.doubt == pytest.approx(0.117)
    assert measured_error(simulated=False, head="logits").over > measured_error(simulated=False).over


def _rows() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((Path(__file__).parent / "fixtures" / "trl").glob("cpu-rows-*.json")):
        out += [(f"{path.stem[len('cpu-rows-'):]}-{r['config']['name']}", r) for r in json.loads(path.read_text())]
    return out


ROWS = _rows()


@pytest.mark.parametrize("row", [r for _, r in ROWS], ids=[i for i, _ in ROWS])
def test_each_tested_release_is_predicted_within_its_measured_error(row):
    """``python bench/cpu_calibrate.py --python VENV/bin/python --json ...`` under each tested release: real TRL GRPO
    steps on the simulated device, the worst case forced. The prediction models the LM head the row's TRL has, and
    the largest error over a head's rows is the figure the pre-flight's margin rests on (SIMULATED_HEAD_ERROR)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from cpu_calibrate import Config, predict

    cfg = Config(**row["config"])
    assert row["trl_head"] == head_of(row["trl"])
    est = predict(cfg, Coefficients.for_simulated(), row["trl_head"])
    err = (est.peak_alloc_bytes - row["peak"]) / row["peak"]
    over, under = SIMULATED_HEAD_ERROR[row["trl_head"]]
    assert -under <= err <= over, (row["trl"], cfg.name, est.phases, row["phases"])


def test_the_head_errors_are_the_rows_figures():
    """The constants are the largest over- and under-prediction over the rows of each head, rounded up to a tenth
    of a percent (not a hope)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from cpu_calibrate import Config, predict

    worst: dict[str, list[float]] = {}
    for _, row in ROWS:
        est = predict(Config(**row["config"]), Coefficients.for_simulated(), row["trl_head"])
        err = (est.peak_alloc_bytes - row["peak"]) / row["peak"]
        w = worst.setdefault(row["trl_head"], [0.0, 0.0])
        w[0], w[1] = max(w[0], err), max(w[1], -err)
    assert set(worst) == {"fused", "logits"}
    for head, (over, under) in worst.items():
        assert SIMULATED_HEAD_ERROR[head] == (math.ceil(1000 * over) / 1000, math.ceil(1000 * under) / 1000), (
            head, over, under)


# ---------------------------------------------------------------------------------------------------------------
# Below the floor: one line, exit 2, nothing launched and no traceback


def _old_trl(tmp: Path, version: str = "0.28.0") -> Path:
    """A stand-in TRL of ``version`` (a package and its dist-info): what an environment with an old TRL holds."""
    site = tmp / "old-site"
    (site / "trl").mkdir(parents=True)
    (site / "trl" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"trl-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: trl\nVersion: {version}\n")
    return site


TRAIN = "import pathlib, sys\nimport trl\npathlib.Path(sys.argv[1]).write_text('trained')\n"


@pytest.mark.core
def test_a_trl_below_the_floor_is_refused_in_one_line_before_anything_launches(tmp_path):
    site = _old_trl(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "100MiB", str(script), str(tmp_path / "marker"), env=env)
    assert out.returncode == 2 and rep is None
    assert out.stderr.strip().splitlines() == [
        'oomguard: TRL 0.28.0 is installed; oomguard supports TRL 0.29 to 1.x (tested: 0.29.1, 1.10.0, 1.16.0): '
        'pip install "trl>=0.29,<2"']
    assert not (tmp_path / "marker").exists() and not (tmp_path / "wd").exists()  # nothing launched


@pytest.mark.core
def test_a_command_in_another_environment_with_an_old_trl_is_refused_by_its_training_process(tmp_path):
    """The supervisor cannot see a shell script's interpreter: the training process refuses the old TRL when it
    imports it, with the same line and exit 2, and no traceback from inside a patch."""
    site = _old_trl(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    shell = tmp_path / "train.sh"
    shell.write_text(f'PYTHONPATH="$PYTHONPATH:{site}" exec {sys.executable} {script} {tmp_path / "marker"}\n')
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "100MiB", "--", "/bin/sh", str(shell))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "marker").exists()
    assert out.stderr.count("oomguard: TRL 0.28.0 is installed; oomguard supports TRL 0.29 to 1.x") == 1
    assert rep["status"] == "failed" and rep["exit_code"] == 2


def test_a_newer_trl_runs_with_one_line_and_a_probe(tmp_path):
    """A TRL newer than the newest tested release runs: one line says so, and the first config is probed even under
    --no-probe (its memory behaviour was never measured). A stand-in newer TRL whose script allocates nothing."""
    site = _old_trl(tmp_path, "1.99.0")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "100MiB", "--no-probe", str(script), str(tmp_path / "m"),
                            env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("TRL 1.99.0 is newer than the newest release oomguard was tested with (1.16.0)") == 1
    assert (tmp_path / "m").read_text() == "trained"
    assert rep["status"] == "stable"


def test_pip_install_keeps_a_trl_and_transformers_inside_the_range():
    """The declared range admits both ends that are tested (the dry run of tests/compat.sh shows pip keeps them)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    reqs = {r.name: r for r in map(Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"])}
    for version in ("0.29.0", "0.29.1", "1.10.0", "1.16.0", "1.99.0"):
        assert reqs["trl"].specifier.contains(version), version
    assert not reqs["trl"].specifier.contains("0.28.0") and not reqs["trl"].specifier.contains("2.0.0")
    for version in ("5.3.0", "5.24.0", "5.99.0"):
        assert reqs["transformers"].specifier.contains(version), version
    assert not reqs["transformers"].specifier.contains("6.0.0")
    # the lowest TRL pip may install is the floor the training process refuses below (tests/compat.sh runs the core
    # tests under it: tests/test_ci_script.py runs that script, and tests/ci.sh, which runs it in CI)
    major, minor = map(int, FLOOR.split("."))
    assert reqs["trl"].specifier.contains(f"{FLOOR}.0") and not reqs["trl"].specifier.contains(f"{major}.{minor - 1}.99")
