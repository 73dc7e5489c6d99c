"""The GPU scripts' parts that need no GPU: bench/gpu_quickstart.py (issue 11's 24 GiB Qwen2.5-3B quickstart under
`oomguard run --gpu-memory`) and bench/gpu_guard.py (guard on a real CUDA OOM).

The client script must stay TRL's quickstart shape (a user's first script: defaults everywhere), the table must read
the real H100 reports right, and without CUDA both scripts must stop at once with one line. gpu_guard's whole flow
runs here on oomguard's simulated device."""

from __future__ import annotations

import ast
import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "h100"
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

import gpu_guard as gg  # noqa: E402
import gpu_quickstart as qs  # noqa: E402

GiB = 1024**3


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _report(name: str) -> dict:
    return json.loads((FIXTURES / f"report-qwen3b-quickstart-24GiB-{name}.json").read_text())


def test_doctests():
    assert doctest.testmod(qs).failed == 0
    assert doctest.testmod(gg).failed == 0


# ---------------------------------------------------------------------------------------------------------------
# The client script


def test_client_is_trls_quickstart_shape_with_defaults_everywhere_else():
    src = qs.client_source("/work/models/q3b", "/work/trainer-output")
    compile(src, "client.py", "exec")
    trainer = qs.call_keywords(src, "GRPOTrainer")
    assert sorted(trainer) == sorted(qs.TRAINER_KWARGS)
    # the model is given by name (a path string), so TRL loads it itself, in float32
    assert isinstance(trainer["model"], ast.Name) and trainer["model"].id == "MODEL"
    consts = {t.id: n.value.value for n in ast.parse(src).body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    assert consts["MODEL"] == "/work/models/q3b" and consts["OUTPUT_DIR"] == "/work/trainer-output"
    config = qs.call_keywords(src, "GRPOConfig")
    assert sorted(config) == sorted(qs.CONFIG_KWARGS)  # no batch, generations, length, dtype or checkpointing
    values = {k: ast.literal_eval(v) for k, v in config.items() if k != "output_dir"}
    assert values == {"max_steps": 3, "logging_steps": 1, "report_to": [], "save_strategy": "no"}
    assert "model_init_kwargs" not in src and "peft_config" not in src and "torch_dtype" not in src


def test_client_prompts_are_64_rows_of_100_to_200_tokens_the_tokenizer_knows():
    src = qs.client_source("/m", "/o")
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "make_prompts")
    ns: dict = {"VOCAB_SIZE": qs.VOCAB, "random": __import__("random")}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "client", "exec"), ns)
    prompts = ns["make_prompts"]()
    assert len(prompts) == 64
    lengths = [len(p.split()) for p in prompts]  # the word-level tokenizer: one word, one token
    assert min(lengths) >= 100 and max(lengths) <= 200 and max(lengths) - min(lengths) > 50
    ids = {int(w[1:]) for p in prompts for w in p.split()}
    assert min(ids) >= 3 and max(ids) < qs.VOCAB  # w0..w2 are <pad>, <unk>, <eos>
    assert ns["make_prompts"]() == prompts  # the same prompts in every launch


def test_client_passes_the_word_level_tokenizer_not_qwen2s():
    # transformers 5 maps model_type qwen2 to Qwen2Tokenizer, which makes every word-level prompt empty
    trainer = qs.call_keywords(qs.client_source("/m", "/o"), "GRPOTrainer")
    pc = trainer["processing_class"]
    assert isinstance(pc, ast.Call) and ast.unparse(pc.func) == "PreTrainedTokenizerFast.from_pretrained"


# ---------------------------------------------------------------------------------------------------------------
# The table, from the real H100 reports


def test_table_of_the_real_default_quickstart_report():
    row = qs.summarise_run(_report("default"), 24 * GiB)
    assert (row["status"], row["launches"], row["ooms"], row["predicted"]) == ("stable", 3, 1, 0)
    assert row["wall"] == 208.0  # 12:23:19 .. 12:26:47
    assert row["diff"].startswith("ES=on, split_mb=768") and "C=256, G=4, bs=4" in row["diff"]
    assert "lora_r=16" in row["diff"] and "lora_alpha" not in row["diff"]
    assert row["peak_bytes"] == 13286345216 and row["peak_kind"] == "run" and row["peak_fraction"] == 0.516
    assert row["kept"] == "no: C 512→256, G 8→4"
    # six remedies, and no attempt ran the stable config without one of them: nothing proves them needed
    assert row["minimal"].startswith("? 6 of 6 unproven") and "minimal ?" in row["misses"]
    table = qs.format_table([row], 24 * GiB)
    line = table.splitlines()[2]
    assert "| 3 | 1 | 0 | 208 s |" in line and "12.37 GiB, 52%" in line and "no: C 512→256, G 8→4" in line


