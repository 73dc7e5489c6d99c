"""Each stack's spelling of the knobs, read both ways (``oomguard/vocab/stacks/``): every knob a stack takes, printed
as the end of a run and the lock print it, parsed back the way the stack parses it, and read back by the adapter's
reader, is the value it started as; and what the adapter sets is what is printed.

ms-swift and Unsloth are not installed here: swift's arguments are a ``SimpleNamespace`` holding the argument names
the table declares, with swift's defaults, and the printed flags parsed into it by their types (as swift's argument
parser would); a notebook's call is parsed with ``ast``.
"""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.child.runtime import Runtime
from oomguard.child.stacks import swift as swift_adapter
from oomguard.child.stacks import unsloth as unsloth_adapter
from oomguard.vocab.knobs import TRL_DEFAULTS
from oomguard.vocab.knobtable import OPTIMIZER_NAMES, TABLE
from oomguard.vocab.protocol import Plan
from oomguard.vocab.stacks import flag, flags, said_by_knob, told
from oomguard.vocab.stacks.spelling import Code
from oomguard.vocab.stacks.swift import ARGUMENTS, SWIFT, SWIFT_ARGUMENTS
from oomguard.vocab.stacks.unsloth import LOADER, PEFT, UNSLOTH

DS_GROUP = ("zero_stage", "offload_optimizer", "offload_params")


def values_of(knob: str) -> list[Any]:
    """Values of ``knob`` worth a round trip, from its entry in the knob table: both booleans, each allowed value,
    its range's ends, a list of names and the word it also takes."""
    info = TABLE[knob]
    if info.kind is bool:
        return [True, False]
    if info.allowed:
        return [v for v in info.allowed if v != "auto"]  # the adapters never set "auto" (the model's own dtype)
    if info.kind is tuple:
        return [("q_proj", "v_proj"), *info.also]
    if info.kind is int:
        low = int(info.minimum if info.minimum is not None else (info.above or 0) + 1)
        return [low, low + 16, *info.also]
    if info.kind is float:
        return [info.maximum if info.maximum is not None else 0.5, 0.04]
    return ["adamw_bnb_8bit"] if knob == "optim" else [info.trl or "something"]


def runtime(**overrides: Any) -> Runtime:
    return Runtime(Plan(overrides=overrides))


# ---------------------------------------------------------------------------------------------------------------
# ms-swift


def swift_args(**given: Any) -> SimpleNamespace:
    """swift's parsed arguments: the table's argument names at swift's defaults, TRL's names at TRL's."""
    base = {name: default for name, (_, default) in SWIFT_ARGUMENTS.items()}
    base.update({n: TRL_DEFAULTS.to_dict()[n] for n in SWIFT.takes() if TABLE[n].grpo_field})
    base.update(given)
    return SimpleNamespace(**base)


def _typed(name: str, words: list[str]) -> Any:
    kind = SWIFT_ARGUMENTS[name][0] if name in SWIFT_ARGUMENTS else TABLE[name].kind
    if kind is list:
        return words
    (word,) = words
    if word == "none":
        return None
    if kind is bool:
        return {"true": True, "false": False}[word]
    return kind(word)


def parse_swift(said: list[str]) -> SimpleNamespace:
    """The flags as swift's parser reads them into its arguments (a flag of a list takes every word up to the next)."""
    args = swift_args()
    name, words = None, []
    for token in [*shlex.split(" ".join(said)), "--"]:
        if token.startswith("--"):
            if name is not None:
                setattr(args, name, _typed(name, words))
            name, words = token[2:], []
        else:
            words.append(token)
    return args


def swift_read(args: Any) -> dict[str, Any]:
    """Every knob swift's arguments say, by the table's readers (what the adapter observes, and what the GRPOConfig
    patches read under TRL's names)."""
    out: dict[str, Any] = {}
    for s in SWIFT.spellings:
        out.update(s.from_args(args))
    return out


SWIFT_SINGLE = [(k, v) for k in SWIFT.takes() if k not in DS_GROUP for v in values_of(k)]


@pytest.mark.parametrize("knob, value", SWIFT_SINGLE, ids=[f"{k}={v}" for k, v in SWIFT_SINGLE])
def test_swift_round_trip_of_every_knob(knob, value):
    said = flags("swift", {knob: value})
    assert said and all(f.startswith("--") for f in said)
    assert swift_read(parse_swift(said))[knob] == value


@pytest.mark.parametrize("stage, optimizer, params", [(s, False, False) for s in (0, 1, 2, 3)]
                         + [(2, True, False), (3, True, True)])
