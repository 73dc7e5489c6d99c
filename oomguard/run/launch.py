"""What a command's launcher says about the job before it runs: several ranks, DeepSpeed or FSDP, and where
torchrun's rendezvous is. Read from the arguments as people write them, never by running anything.

The supervisor uses it to give a distributed command the rungs that only apply there (``multi-gpu``: DeepSpeed's
buffers, the ZeRO stages, offload) without ``--ladder``, and a job on several nodes the rendezvous to meet through.

>>> distributed_reason(["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"], {})
'torchrun --nproc_per_node 2 starts 2 ranks'
>>> distributed_reason(["python", "train.py", "--lr", "1e-5"], {}) is None
True
>>> rendezvous(["torchrun", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "t.py"])
('node0', 29400)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..vocab.knobs import RunFacts

MULTI_GPU = "multi-gpu"  # the ladder a distributed command gets when --ladder is not given
_TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
_ACCELERATE = ("accelerate", "accelerate.commands.launch", "accelerate.commands.accelerate_cli", "accelerate-launch")
DISTRIBUTED_TYPES = ("DEEPSPEED", "FSDP", "MULTI_GPU", "MULTI_CPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU",
                     "MULTI_MUSA", "MULTI_HPU", "MULTI_SDAA", "MULTI_NEURON", "MEGATRON_LM")


def _launcher(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Which launcher the command starts (``torchrun``, ``accelerate``, ``deepspeed``) and its own arguments (up to
    the training script)."""
    for i, a in enumerate(argv[:4]):
        name = Path(a).name
        mod = argv[i + 1] if a == "-m" and i + 1 < len(argv) else None
        who = mod or name
        if who in _TORCHRUN:
            return "torchrun", _own(argv[i + (2 if mod else 1):])
        if who in _ACCELERATE:
            return "accelerate", _own(argv[i + (2 if mod else 1):])
        if who in ("deepspeed", "deepspeed.launcher.runner"):
            return "deepspeed", _own(argv[i + (2 if mod else 1):])
    return None, []


def _own(args: Sequence[str]) -> list[str]:
    out = []
    for a in args:
        if a.endswith(".py") or a == "--":
            break
        out.append(a)
    return out


def _value(args: Sequence[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)(?:\s*:\s*(\d+))?\s*", text)
    return int(m.group(2) or m.group(1)) if m else None


def accelerate_yaml(path: str | Path) -> dict[str, str]:
    """The top-level keys of an accelerate config file that say how it distributes (``distributed_type``,
    ``num_processes``, ``num_machines``, ``use_cpu``) and its DeepSpeed ``zero_stage``, as text; empty when the file
    cannot be read. A line reader, not a YAML parser: accelerate writes these keys one per line."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\s*)(distributed_type|num_processes|num_machines|use_cpu|zero_stage)\s*:\s*['\"]?([^'\"#]*)",
                     line)
        if m:
            out[m.group(2)] = m.group(3).strip()
    return out


def _accelerate_default_config(env: Mapping[str, str]) -> Path:
    """accelerate's default config file (``accelerate config`` writes it; ``accelerate launch`` reads it when no
    ``--config_file`` is given)."""
    if env.get("ACCELERATE_CONFIG_FILE"):
        return Path(env["ACCELERATE_CONFIG_FILE"])
    hf_home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                 "huggingface")
    return Path(hf_home) / "accelerate" / "default_config.yaml"


def distributed_reason(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Why the command is distributed (several ranks, several nodes, DeepSpeed or FSDP), read from its launcher's
    arguments and the training script's own flags; None when nothing says so.

    >>> distributed_reason(["accelerate", "launch", "--config_file", "/nonexistent.yaml", "t.py"], {}) is None
    True
    >>> distributed_reason(["python", "t.py", "--deepspeed", "ds_zero2.json"], {})
    'the script is given a DeepSpeed config (--deepspeed ds_zero2.json)'
    """
    launcher, own = _launcher(argv)
    if launcher == "torchrun":
        nproc = _value(own, "--nproc_per_node", "--nproc-per-node")
        n = _int(nproc)
        if nproc is not None and n is None:  # "gpu", "auto": one rank per device
            return f"torchrun --nproc_per_node {nproc} starts one rank per device"
        if n and n > 1:
            return f"torchrun --nproc_per_node {n} starts {n} ranks"
        nodes = _int(_value(own, "--nnodes"))
        if nodes and nodes > 1:
            return f"torchrun --nnodes {nodes} spans {nodes} nodes"
    elif launcher == "accelerate":
        for flag, what in (("--use_deepspeed", "DeepSpeed"), ("--use-deepspeed", "DeepSpeed"), ("--use_fsdp", "FSDP"),
                           ("--use-fsdp", "FSDP"), ("--multi_gpu", "several GPUs"), ("--multi-gpu", "several GPUs")):
            if flag in own:
                return f"accelerate launch {flag} runs {what}"
        n = _int(_value(own, "--num_processes", "--num-processes"))
        if n and n > 1:
            return f"accelerate launch --num_processes {n} starts {n} ranks"
        given = _value(own, "--config_file", "--config-file")
        path = Path(given) if given else _accelerate_default_config(env)
        cfg = accelerate_yaml(path)
        kind = cfg.get("distributed_type", "").upper().split(".")[-1]
        where = f"--config_file {given}" if given else f"accelerate's default config ({path})"
        if kind in ("DEEPSPEED", "FSDP"):
            stage = f" (ZeRO stage {cfg['zero_stage']})" if kind == "DEEPSPEED" and cfg.get("zero_stage") else ""
            return f"accelerate launch {where} says distributed_type: {kind}{stage}"
        procs = _int(cfg.get("num_processes"))
        if kind in DISTRIBUTED_TYPES and procs and procs > 1:
            return f"accelerate launch {where} says distributed_type: {kind} with {procs} processes"
    elif launcher == "deepspeed":
        return "the deepspeed launcher runs DeepSpeed"
    script = list(argv)
    for flag in ("--deepspeed", "--deepspeed_config"):
        v = _value(script, flag)
        if v is not None and not v.startswith("-"):
            return f"the script is given a DeepSpeed config ({flag} {v})"
    v = _value(script, "--fsdp")
    if v is not None and v.strip() and not v.startswith("-"):
        return f"the script is given FSDP options (--fsdp {v})"
    return None