def test_minimize_report_proves_lora_needed_by_the_first_attempts_oom():
    rep = _report("minimize")
    checks = qs.minimal_from_attempts(rep)
    assert checks == [{"remedy": "lora", "knobs": ["lora_r", "lora_alpha", "lora_target_modules"], "result": "oom",
                       "attempt": 1}]
    row = qs.summarise_run(rep, 24 * GiB, strategy="minimize")
    assert row["minimal"] == "yes" and row["kept"] == "yes (C=512, G=8)"
    # the real run was cut off: the peak of the final config comes from the minimize trial that measured it
    assert row["peak_kind"] == "minimize" and row["peak_bytes"] == 14828292096
    assert "not stable" in row["misses"] and "launches 9>3" in row["misses"]


def test_a_remedy_an_attempt_ran_without_and_fit_is_needless():
    rep = {"status": "stable", "original": {"C": 512, "optim": "adamw", "lora_r": 0},
           "stable": {"C": 512, "optim": "8bit", "lora_r": 16},
           "diff": [{"knob": "optim", "from": "adamw", "to": "8bit", "remedy": "optimizer_8bit"},
                    {"knob": "lora_r", "from": 0, "to": 16, "remedy": "lora"}],
           "attempts": [{"index": 1, "outcome": "oom", "knobs": {"C": 512, "optim": "adamw", "lora_r": 0}},
                        {"index": 2, "outcome": "ok", "knobs": {"C": 512, "optim": "adamw", "lora_r": 16}},
                        {"index": 3, "outcome": "ok", "knobs": {"C": 512, "optim": "8bit", "lora_r": 16}}]}
    row = qs.summarise_run(rep, 24 * GiB)
    assert row["minimal"] == "no: optimizer_8bit needless"
    # a --check-minimal probe fills in what the run left unproven
    checks = [{"remedy": "lora", "knobs": ["lora_r"], "result": "oom", "attempt": None}]
    rep["attempts"] = rep["attempts"][2:]
    assert qs.summarise_run(rep, 24 * GiB)["minimal"].startswith("? 2 of 2")
    assert qs.summarise_run(rep, 24 * GiB, checks=checks)["minimal"].startswith("? 1 of 2 unproven: optimizer_8bit")


