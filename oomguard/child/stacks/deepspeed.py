"""DeepSpeed under the simulated device: its communication as on a GPU.

What oomguard does with the user's DeepSpeed config (observing its stage and offload, generating the ZeRO rungs'
config from it) is ``child/dsconfig.py``'s, and starting DeepSpeed's communication for ZeRO-3 on CPU ranks is
``child/load.py``'s; this adapter holds what only a rehearsal needs.

- **No shared-memory all-reduce is built** (:func:`comm_like_a_gpu`): on a CPU, DeepSpeed's torch backend compiles
  its shared-memory all-reduce (``deepspeed_shm_comm``, a C++ extension built with ninja) when its communication
  starts, 40 s to over two minutes on two cores the first time on a machine. The op serves
  ``inference_all_reduce`` only (tensor-parallel inference), which falls back to torch's all-reduce without it, and
  DeepSpeed on a GPU never builds it: under the simulated device the rehearsal skips it, as the GPU run will.
"""

from __future__ import annotations

from typing import Any

from ..runtime import Runtime

# the modules whose import loads this adapter's patches (the bootstrap reads these tables), and those under the
# simulated device only
TRIGGERS: dict[str, str] = {}
SIMULATED_TRIGGERS = {"deepspeed.comm.torch": "comm_like_a_gpu"}
SIMULATED_ENVIRONMENT: dict[str, str] = {}


def comm_like_a_gpu(rt: Runtime, module: Any) -> None:
    """Under the simulated device: DeepSpeed's torch backend starts without building its CPU shared-memory
    all-reduce (``build_shm_op`` answers None, as it does on a GPU); see the module's docstring."""
    from .. import simulate

    if simulate.device() is None or not hasattr(module, "build_shm_op"):
        return
    from ..patching import set_attr

    set_attr(module, "build_shm_op", lambda: None)
