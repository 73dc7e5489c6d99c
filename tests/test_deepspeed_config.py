"""DeepSpeed as users configure it, without running DeepSpeed: the config forms people write (a stage-only JSON or
dict, an ``accelerate launch --config_file`` YAML), the buffers DeepSpeed sizes by itself where the config is silent,
the rung that sizes them to the model, the diagnosis of a request that is one of them, and the ladder a distributed
command gets without ``--ladder``. The runs themselves are in tests/test_deepspeed.py (slow)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.child.runtime import Runtime
from oomguard.decide.conductor import Policy
from oomguard.decide.ladder import distributed_reason_of as facts_reason
from oomguard.decide.ladder import load_ladder
from oomguard.memory.estimate import ModelSpec, estimate
from oomguard.oom.diagnose import diagnose
from oomguard.oom.parse import parse_oom
from oomguard.oom.recommend import ranked
from oomguard.run.launch import distributed_reason, rendezvous
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.distributed import deepspeed_buckets, observe_deepspeed
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.oomreport import Frame
from oomguard.vocab.protocol import Plan

from helpers import PYTHON

ROWS = {r["name"]: r for r in json.loads((Path(__file__).parent / "fixtures" / "deepspeed" /
                                          "zero-rows-simulated.json").read_text())}
TINY = ModelSpec.from_config(ROWS["tiny-z2"]["config"])
RUN = Knobs(dtype="float32", optim="adamw_torch", max_completion_length=64, num_generations=4,
            per_device_train_batch_size=4, bf16=False)
STAGE_ONLY = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
# the message and frames of a real OOM of DeepSpeed's default bucket (two ranks, ZeRO-2, the simulated device)
BUCKET_OOM = ("CUDA out of memory. Tried to allocate 1.86 GiB. GPU 0 has a total capacity of 1.12 GiB of which 1.08 GiB "
              "is free. Including non-PyTorch memory, this process has 40.00 MiB memory in use. Of the allocated memory "
              "25.43 MiB is allocated by PyTorch, and 14.57 MiB is reserved by PyTorch but unallocated.")
SITE = "/venv/lib/python3.11/site-packages"
BUCKET_FRAMES = [Frame(f"{SITE}/deepspeed/runtime/engine.py", 3428, "backward"),
                 Frame(f"{SITE}/torch/autograd/graph.py", 979, "_engine_run_backward"),
                 Frame(f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", 1372, "grad_handling_hook"),
                 Frame(f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", 2287, "process_gradients"),
                 Frame(f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", 3266, "setup_buckets")]


def predicted(knobs: Knobs) -> int:
    return estimate(TINY, RUN.merged(knobs), world_size=2, prompt_tokens=14, simulated=True).peak_alloc_bytes


# -- the config as DeepSpeed will see it -------------------------------------------------------------------------------
def test_a_stage_only_config_leaves_deepspeeds_default_bucket_on_every_rank():
    """{"zero_optimization": {"stage": 2}} sets no bucket size: DeepSpeed allocates 500,000,000 elements (1.86 GiB of
    float32 gradients) per rank whatever the model; the model counts it, and "auto" (hidden_size²) does not."""
    observed = observe_deepspeed(STAGE_ONLY)
    assert observed == {"zero_stage": 2, "offload_optimizer": False, "offload_params": False}
    silent, auto = predicted(Knobs(**observed)), predicted(Knobs(**observed, reduce_bucket_size="auto"))
    assert silent - auto > 5e8 * 4 * 0.95
    assert predicted(Knobs(**observed, overlap_comm=True)) - silent == pytest.approx(2e9, rel=0.01)  # two buckets
    notes = estimate(TINY, RUN.merged(Knobs(**observed)), world_size=2, simulated=True).notes
    assert any("reduce bucket" in n and "DeepSpeed's default" in n for n in notes)


@pytest.mark.parametrize("name", ["tiny-z2-stage", "tiny-z3-stage", "wide-z2-stage", "wide-z3-stage",
                                  "tiny-z2-overlap", "tiny-z2-yaml", "tiny-z3-yaml"])
def test_deepspeeds_own_buffers_are_predicted_per_rank(name):
    """The rows measured with DeepSpeed's defaults, overlap_comm and accelerate's YAML-built config
    (bench/zero_calibrate.py): the larger rank's peak within 1% (the auto-sized rows are in test_distributed.py)."""
    row = ROWS[name]
    p = estimate(ModelSpec.from_config(row["config"]), Knobs(**row["knobs"]), world_size=2,
                 prompt_tokens=row["facts"]["prompt_tokens_max"], simulated=True).peak_alloc_bytes
    assert p == pytest.approx(max(row["peaks"]), rel=0.01)


