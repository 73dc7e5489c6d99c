"""What a command's launcher says about the job before it runs: several ranks, DeepSpeed or FSDP, where torchrun's
rendezvous is, and this node's place in a job of several nodes. Read from the arguments as people write them (the
launchers and their flags are ``vocab/launchers.py``'s table), never by running anything.

The supervisor uses it to give a distributed command the rungs that only apply there (``multi-gpu``: DeepSpeed's
buffers, the ZeRO stages, offload) without ``--ladder``, and a job on several nodes its membership (``membership_of``:
which node this is, how many there are, where they meet; the group protocol is ``run/group.py``).

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
from dataclasses import dataclass
from pathlib import Path

from ..vocab.launchers import ACCELERATE, DEEPSPEED, LAUNCHERS, TORCHRUN, Launcher, by_module, by_script

GROUP_ENV = "OOMGUARD_GROUP"  # the group's shared directory, when --group is not given
PORT_ENV = "OOMGUARD_GROUP_PORT"  # the port of the group's store on torchrun's rendezvous host
DISTRIBUTED_TYPES = ("DEEPSPEED", "FSDP", "MULTI_GPU", "MULTI_CPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU",
                     "MULTI_MUSA", "MULTI_HPU", "MULTI_SDAA", "MULTI_NEURON", "MEGATRON_LM")


def _launcher(argv: Sequence[str]) -> tuple[Launcher | None, list[str]]:
    """Which launcher the command starts (``vocab/launchers.py``) and its own arguments (up to the training script).

    >>> found, own = _launcher(["python", "-m", "torch.distributed.run", "--nnodes=2", "train.py", "--nnodes", "9"])
    >>> found.key, own
    ('torchrun', ['--nnodes=2'])
    """
    for i, a in enumerate(argv[:4]):
        mod = argv[i + 1] if a == "-m" and i + 1 < len(argv) else None
        found = by_module(mod) if mod else by_script(a)
        if found is not None:
            return found, _own(argv[i + (2 if mod else 1):])
    return None, []


def _own(args: Sequence[str]) -> list[str]:
    """A launcher's own arguments: those before the training script (``*.py``) or ``--``."""
    out = []
    for a in args:
        if a.endswith(".py") or a == "--":
            break
        out.append(a)
    return out


def _value(args: Sequence[str], *names: str) -> str | None:
    """The value of the first of ``names`` in ``args`` (``--x V`` or ``--x=V``)."""
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _span(text: str | None) -> tuple[int, int] | None:
    """A count as launchers take it: ``N``, or torchrun's elastic ``MIN:MAX``; None when it is not one.

    >>> _span("2"), _span(" 1 : 4 "), _span("gpu")
    ((2, 2), (1, 4), None)
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text or "")
    return (int(m.group(1)), int(m.group(2) or m.group(1))) if m else None


def _int(text: str | None) -> int | None:
    """The count a launcher may reach (the most of a range)."""
    span = _span(text)
    return span[1] if span else None


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
    if launcher is TORCHRUN:
        nproc = _value(own, *TORCHRUN.processes)
        n = _int(nproc)
        if nproc is not None and n is None:  # "gpu", "auto": one rank per device
            return f"torchrun {TORCHRUN.processes[0]} {nproc} starts one rank per device"
        if n and n > 1:
            return f"torchrun {TORCHRUN.processes[0]} {n} starts {n} ranks"
        nodes = _int(_value(own, *TORCHRUN.nodes))
        if nodes and nodes > 1:
            return f"torchrun {TORCHRUN.nodes[0]} {nodes} spans {nodes} nodes"
    elif launcher is ACCELERATE:
        for flag, what in (("--use_deepspeed", "DeepSpeed"), ("--use-deepspeed", "DeepSpeed"), ("--use_fsdp", "FSDP"),
                           ("--use-fsdp", "FSDP"), ("--multi_gpu", "several GPUs"), ("--multi-gpu", "several GPUs")):
            if flag in own:
                return f"accelerate launch {flag} runs {what}"
        n = _int(_value(own, *ACCELERATE.processes))
        if n and n > 1:
            return f"accelerate launch {ACCELERATE.processes[0]} {n} starts {n} ranks"
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
    elif launcher is DEEPSPEED:
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
    if launcher is not TORCHRUN:
        return None
    endpoint = _value(own, "--rdzv-endpoint", "--rdzv_endpoint")
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            host, port = endpoint, ""
        return host.strip("[]"), int(port) if port else 29400
    addr = _value(own, "--master_addr", "--master-addr")
    if addr:
        given = _value(own, "--master_port", "--master-port")
        return addr, int(given) if given and given.isdigit() else 29500
    return None


class GroupError(Exception):
    """The group cannot form or has ended early (a node died, the leader vanished): the message says which and why."""


@dataclass(frozen=True)
class Membership:
    """This node's place in the job: its rank among the nodes, how many there are, where they meet."""

    node: int
    nodes: int
    root: str  # the shared directory
    job: str = "job"  # the job's name within it (Slurm's job and step, torchrun's --rdzv-id)
    source: str = ""  # where node and nodes were read (for the user)
    # torchrun's rendezvous host and the port of the group's store there, where the nodes may meet without a shared
    # directory (oomguard/run/rendezvous.py); None where --group or $OOMGUARD_GROUP names the directory
    store: tuple[str, int] | None = None

    @property
    def leader(self) -> bool:
        return self.node == 0


