"""The supervised run, `oomguard run`: launch the training command, classify how it ended, decide, relaunch.

- ``supervisor``: the loop (launch, classify, decide, stop), which reads top to bottom.
- ``command``: command forms, lock files, usage errors, exit codes.
- ``proc``: process groups, streaming, signals.
- ``classify``: how an attempt ended, decided once for the job from the training processes' own records.
- ``resume``: continuing from a checkpoint.
- ``minimize``: undo trials (--minimize, and the doubtful changes of a default run).
- ``verdict``: the status, exit code and message of a run.
- ``hostmem``: evidence of the kernel's OOM killer.

Never imports torch, directly or through anything it imports: the supervisor reads device facts through NVML.

May import: the shared vocabulary (``oomguard.vocab``), the memory model, reading OOMs (``oomguard.oom``), the
decision (``oomguard.decide``) and presentation (``oomguard.display``). Never the guard or the training-process side
(the contract with it is ``oomguard.vocab.protocol``).
"""
