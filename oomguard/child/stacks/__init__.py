"""The stacks GRPO users run around TRL, one adapter module each: what oomguard patches in the training process
for that stack, and the facts it reports about it (the supervisor and the memory model ask for nothing else).

Each adapter declares, beside its patches, the modules whose import loads them (``TRIGGERS``: module -> function;
``SIMULATED_TRIGGERS`` under the simulated device only) and the environment it needs under the simulated device
(``SIMULATED_ENVIRONMENT``); ``child/bootstrap.py`` reads these tables for every adapter in :data:`ADAPTERS`, and a
patch runs only when its stack's own module is imported. How each stack spells oomguard's knobs in its arguments
is its table in ``vocab/stacks/`` (the supervisor prints the diff and the lock from it, the adapter sets and reads
through it).

``vllm``: vLLM beside the trainer (TRL's colocate mode). ``swift``: ms-swift's ``swift rlhf``. ``unsloth``: an
Unsloth notebook's loader and LoRA. ``deepspeed``: DeepSpeed's communication under the simulated device (its config is
``child/dsconfig.py``'s).
"""

ADAPTERS = ("vllm", "paged", "swift", "unsloth", "deepspeed")
