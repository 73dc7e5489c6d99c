"""Reading OOMs: recognise one in text, an exception or a memory snapshot, work out why it happened, and what to do.

- ``parse``: recognise and parse OOM messages (every backend's wording) into an OOMReport.
- ``diagnose``: the kind of OOM from the figures, the phase from the traceback, the evidence.
- ``snapshot``: PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``), read without torch.
- ``recommend``: the remedies that address a diagnosis, ranked.
- ``analyze``: `oomguard analyze`, explaining OOMs after the fact from logs, records and snapshots.

The supervisor, the guard and the training process read their live OOMs through ``parse`` and ``diagnose`` too.

May import: the shared vocabulary (``oomguard.vocab``, and the remedies of ``oomguard.strategies`` for
``recommend``). Never the memory model, the decision, the supervisor, the guard or presentation.
"""
