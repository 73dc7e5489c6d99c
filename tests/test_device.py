"""The device oomguard judges is the one the training process sees: by index in CUDA's order, by UUID, a MIG slice;
and bf16 is assumed only where the card has it."""

from __future__ import annotations

import pytest

from oomguard.memory import device
from oomguard.memory.device import FakeNVML
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts

GiB = 2**30
NODE = FakeNVML([("Tesla T4", 16 * GiB, (7, 5), "GPU-11aa", []),
                 ("NVIDIA A100-SXM4-80GB", 80 * GiB, (8, 0), "GPU-22bb", ["MIG-5c", "MIG-6d"]),
                 ("NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0), "GPU-33cc", [])])


@pytest.fixture
def node(monkeypatch):
    monkeypatch.setattr(device, "_nvml", lambda: NODE)
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("visible, order, name, total", [
    (None, None, "NVIDIA H100 80GB HBM3", 80 * GiB),        # CUDA's default order: the fastest card first
    (None, "PCI_BUS_ID", "Tesla T4", 16 * GiB),               # NVML's own (PCI bus) order
    ("0", "PCI_BUS_ID", "Tesla T4", 16 * GiB),
    ("2", None, "Tesla T4", 16 * GiB),                        # the third fastest
    ("GPU-11aa", None, "Tesla T4", 16 * GiB),
    ("GPU-33", None, "NVIDIA H100 80GB HBM3", 80 * GiB),      # a unique prefix, as CUDA accepts
    ("MIG-6d", None, "NVIDIA A100-SXM4-80GB", 10 * GiB),      # a slice: its own size, not its card's
    ("1", "PCI_BUS_ID", "NVIDIA A100-SXM4-80GB", 10 * GiB),   # a card in MIG mode shows CUDA its first slice
])
def test_the_size_is_the_visible_devices(node, visible, order, name, total):
    if visible is not None:
        node.setenv("CUDA_VISIBLE_DEVICES", visible)
    if order is not None:
        node.setenv("CUDA_DEVICE_ORDER", order)
    assert device.gpu_total_memory() == total
    assert device.gpu_name() == name


def test_a_uuid_nvml_does_not_know_is_a_warning_not_another_cards_size(node, capsys):
    node.setattr(device, "_warned", False)
    node.setenv("CUDA_VISIBLE_DEVICES", "GPU-99zz")
    assert device.gpu_total_memory() is None
    assert "names no device NVML has" in capsys.readouterr().err


@pytest.mark.parametrize("visible, bf16", [("GPU-11aa", False), ("GPU-33cc", True), ("MIG-5c", True)])
def test_bf16_only_where_the_card_has_it(node, visible, bf16):
    node.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert device.gpu_bf16() is bf16


def test_a_card_without_bf16_gets_no_bf16_weights_and_computes_qlora_in_float16():
    t4 = RunFacts(bf16_supported=False)
    knobs = TRL_DEFAULTS.replace(learning_rate=1e-3)  # a rate at which bf16 weights would still learn
    assert "no bfloat16" in make_remedy("bf16_load").blocked(Context(knobs=knobs, facts=t4))
    assert make_remedy("load_4bit").apply(Context(knobs=knobs, facts=t4)).dtype == "float16"
    assert make_remedy("load_4bit").apply(Context(knobs=knobs, facts=RunFacts())).dtype == "bfloat16"
