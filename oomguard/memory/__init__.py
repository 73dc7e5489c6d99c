"""The memory model: what a configuration will take on a device, before anything runs. Pure Python, no torch.

- ``estimate``: the analytical model of one GRPO step, phase by phase.
- ``allocmodel``: the CUDA caching allocator's rules (block sizes, splitting, expandable segments), sizes only.
- ``calibration``: what completed runs on this machine taught the model.
- ``device``: device facts through NVML, never through torch.

May import: the shared vocabulary (``oomguard.vocab``). Never the supervisor, the guard, presentation or the
training-process side.
"""
