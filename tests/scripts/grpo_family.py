"""GRPO on a tiny random model of one of the newer families, for their end-to-end tests under `oomguard run`.

The run of ``bench/family_calibrate.py`` (which measured the committed rows): every prompt exactly ``--prompt-words``
tokens, completions forced to ``--max-completion-length`` tokens, a random reward, two steps, the model given to
GRPOTrainer by its path; the vision-language model (``--arch vlm``) with one random 224 x 224 image per prompt in
the dataset's ``image`` column (``--images-in-messages``: in the prompt's message instead) and Qwen2.5-VL's processor
over a word-level tokenizer (``--image-size`` and ``--max-pixels`` change the images and the processor's budget).

  python tests/scripts/grpo_family.py --arch moe --model DIR --output-dir OUT
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", required=True, help="an ARCHS entry of bench/family_calibrate.py")
    p.add_argument("--model", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--per-device-train-batch-size", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--lora-r", type=int, default=0)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--image-size", type=int, default=224, help="the VLM's images: this many pixels a side")
    p.add_argument("--max-pixels", type=int, default=224 * 224, help="the VLM processor's pixel budget")
    p.add_argument("--images-in-messages", action="store_true",
                   help="the VLM's images as content parts of the prompt's message, not an image column")
    a = p.parse_args()
    sys.path.insert(0, str(BENCH))
    from _phases import build_trainer
    from cpu_calibrate import Config
    from family_calibrate import ARCHS, build_vlm_trainer

    cfg = replace(Config("e2e", arch=a.arch), P=a.prompt_words, C=a.max_completion_length,
                  B=a.per_device_train_batch_size, G=a.num_generations, gc=not a.no_gradient_checkpointing,
                  lora_r=a.lora_r)
    if a.arch == "vlm":
        trainer = build_vlm_trainer(cfg, a.model, a.output_dir, rows=a.rows, image=a.image_size,
                                    max_pixels=a.max_pixels, in_messages=a.images_in_messages, bf16=False,
                                    use_cpu=True)
    else:
        trainer = build_trainer(cfg, a.model, ARCHS[a.arch]["vocab_size"], a.output_dir, rows=a.rows,
                                model_init_kwargs={"dtype": "float32"}, bf16=False, use_cpu=True)
    trainer.train()
    print(f"trained {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
