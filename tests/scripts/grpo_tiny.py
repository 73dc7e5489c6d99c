"""A small, fast GRPO training script for oomguard's end-to-end tests (real TRL, CPU, a local random model).

Every memory-relevant choice is a flag, so a test can start from a config where earlier rungs of the ladder are
already in force or at their floors. Flags a test needs beyond GRPO itself:

  --fail-with CODE    exit with CODE before training (non-OOM failure passthrough)
  --sleep SECONDS     sleep inside a training step (interrupt tests), spawning a grandchild that sleeps too
  --oom-at-step N     raise a real-looking CUDA OOM from a callback at step N (late-OOM tests); with
                      --oom-marker PATH only once, with --oom-rank R only on rank R
  --kill-self-at-step N  SIGKILL itself at step N; with --oom-kill-counter PATH after counting it in a cgroup's
                      memory.events, as the kernel's OOM killer would
  --leak-mib N        add a reward function that keeps N MiB of tensors a step in a module-level list
  --fixed-mib N       allocate a tensor of N MiB at the start of every generation (freed at its end), whatever the
                      config: an allocation no term of the memory model counts, as a framework's own cache
  --host-leak-mib N   add a reward function that grows a host-memory cache by N MiB a step
                      (tests/scripts/leaky_rewards.py), as a reward function that logs into a list does
  --mem-trace PATH    (without oomguard run) write the training process's memory watch events (oomguard/child/
                      memwatch.py) to PATH, on a simulated device of --simulate-mib MiB

OOMGUARD_TEST_ENDING (tests/scripts/endings.py) adds a reward function that ends the process as asked, the same way
under every launcher.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def deepspeed_config(arg: str | None) -> dict | str | None:
    """``--deepspeed 2`` -> a ZeRO-2 config whose batch sizes and buffer sizes transformers fills ("auto");
    ``--deepspeed stage2`` -> the stage alone with "auto" batch sizes, as users write it (DeepSpeed's own defaults for
    its buffers); a path as it is."""
    if arg is not None and arg.startswith("stage") and arg[5:].isdigit():
        return {"zero_optimization": {"stage": int(arg[5:])}, "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    if arg is None or not arg.isdigit():
        return arg
    zero = {"stage": int(arg), "reduce_bucket_size": "auto"}
    if int(arg) == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


def fixed_at_generation(torch, mib: float) -> None:
    """Every ``generate`` first allocates ``mib`` MiB (kept until it returns), whatever the batch: a fixed allocation."""
    from transformers import GenerationMixin

    generate = GenerationMixin.generate

    def with_buffer(self, *args, **kwargs):
        buffer = torch.empty(int(mib * 2**20), dtype=torch.uint8)
        try:
            return generate(self, *args, **kwargs)
        finally:
            del buffer

    GenerationMixin.generate = with_buffer


def mem_trace_callback(path: str, model, base):
    """A callback that sends the memory watch's events to a file, as oomguard's own callback would to its events."""
    import json

    from oomguard.child import simulate
    from oomguard.child.memwatch import MemWatch

    if not isinstance(model, str):
        simulate.device().adopt(model.parameters())
    watch = MemWatch(check_every=1)

    class Trace(base):
        def on_step_begin(self, args, state, control, **kw):
            watch.step_begin()

        def on_step_end(self, args, state, control, **kw):
            with open(path, "a", encoding="utf-8") as f:
                for ev in watch.step_end(state.global_step, kw.get("trainer") or TRAINER[0]):
                    f.write(json.dumps(ev.to_json()) + "\n")

    return Trace()


TRAINER: list = [None]  # the trainer, for the trace's lengths (callbacks are not handed the trainer)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--per-device-train-batch-size", type=int, default=4)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model-as-string", action="store_true", help="pass the model path to GRPOTrainer")
    p.add_argument("--lora-r", type=int, default=0, help="the script's own LoRA (peft_config)")
    p.add_argument("--prompt-words", type=int, default=8)
    p.add_argument("--long-prompts", type=int, default=0, help="this many extra prompts 8x longer")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--long-at-step", type=int, default=None,
                   help="one prompt 8x longer, met at this step (the dataset in order: one prompt per step)")
    p.add_argument("--trl-precision", action="store_true",
                   help="keep TRL's bf16=True default (bf16 autocast, on the CPU too) instead of bf16=False")
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (eval_strategy='steps')")
    p.add_argument("--per-device-eval-batch-size", type=int, default=None)
    p.add_argument("--num-generations-eval", type=int, default=None)
    p.add_argument("--eval-rows", type=int, default=16, help="prompts in the evaluation dataset")
    p.add_argument("--fail-with", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--oom-at-step", type=int, default=None)
    p.add_argument("--oom-rank", type=int, default=None, help="only this rank raises the injected OOM")
    p.add_argument("--oom-marker", default=None, help="raise the injected OOM only once: skip if this file exists")
    p.add_argument("--kill-self-at-step", type=int, default=None,
                   help="SIGKILL this process at step N, as the kernel's OOM killer would (once, with --oom-marker)")
    p.add_argument("--oom-kill-counter", default=None,
                   help="with --kill-self-at-step: first count the kill in this cgroup memory.events file, as the "
                        "kernel's OOM killer does")
    p.add_argument("--leak-mib", type=float, default=0.0)
    p.add_argument("--fixed-mib", type=float, default=0.0)
    p.add_argument("--host-leak-mib", type=float, default=0.0)
    p.add_argument("--mem-trace", default=None)
    p.add_argument("--simulate-mib", type=int, default=512)
    p.add_argument("--dataloader-num-workers", type=int, default=0)
    p.add_argument("--deepspeed", default=None, metavar="STAGE|stageN|PATH",
                   help="a ZeRO stage (a DeepSpeed config with 'auto' batch and buffer sizes), stageN (the stage "
                        "alone, DeepSpeed's default buffers) or a DeepSpeed JSON file")
    p.add_argument("--no-ds3-gather", action="store_true",
                   help="ds3_gather_for_generation=False: under ZeRO-3, generate gathering layer by layer, not the "
                        "whole model")
    p.add_argument("--continuous-batching", type=float, default=None, metavar="SHARE",
                   help="generate with transformers' continuous batching, its paged cache taking SHARE of the free "
                        "memory (transformers_continuous_batching_config's max_memory_percent)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=None,
                   help="with --continuous-batching: transformers_continuous_batching_config's max_batch_tokens")
    p.add_argument("--no-use-cpu", action="store_true",
                   help="build GRPOConfig without use_cpu=True, as a script written for GPUs does")
    a = p.parse_args()
    if a.fail_with is not None:
        print("failing on purpose", file=sys.stderr)
        sys.exit(a.fail_with)

    if a.leak_mib:
        os.environ["LEAK_MIB"] = str(a.leak_mib)
    if a.host_leak_mib:
        os.environ["HOST_LEAK_MIB"] = str(a.host_leak_mib)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if a.fixed_mib:
        fixed_at_generation(torch, a.fixed_mib)
    torch.manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    rows = []
    for i in range(a.rows + a.long_prompts):
        n = a.prompt_words * (8 if i >= a.rows or (a.long_at_step and i == a.long_at_step - 1) else 1)
        text = " ".join(words[(i + j) % len(words)] for j in range(n))
        rows.append({"prompt": [{"role": "user", "content": f"{i}: {text}"}], "answer": str(i % 7)})
    dataset = Dataset.from_list(rows)
    eval_dataset = Dataset.from_list(rows[:a.eval_rows]) if a.eval_steps else None

    def reward_len(completions, **kw):
        return [len(c[0]["content"]) / 100.0 for c in completions]

    def reward_answer(completions, answer, **kw):
        return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer, strict=True)]

    args = GRPOConfig(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=a.per_device_train_batch_size,
        gradient_accumulation_steps=a.gradient_accumulation_steps,
        num_generations=a.num_generations,
        max_completion_length=a.max_completion_length,
        gradient_checkpointing=not a.no_gradient_checkpointing,
        optim=a.optim,
        learning_rate=1e-5,
        logging_steps=1,
        report_to=[],
        **({} if a.no_use_cpu else {"use_cpu": True}),
        **({} if a.trl_precision else {"bf16": False}),
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        save_total_limit=a.save_total_limit,
        **({"eval_strategy": "steps", "eval_steps": a.eval_steps} if a.eval_steps else {}),
        **({} if a.per_device_eval_batch_size is None else {"per_device_eval_batch_size": a.per_device_eval_batch_size}),
        **({} if a.num_generations_eval is None else {"num_generations_eval": a.num_generations_eval}),
        generation_kwargs={"min_new_tokens": a.max_completion_length},
        dataloader_num_workers=a.dataloader_num_workers,
        **({"shuffle_dataset": False} if a.long_at_step else {}),
        model_init_kwargs={"dtype": a.dtype} if a.model_as_string else None,
        deepspeed=deepspeed_config(a.deepspeed),
        **({"ds3_gather_for_generation": False} if a.no_ds3_gather else {}),
        **({} if a.continuous_batching is None else {
            "use_transformers_continuous_batching": True,
            "transformers_continuous_batching_config": {
                "max_memory_percent": a.continuous_batching,
                **({} if a.cb_max_batch_tokens is None else {"max_batch_tokens": a.cb_max_batch_tokens})}}),
    )
    if a.mem_trace:
        from oomguard.child import simulate

        simulate.start(a.simulate_mib << 20)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = a.model if a.model_as_string else AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype))
    peft_config = None
    if a.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear",
                                 task_type="CAUSAL_LM")

    class Behaviour(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if a.sleep:
                subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({a.sleep * 10})"])
                print(f"sleeping pid={os.getpid()}", flush=True)
                time.sleep(a.sleep)
            rank_ok = a.oom_rank is None or int(os.environ.get("RANK", "0")) == a.oom_rank
            once_ok = a.oom_marker is None or not os.path.exists(a.oom_marker)
            if a.kill_self_at_step is not None and state.global_step == a.kill_self_at_step and once_ok:
                if a.oom_marker:
                    open(a.oom_marker, "w").close()
                if a.oom_kill_counter:
                    import re
                    from pathlib import Path

                    events = Path(a.oom_kill_counter)
                    events.write_text(re.sub(r"^oom_kill (\d+)$", lambda m: f"oom_kill {int(m[1]) + 1}",
                                             events.read_text(), flags=re.M))
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            if a.oom_at_step is not None and state.global_step == a.oom_at_step and rank_ok and once_ok:
                if a.oom_marker:
                    open(a.oom_marker, "w").close()
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.73 GiB of which "
                    "1.28 GiB is free. Including non-PyTorch memory, this process has 14.43 GiB memory in use. Of the "
                    "allocated memory 11.82 GiB is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but "
                    "unallocated.")

    rewards = [reward_len, reward_answer]
    callbacks = [Behaviour()]
    if a.leak_mib or a.host_leak_mib:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import leaky_rewards

        rewards.append(leaky_rewards.leaky_reward if a.leak_mib else leaky_rewards.host_leaky_reward)
    if a.mem_trace:
        callbacks.append(mem_trace_callback(a.mem_trace, model, TrainerCallback))
    if os.environ.get("OOMGUARD_TEST_ENDING"):  # an ending a launch-form test asks of every form alike
        from endings import reward

        rewards.append(reward)
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    TRAINER[0] = trainer
    trainer.train()
    # what it trained with, as the trainer read it (a lock's replay is checked against this line)
    t = trainer.args
    print(f"trained {trainer.state.global_step} steps with per_device_train_batch_size={t.per_device_train_batch_size} "
          f"gradient_accumulation_steps={t.gradient_accumulation_steps} max_completion_length={t.max_completion_length}",
          flush=True)
    print(trained_with(trainer), flush=True)


def trained_with(trainer) -> str:
    """What the run trained with beyond its arguments, as the objects that trained hold it: the optimizer's class
    and whether its states are 8-bit, the model's LoRA rank, whether its weights are 4-bit, gradient checkpointing, and the allocator settings of the
    simulated device (tests/test_run_e2e.py checks that each rung's change reached them)."""
    from oomguard.child import simulate

    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    states = [v for state in opt.state.values() for v in state.values() if hasattr(v, "dtype")]
    model = trainer.model
    peft = getattr(model, "peft_config", None)
    dev = simulate.device()
    split = dev.model.max_split if dev is not None else None
    return (f"trained with optimizer={type(opt).__module__.split('.')[0]}.{type(opt).__name__} "
            f"states_8bit={any(str(v.dtype) == 'torch.uint8' for v in states)} "
            f"lora_r={peft['default'].r if peft else 0} "
            f"weights_4bit={any(type(p).__name__ == 'Params4bit' for p in model.parameters())} "
            f"gradient_checkpointing={getattr(model, 'is_gradient_checkpointing', None)} "
            f"expandable_segments={dev.model.expandable if dev is not None else None} "
            f"max_split_size_mb={split >> 20 if split else None}")


if __name__ == "__main__":
    main()