def test_swift_round_trip_of_the_zero_stage_and_its_offloads(stage, optimizer, params):
    """swift spells them together as one of its presets; each combination a preset says reads back as itself."""
    values = dict(zip(DS_GROUP, (stage, optimizer, params), strict=True))
    said = flags("swift", values)
    assert said == [f"--deepspeed zero{stage}" + ("_offload" if optimizer else "")]
    read = swift_read(parse_swift(said))
    assert {k: read[k] for k in DS_GROUP} == values


def test_zero3_with_only_the_optimizer_offloaded_reaches_swift_as_exactly_that():
    """The issue's case: a rung chose ZeRO-3 and DeepSpeed's optimizer offload, not the parameters'. swift's
    ``zero3_offload`` preset offloads both (more speed and host RAM than the memory model and the diff counted), so
    swift is given a DeepSpeed JSON instead, swift's zero3 preset with the optimizer offloaded (written by the training
    process), and the flag printed is that file, once the run says where it is."""
    overrides = {"zero_stage": 3, "offload_optimizer": True}
    assert flags("swift", overrides) == ["--deepspeed <swift's zero3 preset with offload_optimizer only, as a JSON file>"]
    path = "/work/.oomguard/runs/1/attempt-2/deepspeed-attempt2.json"
    said = flags("swift", overrides, files={"deepspeed": path})  # what the lock and the terminal say
    assert said == [f"--deepspeed {path}"]
    parsed = parse_swift(said)
    assert (parsed.deepspeed, parsed.offload_optimizer, parsed.offload_model) == (path, False, False)
    assert swift_read(parsed)["offload_during_generation"] is False  # and it is not swift's offload while vLLM generates
    # a diff's rows: one flag, under the first of the two knobs; the terminal says it once
    assert said_by_knob("swift", overrides, files={"deepspeed": path}) == {"zero_stage": f"--deepspeed {path}"}
    # the stage's preset where it says exactly what was chosen: both offloads, or the optimizer's under ZeRO-2
    assert flags("swift", {**overrides, "offload_params": True}) == ["--deepspeed zero3_offload"]
    assert flag("swift", "zero_stage", 2, among=TRL_DEFAULTS.replace(offload_optimizer=True)) == "--deepspeed zero2_offload"
    assert told("swift", ["--deepspeed zero3_offload"] * 2) == "as swift's flags: --deepspeed zero3_offload"


def test_swift_s_offload_while_vllm_generates_is_its_two_flags_not_deepspeed_s():
    said = flags("swift", {"offload_during_generation": True})
    assert said == ["--offload_model true --offload_optimizer true"]
    read = swift_read(parse_swift(said))
    assert read["offload_during_generation"] is True and "zero_stage" not in read


def test_an_offload_without_a_zero_stage_is_no_swift_flag():
    """swift has no flag for DeepSpeed's offload alone: it is one of the presets, which need the stage."""
    assert flags("swift", {"offload_optimizer": True}) == [] and flag("swift", "offload_params", True) is None


ARGUMENT_KNOBS = [(k, v) for s in SWIFT.spellings if s.point == ARGUMENTS for k in s.knobs if k not in DS_GROUP
                  for v in values_of(k) if v not in (False, 0)]  # the adapter only ever turns these on


@pytest.mark.parametrize("knob, value", ARGUMENT_KNOBS, ids=[f"{k}={v}" for k, v in ARGUMENT_KNOBS])
def test_what_the_swift_adapter_sets_is_what_is_printed(knob, value):
    overrides = {knob: value, **({"lora_r": 16} if knob.startswith("lora_") and knob != "lora_r" else {})}
    args = swift_args(tuner_type="full", sleep_level=0)
    swift_adapter.apply_model_args(runtime(**overrides), args)
    printed = parse_swift(flags("swift", overrides))
    spelling = SWIFT.spelling(knob)
    assert {a: getattr(args, a) for a in spelling.args} == {a: getattr(printed, a) for a in spelling.args}
    assert spelling.from_args(args)[knob] == value


def test_the_swift_adapter_keeps_a_user_s_stronger_setting_of_the_same_knob():
    args = swift_args(sleep_level=2)
    swift_adapter.apply_model_args(runtime(vllm_enable_sleep_mode=True), args)
    assert args.sleep_level == 2


