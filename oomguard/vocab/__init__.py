"""The shared vocabulary: the names every part of oomguard speaks (DESIGN.md, "Vocabulary").

- ``knobtable``: every knob declared once (type, TRL's default, construction point, values, meaning); ``knobs``:
  Knobs (every value oomguard may change), TRL's defaults, the diff; ``facts``: RunFacts.
- ``events``: the training process's typed events; ``records``: attempts, run reports, crash records; ``lock``: the
  lock; ``serial``: records as JSON and back, over their fields; ``files``: atomic writes, reports and locks
  published without losing an earlier one.
- ``oomreport``: OOMReport and Frame, what one OOM message says (``oomguard.oom.parse`` reads them from text).
- ``diagnosis``: Diagnosis, what an OOM means (``oomguard.oom.diagnose`` makes one).
- ``protocol``: the contract between the supervisor and the training process (the plan and its typed parts, its
  variables, the exit codes, how a process ends), so that neither side imports the other.
- ``stacks``: how each stack around TRL spells the knobs (ms-swift's flags, an Unsloth notebook's calls), read both
  ways; ``launchers``: the launchers a command may name.
- ``allocconf``: the allocator variables torch reads, and how an option is merged into them.
- ``distributed``: DeepSpeed and FSDP settings.
- ``sizes``: byte sizes, parsed and printed; ``trlrange``: the supported TRL releases.

May import: nothing of oomguard outside this package. Every other part imports it.
"""
