"""The shared vocabulary: the names every part of oomguard speaks (DESIGN.md, "Vocabulary").

- ``knobs``: Knobs (every value oomguard may change), RunFacts, TRL's defaults, the diff.
- ``records``: attempts, run reports, crash records, the lock, the training process's typed events; JSON files.
- ``oomreport``: OOMReport and Frame, what one OOM message says (``oomguard.oom.parse`` reads them from text).
- ``diagnosis``: Diagnosis, what an OOM means (``oomguard.oom.diagnose`` makes one).
- ``protocol``: the contract between the supervisor and the training process (the plan, its variables, the exit
  codes, how a process ends), so that neither side imports the other.
- ``allocconf``: the allocator variables torch reads, and how an option is merged into them.
- ``distributed``: DeepSpeed and FSDP settings.
- ``sizes``: byte sizes, parsed and printed.

May import: nothing of oomguard outside this package. Every other part imports it.
"""