def test_a_zero3_rung_over_the_user_s_zero2_offload_keeps_their_optimizer_offload():
    """``--deepspeed zero2_offload`` and a rung that raises only the stage: swift gets ZeRO-3 with the user's optimizer
    offload kept (swift's ``zero3`` preset alone would switch it off), as the diff says."""
    args = swift_args(deepspeed="zero2_offload")
    swift_adapter.apply_model_args(runtime(zero_stage=3), args)
    written = json.loads(Path(args.deepspeed).read_text())["zero_optimization"]
    assert written["stage"] == 3 and written["offload_optimizer"]["device"] == "cpu"
    assert written.get("offload_param", {}).get("device", "none") == "none"


def test_a_zero3_rung_over_the_user_s_own_deepspeed_json_changes_only_the_stage_in_it(tmp_path):
    """``--deepspeed my_ds.json``: the rung's stage is written into the user's own config (every other key as they
    wrote it), not replaced by one of swift's presets."""
    own = tmp_path / "my_ds.json"
    own.write_text(json.dumps({"gradient_clipping": 0.7, "zero_optimization": {"stage": 2, "overlap_comm": False,
                                                                                "offload_optimizer": {"device": "cpu"}}}))
    args = swift_args(deepspeed=str(own))
    swift_adapter.apply_model_args(runtime(zero_stage=3), args)
    written = json.loads(Path(args.deepspeed).read_text())
    assert Path(args.deepspeed) != own and json.loads(own.read_text())["zero_optimization"]["stage"] == 2
    assert written["gradient_clipping"] == 0.7 and written["zero_optimization"]["stage"] == 3
    assert written["zero_optimization"]["overlap_comm"] is False
    assert written["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


# ---------------------------------------------------------------------------------------------------------------
# Unsloth


def parse_call(text: str, point: str) -> dict[str, Any]:
    """A notebook's call as its keyword arguments (``torch.bfloat16`` as a name in the code)."""
    if text.startswith("no "):  # the call is left out (no get_peft_model: a full fine-tune)
        return {}
    call = ast.parse(text, mode="eval").body
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == point
    return {kw.arg: Code(ast.unparse(kw.value)) if isinstance(kw.value, ast.Attribute) else ast.literal_eval(kw.value)
            for kw in call.keywords}


UNSLOTH_CASES = [(k, v) for k in UNSLOTH.takes() for v in values_of(k)]


@pytest.mark.parametrize("knob, value", UNSLOTH_CASES, ids=[f"{k}={v}" for k, v in UNSLOTH_CASES])
def test_unsloth_round_trip_of_every_knob(knob, value):
    spelling = UNSLOTH.spelling(knob)
    text = flag("unsloth", knob, value)
    kwargs = {**dict.fromkeys(spelling.needs, True), **parse_call(text, spelling.point)}
    read = spelling.from_args(kwargs)[knob]
    assert read == (list(value) if isinstance(value, tuple) and not isinstance(read, tuple) else value)


def test_a_4bit_load_is_said_as_unsloth_is_given_it_and_overrules_a_full_fine_tune():
    text = flag("unsloth", "load_in_4bit", True)
    assert text == ("FastLanguageModel.from_pretrained(load_in_4bit=True, load_in_8bit=False, load_in_16bit=False, "
                    "full_finetuning=False)")
    kwargs = {"full_finetuning": True, "load_in_4bit": False, "max_seq_length": 1024}
    unsloth_adapter.apply_loader(runtime(load_in_4bit=True), kwargs)
    assert kwargs == {**parse_call(text, LOADER), "max_seq_length": 1024}
    assert UNSLOTH.spelling("load_in_4bit").from_args({"load_in_4bit": True, "full_finetuning": True}) == {
        "load_in_4bit": False}


def test_the_unsloth_adapter_sets_what_is_said():
    import torch

    kwargs = {"torch_dtype": torch.float32, "fast_inference": True}
    overrides = {"dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.4, "vllm_max_model_length": 512}
    unsloth_adapter.apply_loader(runtime(**overrides), kwargs)
    said = {}
    for text in flags("unsloth", overrides):
        said.update(parse_call(text, LOADER))
    assert said == {"dtype": Code("torch.bfloat16"), "gpu_memory_utilization": 0.4, "max_seq_length": 512}
    assert kwargs == {"fast_inference": True, "dtype": torch.bfloat16, "gpu_memory_utilization": 0.4,
                      "max_seq_length": 512}  # the alias torch_dtype dropped, the name resolved
    peft: dict[str, Any] = {}
    unsloth_adapter.apply_peft(runtime(gradient_checkpointing=False), peft)
    assert peft == parse_call(flag("unsloth", "gradient_checkpointing", False), PEFT)
    unchanged = {"use_gradient_checkpointing": "unsloth"}
    unsloth_adapter.apply_peft(runtime(gradient_checkpointing=True), unchanged)
    assert unchanged == {"use_gradient_checkpointing": "unsloth"}


def test_vllm_s_loader_settings_mean_nothing_without_fast_inference():
    kwargs = {"gpu_memory_utilization": 0.6}
    unsloth_adapter.apply_loader(runtime(vllm_gpu_memory_utilization=0.3), kwargs)
    assert kwargs == {"gpu_memory_utilization": 0.6}
    seen = unsloth_adapter.observed_loader({"fast_inference": False, "gpu_memory_utilization": 0.6})
    assert not {k for k in seen if k.startswith("vllm") or k == "use_vllm"}, seen


# ---------------------------------------------------------------------------------------------------------------
# Both


def test_every_grpo_field_is_taken_under_its_own_name_and_nothing_else_is():
    """A knob that no stack spells in its own words is said under TRL's name only when it is a GRPOConfig field: the
    DeepSpeed buffer sizes, FSDP's offload and the prompt filter are no flag of swift's."""
    for table in (SWIFT, UNSLOTH):
        for name, info in TABLE.items():
            spelling = table.spelling(name)
            if info.grpo_field:
                assert spelling is not None, (table.name, name)
            elif spelling is not None:
                assert not spelling.trl_name, (table.name, name)
    for knob in ("reduce_bucket_size", "fsdp_offload", "max_prompt_tokens", "expandable_segments"):
        assert flag("swift", knob, 1) is None and flag("unsloth", knob, 1) is None


def test_the_optimizer_names_in_a_stack_s_words_are_transformers_own():
    assert flag("swift", "optim", "adamw_bnb_8bit") == "--optim adamw_bnb_8bit" and "adamw_bnb_8bit" in OPTIMIZER_NAMES
    assert flag("unsloth", "optim", "adamw_8bit") == 'GRPOConfig(optim="adamw_8bit")'


def test_an_unset_knob_is_not_said_and_a_diff_s_plain_values_are():
    """A diff row may go to None (unset), and its values are plain JSON (a list for a tuple)."""
    for stack in ("swift", "unsloth"):
        assert flags(stack, dict.fromkeys(TABLE)) == []
    row = TRL_DEFAULTS.diff(TRL_DEFAULTS.replace(lora_r=8, lora_target_modules=("q_proj", "v_proj")))[1].to_dict()
    assert flag("swift", row["knob"], row["to"]) == "--target_modules q_proj v_proj"
    assert flag("unsloth", row["knob"], row["to"]) == 'get_peft_model(target_modules=["q_proj", "v_proj"])'


def test_each_adapter_names_its_trigger_modules_and_the_functions_they_load():
    """The bootstrap loads an adapter's patches from the adapter's own tables: each names functions it has, and a
    stack with a spelling table has an adapter."""
    import importlib

    from oomguard.child.stacks import ADAPTERS

    for name in ADAPTERS:
        adapter = importlib.import_module(f"oomguard.child.stacks.{name}")
        triggers = {**adapter.TRIGGERS, **adapter.SIMULATED_TRIGGERS}
        assert triggers and all(callable(getattr(adapter, f, None)) for f in triggers.values()), name
        assert all(isinstance(v, str) for v in adapter.SIMULATED_ENVIRONMENT.values())
    assert {"swift", "unsloth"} <= set(ADAPTERS)


def test_the_report_s_diff_flags_a_climb_to_zero3_offload_as_swift_takes_it():
    """The run's report and its lock print the diff's flags: a climb that put ZeRO-3 and the optimizer offload in
    force is one ``--deepspeed PATH``, the config the attempt generated (swift's zero3 preset with the optimizer
    offloaded), read from every knob in force, not ``zero3`` beside another flag, nor ``zero3_offload``."""
    from oomguard.decide.climb import Climb
    from oomguard.decide.ladder import load_ladder
    from oomguard.vocab.knobs import RunFacts
    from oomguard.vocab.records import Attempt

    c = Climb(load_ladder("multi-gpu"), facts=RunFacts(stack="swift"))
    c.observe({"zero_stage": 2})
    final = c.original().replace(zero_stage=3, offload_optimizer=True)
    path = "/work/.oomguard/runs/1/attempt-1/deepspeed-attempt1.json"
    c.record(Attempt(index=1, knobs=final.to_dict(), remedies=[], outcome="ok", exit_code=0, seconds=1.0,
                     generated={"deepspeed": {"path": path, "config": {}, "replaces": None}}))
    rows = {r["knob"]: r.get("flag") for r in c.report("stable", "", 0).diff}
    assert rows == {"zero_stage": f"--deepspeed {path}", "offload_optimizer": None}
