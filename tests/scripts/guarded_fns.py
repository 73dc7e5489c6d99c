"""Functions for the guard(isolate=True) test: they must live in an importable module to reach a spawned process."""

import torch

import oomguard


@oomguard.guard(isolate=True, simulate_gpu="48MiB", knobs={"per_device_train_batch_size": 16})
def isolated_train(knobs, width: int = 1024):
    x = torch.randn(knobs.per_device_train_batch_size, width, 1024)  # 2 MiB per sample row
    return float(x.mean()) * 0 + knobs.per_device_train_batch_size