# the same, with the gradient accumulation accelerate's `config` writes into the YAML's DeepSpeed section
YAML = (Path(__file__).parent / "fixtures" / "deepspeed" / "accelerate-deepspeed.yaml").read_text().replace(
    "  offload_optimizer_device", "  gradient_accumulation_steps: 1\n  offload_optimizer_device")


def launch_env(yaml: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file YAML` gives its ranks (accelerate's own launcher code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults, mp = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(yaml),
                                                                                       "train.py"]))
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as launch_command sets it
    return prepare_deepspeed_cmd_env(args)[1]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_config_accelerate_builds_from_its_yaml_is_the_one_modelled_and_rewritten(tmp_path, monkeypatch, stage):
    """The form of open-r1's and TRL's recipes: `distributed_type: DEEPSPEED`, `zero_stage`, offload devices, no
    bucket sizes. oomguard reads the config accelerate's plugin builds from the launcher's environment, models its
    default buckets, and rewrites it so that accelerate accepts it in GRPOConfig.deepspeed (the YAML's fields kept)."""
    from accelerate.utils import DeepSpeedPlugin

    from oomguard.child import dsconfig

    yaml = tmp_path / f"zero{stage}.yaml"
    yaml.write_text(YAML.format(stage=stage, init=str(stage == 3).lower()))
    env = launch_env(yaml)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
    for k, v in env.items():
        if k.startswith("ACCELERATE_"):
            monkeypatch.setenv(k, v)
    cfg = SimpleNamespace(deepspeed=None, use_cpu=True, fsdp="")
    built, source = dsconfig.user_deepspeed(cfg)
    assert source == "accelerate" and built["zero_optimization"]["stage"] == stage
    observed = dsconfig.observe(cfg)
    assert observed["zero_stage"] == stage and observed["offload_optimizer"] is False
    assert all(observed.get(k) is None for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size"))
    assert predicted(Knobs(**observed)) > 5e8 * 4  # the default bucket, on every rank

    sized = make_remedy("deepspeed_buffers").apply(Context(knobs=TRL_DEFAULTS.merged(observed)))
    overrides = {k: v for k, v in sized.to_dict().items() if v != TRL_DEFAULTS.merged(observed).to_dict()[k]}
    assert overrides == ({"reduce_bucket_size": "auto"} if stage == 2 else
                         dict.fromkeys(("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                        "stage3_param_persistence_threshold"), "auto"))
    rt = Runtime(Plan(attempt=2, overrides=overrides, crash_dir=str(tmp_path), events=str(tmp_path / "ev.jsonl")))
    dsconfig.apply(rt, cfg)
    generated = json.loads(Path(cfg.deepspeed).read_text())
    zero = generated["zero_optimization"]
    assert zero["stage"] == stage and zero["reduce_bucket_size"] == "auto"
    assert zero["offload_optimizer"]["device"] == "none" and generated["gradient_accumulation_steps"] == 1
    event = json.loads((tmp_path / "ev.jsonl").read_text().splitlines()[0])
    assert event["replaces"] == "accelerate's, from its --config_file"
    # accelerate takes the generated file under the same launch (it refused it while the YAML's fields were listed)
    DeepSpeedPlugin(hf_ds_config=cfg.deepspeed)


# -- the rung -----------------------------------------------------------------------------------------------------------
def test_the_buffer_rung_sizes_only_what_the_config_leaves_to_deepspeed():
    rung = make_remedy("deepspeed_buffers")
    assert rung.foreign(Context(knobs=TRL_DEFAULTS)) == "the run does not use DeepSpeed ZeRO"
    mine = TRL_DEFAULTS.replace(zero_stage=3, reduce_bucket_size=20_000_000)
    k = rung.apply(Context(knobs=mine))
    assert k.reduce_bucket_size == 20_000_000  # the user's own size stays
    assert k.stage3_prefetch_bucket_size == k.stage3_param_persistence_threshold == "auto"
    assert "already sizes" in rung.blocked(Context(knobs=k))
    # one rank under ZeRO (DeepSpeed for its offload) has the bucket too
    assert rung.blocked(Context(knobs=TRL_DEFAULTS.replace(zero_stage=2), facts=RunFacts(world_size=1))) is None
    assert rung.trades == "speed" and rung.cost == "speed" and rung.resume == "continue"


def test_the_multi_gpu_ladder_sizes_the_buffers_before_any_quality_trade():
    names = [r.name for r in load_ladder("multi-gpu").rungs]
    assert names.index("deepspeed_buffers") < names.index("zero2")
    assert all(names.index("deepspeed_buffers") < names.index(q)
               for q in names if make_remedy(q).trades == "quality")


@pytest.mark.parametrize("ladder", [None, "fastest"])
def test_plan_suggests_the_buffer_rung_for_a_stage_only_config(tmp_path, ladder):
    """`oomguard plan` for the stage-only ZeRO-2 config at 60% of its peak: the buffers alone make it fit (the
    multi-gpu ladder, picked for two ranks without --ladder). Under `--ladder fastest`, whose shorter completions and
    fewer generations come first, the same: no cut of the batch shrinks the bucket (tests/test_deepspeed.py runs the
    config, and the pre-flight's choice is this one)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(ROWS["tiny-z2-stage"]["config"]))
    out = subprocess.run([PYTHON, "-m", "oomguard", "plan", "--model", str(cfg), "--gpu", "1178MiB", "--world-size",
                          "2", "--json", *(["--ladder", ladder] if ladder else []), "zero_stage=2", "dtype=float32",
                          "bf16=false", "optim=adamw_torch", "num_generations=4", "per_device_train_batch_size=4",
                          "max_completion_length=64"], capture_output=True, text=True, timeout=120)
    plan = json.loads(out.stdout)
    assert out.returncode == 3 and not plan["fits"], out.stderr[-2000:]
    assert plan["suggest"] == {"reduce_bucket_size": "auto"} and plan["fits_after"]


# -- the diagnosis ---------------------------------------------------------------------------------------------------
def test_a_request_the_size_of_deepspeeds_bucket_is_that_bucket_not_a_shape():
    """The 1.86 GiB request of a stage-only ZeRO-2 run on a 1.12 GiB device: not "only smaller shapes" but DeepSpeed's
    reduce bucket, by its size (the run's knobs and model) and by the frame that allocates it; the buffer rung is
    the remedy, and the shape rungs say why they cannot help."""
    report = parse_oom(BUCKET_OOM)
    knobs = {**RUN.to_dict(), "zero_stage": 2}
    buffers = deepspeed_buckets(knobs, ROWS["tiny-z2-stage"]["config"])
    for d in (diagnose(report, phase="backward", buffers=buffers), diagnose(report, BUCKET_FRAMES)):
        assert d.kind == "impossible" and "reduce bucket" in d.buffer
        assert "only smaller shapes" not in " ".join(d.evidence) and "reduce_bucket_size" in d.evidence[0]
        assert make_remedy("deepspeed_buffers").helps(d) is None
        assert "only its size can change it" in make_remedy("fewer_generations").helps(d)
    assert "500,000,000 elements, DeepSpeed's default" in diagnose(report, phase="backward", buffers=buffers).buffer
    best = ranked(diagnose(report, BUCKET_FRAMES), knobs)[0]
    assert best.name == "deepspeed_buffers"
    assert best.paste == ('DeepSpeed config: "zero_optimization": {"reduce_bucket_size": "auto"}',)
    # the same size without DeepSpeed in sight is a plain oversized request
    assert diagnose(report).buffer is None


# -- the ladder a command gets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["torchrun", "--nproc_per_node", "2", "t.py"], "2 ranks"),
    ([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=gpu", "t.py"], "one rank per device"),
    (["torchrun", "--nnodes", "2", "--node_rank", "0", "t.py"], "2 nodes"),
    (["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "t.py"], "--multi_gpu"),
    (["accelerate", "launch", "--use_deepspeed", "t.py"], "DeepSpeed"),
    (["deepspeed", "--num_gpus", "2", "t.py"], "deepspeed launcher"),
    (["python", "t.py", "--deepspeed", "ds_zero3.json"], "--deepspeed ds_zero3.json"),
    (["trl", "grpo", "--fsdp", "full_shard auto_wrap"], "FSDP"),
])
def test_a_distributed_command_is_recognised_from_its_launcher_or_script_flags(argv, words):
    assert words in distributed_reason(argv, {})


def test_an_accelerate_config_file_says_whether_the_run_is_distributed(tmp_path):
    yaml = tmp_path / "zero2.yaml"
    yaml.write_text(YAML.format(stage=2, init="false"))
    assert "DEEPSPEED (ZeRO stage 2)" in distributed_reason(["accelerate", "launch", "--config_file", str(yaml),
                                                             "t.py"], {})
    one = tmp_path / "one.yaml"
    one.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\n")
    assert distributed_reason(["accelerate", "launch", "--config_file", str(one), "t.py"], {}) is None
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"  # `accelerate config` wrote it
    default.parent.mkdir(parents=True)
    default.write_text(YAML.format(stage=3, init="true"))
    assert "default config" in distributed_reason(["accelerate", "launch", "t.py"], {"HF_HOME": str(tmp_path / "hf")})
    assert distributed_reason(["python", "t.py"], {}) is None


def test_the_training_processes_report_picks_the_ladder_when_the_command_did_not(tmp_path):
    """A script that builds its DeepSpeed config itself, under a launcher oomguard cannot read: the first attempt's
    report switches to the multi-gpu ladder before anything is climbed; an explicit --ladder is never switched."""
    from oomguard.display.ui import ConsoleReporter
    from oomguard.run.supervisor import RunOptions, Supervisor
    from oomguard.vocab.events import CodeSeen

    said: list[str] = []
    seen = CodeSeen("config", {"zero_stage": 2}, {"deepspeed": "GRPOConfig"}, 2)
    for auto, ladder in ((True, "multi-gpu"), (False, "default")):
        opts = RunOptions(ladder=load_ladder("default"), workdir=tmp_path / "wd",
                          policy=Policy(ladder_auto=auto))
        sup = Supervisor(["true"], opts, ConsoleReporter(quiet=True, live=False))
        sup.ui.message = said.append  # type: ignore[method-assign]
        sup.launcher.learn([seen])
        assert sup.conductor.climb.ladder.name == ladder
    assert len(said) == 1 and said[0].startswith("ladder multi-gpu: the training process runs DeepSpeed")
    assert facts_reason(RunFacts(world_size=1)) is None


def test_the_cli_says_which_ladder_it_picked_and_an_explicit_one_wins(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("print('ok')\n")
    base = [PYTHON, "-m", "oomguard", "run", "--no-probe", "--workdir", str(tmp_path / "wd"), "--report",
            str(tmp_path / "r.json"), "--lock", str(tmp_path / "l.json")]
    auto = subprocess.run([*base, "--", PYTHON, str(script), "--deepspeed", "ds.json"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert auto.returncode == 0 and "ladder multi-gpu: the script is given a DeepSpeed config" in auto.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ladder"] == "multi-gpu"
    mine = subprocess.run([*base, "--ladder", "default", "--", PYTHON, str(script), "--deepspeed", "ds.json"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert mine.returncode == 0 and "ladder multi-gpu" not in mine.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ladder"] == "default"


def test_torchruns_rendezvous_is_read_from_its_arguments():
    assert rendezvous(["torchrun", "--rdzv-endpoint", "10.0.0.1", "t.py"]) == ("10.0.0.1", 29400)
    assert rendezvous(["torchrun", "--master_addr", "n0", "--master_port", "6000", "t.py"]) == ("n0", 6000)
    assert rendezvous(["accelerate", "launch", "t.py"]) is None


def test_under_the_simulated_device_deepspeed_starts_without_building_its_cpu_shared_memory_all_reduce(monkeypatch):
    """DeepSpeed's torch backend compiles its CPU shared-memory all-reduce when communication starts (40 s to minutes
    the first time on a machine), which a GPU run never builds: under the simulated device ``build_shm_op`` answers
    None, and torch's all-reduce serves; without the simulated device nothing is patched."""
    from oomguard.child import patching, simulate
    from oomguard.child.stacks.deepspeed import comm_like_a_gpu

    def build() -> str:
        return "compiled"

    backend = SimpleNamespace(build_shm_op=build)
    rt = Runtime(Plan(simulate_gpu=1 << 30))
    comm_like_a_gpu(rt, backend)
    assert backend.build_shm_op() == "compiled"  # a real device: DeepSpeed as it is
    monkeypatch.setattr(simulate, "device", lambda: object())
    try:
        comm_like_a_gpu(rt, backend)
        assert backend.build_shm_op() is None
    finally:
        patching.remove()
    assert backend.build_shm_op() == "compiled"