def test_from_report_prints_the_table_without_a_gpu():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_quickstart.py"), "--from-report",
                          str(FIXTURES / "report-qwen3b-quickstart-24GiB-quality-first.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| stable | 3 | 1 | 0 | 290 s |" in out.stdout and "19.13 GiB, 80%" in out.stdout
    assert "yes (C=512, G=8)" in out.stdout


def test_the_oomguard_command_caps_the_gpu_and_reports_into_out(tmp_path):
    cmd = qs.oomguard_command("default", tmp_path / "client.py", tmp_path / "out", tmp_path / "w", "24GiB",
                              max_time=300)
    sep = cmd.index("--")
    assert cmd[1:4] == ["-m", "oomguard", "run"] and cmd[sep + 1:] == [sys.executable, str(tmp_path / "client.py")]
    head = cmd[:sep]
    assert head[head.index("--gpu-memory") + 1] == "24GiB" and head[head.index("--max-time") + 1] == "300"
    assert head[head.index("--report") + 1] == str(tmp_path / "out" / "quickstart-default.json")
    assert "--minimize" not in head and "--minimize" in qs.oomguard_command("minimize", tmp_path, tmp_path, tmp_path,
                                                                           "24GiB")


def test_a_run_past_its_time_is_interrupted_and_its_output_kept(tmp_path):
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, lambda *a: (print('oomguard: interrupted, report written', flush=True), "
            "sys.exit(130)))\n"
            "print('oomguard probe 1/8', flush=True)\n"
            "print('training line', flush=True)\n"
            "time.sleep(60)\n")
    log = tmp_path / "run.log"
    rc, wall, cut = qs.run_logged([sys.executable, "-c", code], {}, log, timeout=3)
    assert cut and rc == 130 and wall < 30
    assert log.read_text().splitlines() == ["oomguard probe 1/8", "training line", "oomguard: interrupted, report written"]


# ---------------------------------------------------------------------------------------------------------------
# Without CUDA: one line, at once


@pytest.mark.skipif(_has_cuda(), reason="this machine has a GPU")
@pytest.mark.parametrize("script", ["gpu_quickstart.py", "gpu_guard.py"])
def test_without_cuda_each_script_stops_with_one_line(tmp_path, script):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  warnings.warn")]
    assert len(lines) == 1 and "no CUDA device is available" in lines[0] and "Traceback" not in out.stderr
    assert lines[0].startswith(script.removesuffix(".py") + ": ")
    assert not (tmp_path / "out").exists()  # nothing written, nothing built


# ---------------------------------------------------------------------------------------------------------------
# gpu_guard: the table, and the whole flow on the simulated device


def test_guard_rows_show_release_and_diagnosis():
    rep = {"attempts": [
        {"index": 1, "outcome": "oom", "seconds": 2.0, "peak_bytes": 4 * GiB, "climbed": "micro_batch",
         "knobs": {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 1, "max_completion_length": 1024},
         "memory": {"live_before": 0, "live_after_release": 65 * 2**20},
         "oom": {"kind": "shortfall", "phase": "backward", "requested_bytes": 256 * 2**20}},
        {"index": 2, "outcome": "ok", "seconds": 1.0, "peak_bytes": 3 * GiB,
         "knobs": {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "max_completion_length": 1024}}]}
    entry = [{"allocated": 0, "reserved": 0}, {"allocated": 65 * 2**20, "reserved": 66 * 2**20}]
    rows = gg.attempt_rows(rep, entry)
    assert rows[0]["after_release"] == "65.0 MiB" and rows[1]["entry"] == "65.0 MiB / 66.0 MiB"
    assert rows[0]["oom"] == "shortfall in backward, 256.0 MiB requested; climbed micro_batch"
    table = gg.format_attempts(rows)
    assert "| 2 | ok | 16 x 2 | 1024 |" in table


def test_the_default_shape_overflows_a_4gib_cap_and_half_the_batch_fits():
    cap = 4 * GiB
    assert gg.need_bytes(512, 8, 32, 1024) > 1.25 * cap
    assert gg.need_bytes(512, 8, 16, 1024) < 0.7 * cap


def test_guard_script_recovers_from_an_oom_on_the_simulated_device(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_guard.py"), "--out", str(tmp_path),
                          "--simulate-gpu", "80MiB", "--dim", "128", "--depth", "4", "--batch", "16", "--seq", "256"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "guard-report.json").read_text())
    assert [a["outcome"] for a in report["attempts"]] == ["oom", "ok"]
    first = report["attempts"][0]
    assert first["memory"]["live_after_release"] == 0 and first["climbed"] == "micro_batch"
    assert {r["knob"]: r["to"] for r in report["diff"]} == {"per_device_train_batch_size": 8,
                                                            "gradient_accumulation_steps": 2}
    summary = json.loads((tmp_path / "guard-summary.json").read_text())
    assert summary["status"] == "stable" and summary["rows"][0]["after_release"] == "0.0 MiB"
    assert "| 1 | oom | 16 x 1 | 256 |" in out.stdout and "per_device_train_batch_size: 16 -> 8" in out.stdout


def test_quickstart_main_runs_oomguard_and_writes_report_log_and_summary(tmp_path, monkeypatch, capsys):
    """The orchestration end to end, on CPU: a faked GPU probe, a model dir that --skip-build accepts, and a client
    that only prints (the real one needs CUDA: GRPOConfig's bf16 default)."""
    import gpu_calibrate

    monkeypatch.setattr(gpu_calibrate, "child", lambda args, timeout, env=None: (
        {"cuda": True, "name": "FakeGPU", "total": 80 * GiB, "triton": True, "torch": "x"}, ""))
    monkeypatch.setattr(qs, "client_source", lambda model, output_dir: f"print('trained {model}')\n")
    work = tmp_path / "work"
    (work / "q3b").mkdir(parents=True)
    (work / "q3b" / "config.json").write_text("{}")
    rc = qs.main(["--out", str(tmp_path / "out"), "--workdir", str(work), "--skip-build", "--timeout", "120"])
    shown = capsys.readouterr().out
    assert rc == 0, shown
    out = tmp_path / "out"
    report = json.loads((out / "quickstart-default.json").read_text())
    assert report["status"] == "stable" and report["device"]["gpu_memory"] == 24 * GiB
    assert f"trained {work / 'q3b'}" in (out / "quickstart-default.log").read_text()
    summary = json.loads((out / "quickstart-summary.json").read_text())
    assert summary["rows"][0]["launches"] == 1 and summary["rows"][0]["diff"] == ""
    assert "| default | stable | 1 | 0 | 0 |" in shown
    assert (work / "default" / "oomguard.lock.json").exists()
