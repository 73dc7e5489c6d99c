"""The examples as users meet them: no deprecation warnings, nothing left in the checkout, the commands the docs show."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import warnings

from helpers import ROOT

EXAMPLES = ROOT / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_example_passes_the_deprecated_checkpointing_argument():
    for path in EXAMPLES.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                assert "gradient_checkpointing" not in {k.arg for k in node.keywords}, path.name


def test_the_seed_config_builds_without_future_warnings():
    from trl import GRPOConfig

    gsm8k = _example("grpo_gsm8k")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(**gsm8k.config_kwargs(gsm8k.parse_args([]), cuda=False, bf16=False))
        gsm8k.quiet_trl_deprecations()  # TRL 1.16's own calls of the deprecated model methods are hidden
        for name in ("is_gradient_checkpointing", "gradient_checkpointing_disable", "gradient_checkpointing_enable"):
            warnings.warn(f"`{name}` is deprecated and will be removed in v6. Use `x` instead.", FutureWarning,
                          stacklevel=1)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []


def test_examples_write_under_ignored_places():
    gsm8k = _example("grpo_gsm8k")
    out = gsm8k.config_kwargs(gsm8k.parse_args([]), cuda=False, bf16=False)["output_dir"]
    assert out.startswith(str(EXAMPLES / ".cache"))
    assert _example("custom_loop").train.report_path.parent == EXAMPLES / ".cache"
    for path in ("outputs/grpo-gsm8k/checkpoint-2/model.safetensors", "examples/.cache/outputs/x",
                 "examples/.cache/custom-loop-report.json", "custom-loop-report.json", "oomguard-report.json",
                 ".oomguard/runs/1/report.json"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert ignored.returncode == 0, path


def test_the_guard_page_runs_the_guard_examples():
    readme = (ROOT / "docs" / "how-to" / "guard.md").read_text()
    for script in ("examples/custom_loop.py", "examples/notebook_grpo.py"):
        assert re.search(rf"^python {re.escape(script)}\s*(#.*)?$", readme, re.M), script
