"""Presentation: what people read. Plain lines and rich tables on the terminal, and self-contained HTML reports.

- ``ui``: what the supervisor tells the user while it works (lines, progress, the final message).
- ``render``: rich tables for the terminal.
- ``html``: the HTML reports of `oomguard run --html` and `oomguard analyze --html`.

May import: the shared vocabulary and the decision's types (``oomguard.decide``). Never the supervisor, the guard
or the training-process side.
"""