def facts_reason(facts: RunFacts) -> str | None:
    """Why the training process's own report makes the run distributed (it is known after the first attempt's
    start: a launcher oomguard cannot read, a config built in the script).

    >>> facts_reason(RunFacts(world_size=4))
    'the training process reported 4 ranks'
    >>> facts_reason(RunFacts(deepspeed="accelerate")), facts_reason(RunFacts()) is None
    ("the training process runs DeepSpeed (its config from accelerate's plugin)", True)
    """
    if facts.deepspeed:
        src = {"accelerate": "its config from accelerate's plugin", "GRPOConfig": "GRPOConfig.deepspeed"}
        return f"the training process runs DeepSpeed ({src.get(facts.deepspeed, facts.deepspeed)})"
    if facts.fsdp:
        return "the training process runs FSDP (GRPOConfig.fsdp)"
    if facts.world_size > 1:
        return f"the training process reported {facts.world_size} ranks"
    return None


PORT_ENV = "OOMGUARD_GROUP_PORT"


def store_port(port: int, env: Mapping[str, str]) -> int:
    """The port of a group's store on torchrun's rendezvous host (oomguard/run/rendezvous.py): ``$OOMGUARD_GROUP_PORT``,
    else the rendezvous port plus one (torchrun's own store there lives only while an attempt runs).

    >>> store_port(29400, {}), store_port(29400, {"OOMGUARD_GROUP_PORT": "31000"})
    (29401, 31000)
    """
    given = env.get(PORT_ENV, "").strip()
    return int(given) if given.isdigit() else port + 1


def rendezvous(argv: Sequence[str]) -> tuple[str, int] | None:
    """Where torchrun's ranks meet: the c10d ``--rdzv-endpoint`` (port 29400 when it names none) or, for the static
    rendezvous, ``--master_addr``/``--master_port`` (29500 by default); None for other launchers, or a single node
    whose torchrun meets on localhost by default."""
    launcher, own = _launcher(argv)
    if launcher != "torchrun":
        return None
    endpoint = _value(own, "--rdzv-endpoint", "--rdzv_endpoint")
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            host, port = endpoint, ""
        return host.strip("[]"), int(port) if port else 29400
    addr = _value(own, "--master_addr", "--master-addr")
    if addr:
        port = _value(own, "--master_port", "--master-port")
        return addr, int(port) if port and port.isdigit() else 29500
    return None


__all__ = ["MULTI_GPU", "PORT_ENV", "accelerate_yaml", "distributed_reason", "facts_reason", "rendezvous",
           "store_port"]
