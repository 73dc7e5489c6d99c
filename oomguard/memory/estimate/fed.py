"""What a run feeds the memory model beyond the knobs, read from the facts the training process reported: one place
for `oomguard run`, the guard, `oomguard plan` and the training process's pre-flight, so each passes the same
``estimate`` arguments.

A vision-language model's images (:class:`.vision.Images`) come from the dataset's images (``RunFacts``:
``images_per_prompt``, the largest image's ``image_height`` x ``image_width``) and the pixel budget in force
(the ``max_pixels`` knob, which the ``smaller_images`` rung lowers). Gemma 3's processor resizes every image to its
SigLIP encoder's size: its budget counts whole images, one plus its pan-and-scan crops, so a budget of ``n`` such
images makes each image up to ``n`` images of tokens.

>>> from oomguard.vocab.facts import RunFacts
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> from .model import ModelSpec
>>> from .arch import VisionSpec
>>> vl = ModelSpec(2048, 256, 4, 8, 2, 32, 1024, True, vision=VisionSpec("merger", depth=2, hidden=64,
...                intermediate=128, heads=4, patch=14, out_hidden=256, temporal_patch=2, merge=2))
>>> facts = RunFacts(images_per_prompt=1, image_height=448, image_width=448, pixel_budget_floor=3136)
>>> images_of(vl, facts, TRL_DEFAULTS.replace(max_pixels=224 * 224))
Images(per_prompt=1, height=448, width=448, max_pixels=50176, min_pixels=3136, in_prompt_tokens=False, sizes=())
>>> images_of(vl, RunFacts(), TRL_DEFAULTS) is None   # no image reported: a text-only run
True

Several images of different sizes in one prompt count the heaviest prompt's own images (here 448 x 448 beside two
of 224 x 224), not three of the largest:

>>> mixed = facts.replace(images_per_prompt=3, prompt_image_sizes=((448, 448), (224, 224), (224, 224)))
>>> images_of(vl, mixed, TRL_DEFAULTS).sizes
((448, 448), (224, 224), (224, 224))
"""

from __future__ import annotations

from typing import Any

from ...vocab.facts import RunFacts
from ...vocab.knobs import Knobs
from .model import ModelSpec
from .vision import Images


def images_of(spec: ModelSpec, facts: RunFacts, knobs: Knobs) -> Images | None:
    """The images of one prompt as ``estimate`` takes them, or None (a text model, or a run without images)."""
    v = spec.vision
    if v is None or not facts.images_per_prompt:
        return None
    per = int(facts.images_per_prompt)
    budget = knobs.max_pixels
    if v.kind == "siglip":  # a fixed size per image: the budget counts images (one, plus pan-and-scan crops)
        tile = max(1, v.image_size * v.image_size)
        return Images(per_prompt=per * max(1, int(budget or tile) // tile), height=facts.image_height,
                      width=facts.image_width, in_prompt_tokens=facts.prompt_tokens_images)
    return Images(per_prompt=per, height=facts.image_height, width=facts.image_width, max_pixels=budget,
                  min_pixels=facts.pixel_budget_floor, in_prompt_tokens=facts.prompt_tokens_images,
                  sizes=facts.prompt_image_sizes if per > 1 else ())


def fed(spec: ModelSpec, facts: RunFacts, knobs: Knobs) -> dict[str, Any]:
    """``estimate``'s keyword arguments for what the run feeds the model beyond the knobs: its images, PEFT's
    ``target_parameters``, a frozen vision tower, gpt-oss's experts kept in MXFP4, a loader that keeps the dtype
    under 4-bit, what the run does that the model does not count (``RunFacts.unmodelled``), and the dropout of the
    user's own LoRA (a LoRA rung's has none; a rung never replaces the user's)."""
    return {"images": images_of(spec, facts, knobs), "lora_dropout": facts.lora_dropout,
            "lora_target_parameters": tuple(facts.lora_target_parameters) or None,
            "freeze_vision": facts.freeze_vision, "keep_mxfp4": facts.keep_mxfp4,
            "keeps_dtype_4bit": facts.load_takes_4bit, "unmodelled": tuple(facts.unmodelled)}


def load_fed(facts: RunFacts) -> dict[str, Any]:
    """``load_bytes``'s keyword arguments for the same (what a load holds: the dtype kept, MXFP4 experts)."""
    return {"keeps_dtype_4bit": facts.load_takes_4bit, "keep_mxfp4": facts.keep_mxfp4}


__all__ = ["fed", "images_of", "load_fed"]
