"""What the per-step memory trace costs the training process, against a step of the tiny model (target: <= 2%).

In one process on the simulated device: the tests' tiny Llama shape (4 layers, hidden 256), a GRPO-like step (generate
32 tokens for 4 prompts, a forward and backward over prompt and completion, AdamW), and around each step the memory
watch oomguard's callback runs (``MemWatch.step_begin`` and ``step_end``: the sample, and the trend every 4 steps).
The step's own time is measured apart from the watch's, and the table gives medians over the steps after a warm-up.
It also times, once, what the watch pays only when it finds a leak (a census: two tallies), and the trend on a long
run (4096 samples of a leak, the worst case: the growth tests run in full).

    python bench/trace_cost.py [--steps 24] [--warmup 3]

On CUDA the sample reads the allocator's counters (``torch.cuda.memory_stats``, host-side bookkeeping: no kernel, no
synchronisation) instead of the simulated device's Python integers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    from oomguard.child import simulate
    from oomguard.child.census import Census
    from oomguard.child.memwatch import MemWatch
    from oomguard.oom.trend import assess
    from oomguard.vocab.trace import MemSample

    logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    simulate.start(4 << 30)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=4, intermediate_size=1024, vocab_size=1024,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    prompts = torch.randint(1, 1024, (4, 14))
    watch = MemWatch()

    def step() -> None:
        model.eval()
        with torch.no_grad():
            seq = model.generate(prompts, max_new_tokens=32, min_new_tokens=32, do_sample=True)
        model.train()
        logits = model(seq).logits[:, 13:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, seq[:, 14:, None]).squeeze(-1)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad()

    steps, traces = [], []
    for i in range(1, a.steps + 1):
        t0 = time.perf_counter()
        watch.step_begin()
        t1 = time.perf_counter()
        step()
        t2 = time.perf_counter()
        watch.step_end(i)
        t3 = time.perf_counter()
        if i > a.warmup:
            steps.append(t2 - t1)
            traces.append((t1 - t0) + (t3 - t2))
    step_s, trace_s = statistics.median(steps), statistics.median(traces)
    sample_s = min(_timed(lambda: watch.tracer.sample(0), 200))

    census = Census()
    census.start()
    t = time.perf_counter()
    census.take(1)
    step()
    census.take(2)
    census_s = time.perf_counter() - t
    census.stop()

    MiB = 1 << 20
    leak = [MemSample(s, kept=64 * MiB + 6 * MiB * s, peak=96 * MiB + 6 * MiB * s, reserved=128 * MiB + 7 * MiB * s,
                      host_rss=(2 << 30) + 16 * MiB * s) for s in range(1, 4097)]
    assess_s = min(_timed(lambda: assess(leak, capacity=80 << 30, host_limit=64 << 30), 3))

    print(f"{'what':<52} {'time':>10} {'of a step':>10}")
    print(f"{'a step of the tiny model (generate 4x32, train)':<52} {step_s * 1e3:>8.1f}ms {'':>10}")
    print(f"{'the watch per step (sample; trend every 4 steps)':<52} {trace_s * 1e6:>8.0f}us {trace_s / step_s:>9.3%}"
          f"   target <= 2%")
    print(f"{'  of which one sample':<52} {sample_s * 1e6:>8.0f}us {sample_s / step_s:>9.3%}")
    print(f"{'the trend on 4096 leaking samples (every 4 steps)':<52} {assess_s * 1e3:>8.1f}ms "
          f"{assess_s / 4 / step_s:>9.3%}   amortised")
    print(f"{'a census (two tallies, once per leak)':<52} {census_s * 1e3:>8.1f}ms {'':>10}   includes one step")
    simulate.stop()


def _timed(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


if __name__ == "__main__":
    main()
