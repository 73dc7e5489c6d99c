"""The in-process guard, ``@oomguard.guard``: a custom training function retried in its own process.

- ``guarded``: the decorator and its retry loop, which drives the same climb as `oomguard run`.
- ``attempt``: one call, its OOM as plain data.
- ``tracked``: the knobs a function reads.
- ``release``: memory given back after a failed attempt.
- ``allocapply``: allocator settings brought to the live allocator.
- ``isolate``: ``isolate=True``, one spawned process per attempt.

No module here is named ``guard``: importing a submodule binds it to its package's attribute, and
``oomguard.guard`` is the function.

May import: the shared vocabulary (``oomguard.vocab``), the memory model, reading OOMs, the decision and the
training-process side (``oomguard.child``: the simulated device and the patches run in this process too). Never the
supervisor or presentation.
"""