def _count(text: str, what: str) -> int:
    span = _span(text)
    if span is None or span[0] != span[1]:
        raise GroupError(f"{what} is {text!r}: oomguard supervises a fixed number of nodes; give one number "
                         "(or --nodes N)")
    return span[0]


def membership_of(argv: Sequence[str], env: Mapping[str, str], *, group: str | None = None, node: int | None = None,
                  nodes: int | None = None, workdir: str = ".oomguard") -> Membership | None:
    """This node's membership, or None for a job on one node. Read, in order, from the options (``--nodes``,
    ``--node-rank``), the launcher's own arguments (each launcher's node flags in ``vocab/launchers.py``: torchrun's
    ``--nnodes``/``--node_rank``, accelerate's ``--num_machines``/``--machine_rank``) and a Slurm step
    (``SLURM_STEP_NUM_NODES``, ``SLURM_NODEID``). Raises GroupError, with what to pass, where it cannot be known.

    >>> m = membership_of(["torchrun", "--nnodes", "2", "--node_rank", "1", "--rdzv-id", "r7", "t.py"], {})
    >>> (m.node, m.nodes, m.job, m.root)
    (1, 2, 'r7', '.oomguard/group')
    >>> membership_of(["python", "t.py"], {}) is None
    True
    >>> membership_of(["python", "t.py"], {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "4", "SLURM_NODEID": "3",
    ...                                    "SLURM_JOB_ID": "88"}).job
    '88.0'
    """
    source = "--nodes/--node-rank"
    n_text = str(nodes) if nodes is not None else None
    r_text = str(node) if node is not None else None
    own = _own(argv)  # the launcher's arguments (and what runs it), never the training script's
    launcher = ""
    for spec in LAUNCHERS:
        t = _value(own, *spec.nodes)
        if t is not None:
            n_text = n_text or t
            r_text = r_text if r_text is not None else _value(own, *spec.node_rank)
            launcher = spec.name
            break
    slurm = "SLURM_STEP_ID" in env and int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1) > 1
    if slurm:
        n_text = n_text or env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
        r_text = r_text if r_text is not None else env.get("SLURM_NODEID")
        if env.get("SLURM_LOCALID", "0") != "0":
            raise GroupError("several oomguards were started on this node (SLURM_LOCALID "
                             f"{env['SLURM_LOCALID']}): start one per node (srun --ntasks-per-node=1)")
    if n_text is None:
        return None
    total = _count(n_text, f"the node count ({launcher or 'Slurm'})")
    if total <= 1:
        return None
    if r_text is None or not r_text.strip().isdigit():
        raise GroupError(f"the command spans {total} nodes but this node's rank is not known ({r_text or 'not given'}"
                         "): pass --node-rank N (or the launcher's --node_rank/--machine_rank)")
    rank = int(r_text)
    if rank >= total:
        raise GroupError(f"node rank {rank} is not below the node count {total}: check --node-rank")
    source = launcher or ("Slurm" if slurm else source)
    job = (f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}" if "SLURM_JOB_ID" in env
           else _value(own, "--rdzv-id", "--rdzv_id") or "job")
    root = group or env.get(GROUP_ENV) or str(Path(workdir) / "group")
    store = None
    if not (group or env.get(GROUP_ENV)) and (rdzv := rendezvous(argv)) is not None:
        store = (rdzv[0], store_port(rdzv[1], env))
    return Membership(node=rank, nodes=total, root=root, job=re.sub(r"[^\w.-]", "_", job), source=source,
                      store=store)


__all__ = ["GROUP_ENV", "PORT_ENV", "GroupError", "Membership", "accelerate_yaml", "distributed_reason", "membership_of",
           "rendezvous", "store_port"]
