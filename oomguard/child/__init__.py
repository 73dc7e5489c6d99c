"""The training-process side: what runs inside the user's training command, in every Python process of a run.

- ``_boot/sitecustomize.py``: `oomguard run` puts ``_boot`` first on PYTHONPATH; with OOMGUARD_PLAN set it starts
  the bootstrap, and it runs the sitecustomize it shadows.
- ``bootstrap``: reads the plan, installs the post-import hooks (``hooks``), writes the crash record on an OOM.
- ``patches``: applies the knobs at TRL's construction points (GRPOConfig, GRPOTrainer, from_pretrained) and records
  what the script set.
- ``runtime``: the process's plan, knobs, events to the supervisor and crash records.
- ``callback``: the TrainerCallback for progress, peak memory and checkpoints.
- ``preflight``: stops a config that cannot fit before it loads where it can.
- ``capped``: ``--gpu-memory`` on a real GPU (the allocator's cap minus the context).
- ``simulate``: the simulated device (counts tensors, places them with ``oomguard.memory.allocmodel``, raises
  CUDA's OOM).

The only part that imports torch and the training stack, always inside functions: importing this package is cheap.

May import: the shared vocabulary (``oomguard.vocab``, the contract in ``oomguard.vocab.protocol``), the memory model
and reading OOMs (``oomguard.oom``). Never the supervisor: the two sides meet in the plan, the events and the crash
records.
"""
