"""Reward functions that keep memory on purpose, for the late-OOM tests (issue 42): each call keeps ``LEAK_MIB`` MiB of
tensors in a module-level list (``CACHE``), as a reward function that logs its tensors into a list does, or grows a
host-memory cache (``HOST_CACHE``) by ``HOST_LEAK_MIB`` MiB of bytes."""

from __future__ import annotations

import os

CACHE: list = []
HOST_CACHE: list = []
LEAK_MIB = float(os.environ.get("LEAK_MIB", "6"))
HOST_LEAK_MIB = float(os.environ.get("HOST_LEAK_MIB", "0"))


def leaky_reward(completions, **kw):
    import torch

    CACHE.append(torch.ones(int(LEAK_MIB * (1 << 20)) // 4))  # float32: LEAK_MIB MiB kept a call
    return [0.0 for _ in completions]


def host_leaky_reward(completions, **kw):
    HOST_CACHE.append(bytearray(os.urandom(16)) * int(HOST_LEAK_MIB * (1 << 16)))  # HOST_LEAK_MIB MiB kept a call
    return [0.0 for _ in completions]
