"""Deciding what to change: the climb and everything it consults. Shared by `oomguard run` and `@oomguard.guard`.

- ``ladder``: a ladder (the TOML files in ``oomguard/strategies/``) and its next rung for a diagnosis.
- ``climb``: the climb's state and API; the only place that chooses the next knobs.
- ``choose``: the best config below the climbed rungs (drop what later rungs made unnecessary).
- ``plan``: the memory model applied to a config (`oomguard plan`), and the Judge that judges configs in a climb.
- ``alternatives``: configs that keep more of the user's GRPO semantics than the one chosen.

May import: the shared vocabulary (``oomguard.vocab``, ``oomguard.strategies``) and the memory model
(``oomguard.memory``). Never the supervisor, the guard or presentation.
"""
