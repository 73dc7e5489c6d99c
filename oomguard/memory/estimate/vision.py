"""Images in the prompt of a vision-language model: how many tokens an image becomes, how many patches the vision
tower runs over, and what the tower keeps per patch.

The inputs the rest of oomguard feeds the model are plain values in :class:`Images` (passed as
``estimate(..., images=Images(...))``): images per prompt, the largest image's size, and the processor's pixel budget
(``max_pixels`` of Qwen2-VL/Qwen2.5-VL's image processor, read from a model directory's
``preprocessor_config.json`` by :func:`load_pixel_budget`). Gemma 3's processor resizes every image to the SigLIP
encoder's ``image_size`` and pools it to ``mm_tokens_per_image`` tokens, whatever its size.

>>> from oomguard.memory.estimate.model import VisionSpec
>>> qwen_vl = VisionSpec("merger", depth=32, hidden=1280, intermediate=3420, heads=16, patch=14, out_hidden=2048,
...                      temporal_patch=2, merge=2, full_blocks=4, window=112)
>>> image_tokens(qwen_vl, Images(height=1080, width=1920))     # a 1080p image at the class's budget: 26 x 47 + 2
1224
>>> image_tokens(qwen_vl, Images(height=1080, width=1920, max_pixels=12845056))   # Qwen2.5-VL's published budget
2693
>>> image_tokens(qwen_vl, Images(max_pixels=401408))           # an image of unknown size: the most the budget allows
514
>>> vision_patches(qwen_vl, Images(max_pixels=401408))         # 2 x 2 patches merge into one token
2048
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any

from .model import EstimateError, ModelSpec, VisionSpec

# Qwen2VLImageProcessor's defaults (transformers 5.24, image_processing_qwen2_vl.py: size shortest_edge / longest_edge)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# Gemma 3's processor frames each image's tokens: "\n\n<start_of_image>" + tokens + "<end_of_image>\n\n"
GEMMA3_FRAME_TOKENS = 4


@dataclass(frozen=True)
class Images:
    """The images of one prompt, as the model's processor sees them.

    ``per_prompt``: images in each prompt (0: a text-only run). ``height``/``width``: the largest image's size in
    pixels before the processor resizes it (None: an image at the processor's pixel budget, the worst case).
    ``max_pixels`` / ``min_pixels``: the processor's pixel budget (Qwen2-VL/2.5-VL; None: the image processor class's
    defaults, 1,003,520 and 3,136; a model's ``preprocessor_config.json`` often sets its own: see
    :func:`load_pixel_budget`). ``in_prompt_tokens``: the ``prompt_tokens`` passed to ``estimate`` already count the
    image tokens (a length measured on the processor's output), so only the vision tower is added; otherwise the
    image tokens are added to the prompt. ``sizes``: with several images of different sizes, the heaviest prompt's
    own, each ``(height, width)``, counted one by one instead of ``per_prompt`` times the largest.
    """

    per_prompt: int = 1
    height: int | None = None
    width: int | None = None
    max_pixels: int | None = None
    min_pixels: int | None = None
    in_prompt_tokens: bool = False
    sizes: tuple[tuple[int, int], ...] = ()

    def each(self) -> list[Images]:
        """One prompt's images one by one: its ``sizes``, else ``per_prompt`` of the largest.

        >>> [(i.height, i.width) for i in Images(per_prompt=2, height=64, width=64).each()]
        [(64, 64), (64, 64)]
        >>> [(i.height, i.width) for i in Images(per_prompt=2, height=64, width=64, sizes=((64, 64), (8, 8))).each()]
        [(64, 64), (8, 8)]
        """
        if self.sizes:
            return [replace(self, per_prompt=1, height=h, width=w, sizes=()) for h, w in self.sizes]
        return [replace(self, per_prompt=1)] * max(0, self.per_prompt)


def prompt_patches(v: VisionSpec, images: Images) -> int:
    """Patches the vision tower runs over for one prompt's images (:func:`vision_patches` of each)."""
    return sum(vision_patches(v, i) for i in images.each())


def prompt_tokens_of_images(v: VisionSpec, images: Images) -> int:
    """Tokens one prompt's images add to it (:func:`image_tokens` of each)."""
    return sum(image_tokens(v, i) for i in images.each())


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize (``image_processing_qwen2_vl.smart_resize``): both sides multiples of ``factor`` (patch ×
    merge, 28), the area within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as possible.

    >>> smart_resize(1080, 1920, 28, 3136, 1003520)
    (728, 1316)
    """
    if min(height, width) <= 0:
        raise EstimateError(f"image size must be positive, not {height}x{width}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def vision_patches(v: VisionSpec, images: Images) -> int:
    """Patches the vision tower runs over for the largest image: ``(H/14)·(W/14)`` after Qwen's resize (an image is
    one temporal patch of two identical frames), or, for an image of unknown size, the most the pixel budget allows
    (``max_pixels // 28²`` merged tokens); ``(image_size/patch)²`` for SigLIP, whatever the image."""
    if v.kind == "siglip":
        return v.patches_per_image
    factor = v.patch * v.merge
    max_pixels = images.max_pixels or DEFAULT_MAX_PIXELS
    min_pixels = images.min_pixels or DEFAULT_MIN_PIXELS
    if images.height is None or images.width is None:
        return max(1, max_pixels // (factor * factor)) * v.merge * v.merge
    h, w = smart_resize(images.height, images.width, factor, min_pixels, max_pixels)
    return (h // v.patch) * (w // v.patch)


def image_tokens(v: VisionSpec, images: Images) -> int:
    """Tokens one image (the largest) adds to the prompt: the tower's patches merged ``merge × merge`` (Qwen2.5-VL:
    one token per 28 × 28 pixels after the resize), or Gemma 3's ``mm_tokens_per_image`` and the four tokens
    framing them."""
    if v.kind == "siglip":
        return v.tokens_per_image + GEMMA3_FRAME_TOKENS
    return vision_patches(v, images) // (v.merge * v.merge) + 2  # <|vision_start|> ... <|vision_end|>


def prompt_image_tokens(spec: ModelSpec, images: Images | None) -> int:
    """Tokens the images of one prompt add to it (0 without images, a text model, or when ``prompt_tokens`` counts
    them already)."""
    if images is None or spec.vision is None or images.per_prompt <= 0 or images.in_prompt_tokens:
        return 0
    return prompt_tokens_of_images(spec.vision, images)


def pixel_bytes(v: VisionSpec, images: Images) -> int:
    """The processor's ``pixel_values`` of one prompt's images in float32 (what TRL keeps in the buffered batch): per
    patch ``channels × temporal_patch × patch²`` values (Qwen2.5-VL), or the ``[3, image_size, image_size]`` image."""
    if images.per_prompt <= 0:
        return 0
    per_patch = v.channels * v.temporal_patch * v.patch * v.patch
    return 4 * prompt_patches(v, images) * per_patch


def vision_bytes_per_patch(v: VisionSpec, *, b_c: int, b_res: int, trains: bool, adapted: bool) -> int:
    """Bytes one vision block keeps per patch for backward (``trains``: the tower's weights train; ``adapted``: LoRA
    adapters in it, so its inputs need gradients; neither: nothing is kept). Measured on the simulated device
    (a Qwen2.5-VL tower's saved tensors, ``bench/family_calibrate.py``'s VLM): within 3%.

    Qwen2.5-VL's block: two RMSNorms (fp32 input; the normalised copy when the weight trains), the qkv Linear's input,
    q, k and v (and q and k again in fp32 around the rotary embedding) with SDPA's output, ``proj``'s input, and the
    SwiGLU MLP (gate, act, up, product). SigLIP's: two LayerNorms, q, k, v, the attention output, fc1's output (GELU's
    input), GELU's output (fc2's input)."""
    if not (trains or adapted):
        return 0
    d, m = v.hidden, v.intermediate
    if v.kind == "merger":
        norms = 2 * (4 * d + (b_res * d if trains else 0))
        attn = b_c * d + b_c * 6 * d + b_c * d  # qkv input, q k v (and fp32 q, k) and output, proj input
        mlp = b_c * d + 3 * m * b_c + b_c * m
        return norms + attn + mlp
    norms = 2 * (b_res * d + 8)  # LayerNorm saves its input, mean and rstd
    attn = b_c * d + b_c * 4 * d + b_c * d
    mlp = b_c * d + m * b_c + b_c * m
    return norms + attn + mlp


def merger_bytes_per_patch(v: VisionSpec, *, b_c: int, b_res: int, trains: bool) -> int:
    """Bytes the projector keeps per patch after the blocks: Qwen2.5-VL's merger (its RMSNorm's input and normalised
    copy, then its MLP's input, GELU's input and output over ``merge²``-patch rows); SigLIP's post-norm and Gemma 3's
    pooling and projection (the pooled rows are 16 times fewer)."""
    d = v.hidden
    if v.kind == "merger":
        return 4 * d + (b_res * d if trains else 0) + 3 * d * b_c
    return b_res * d + 8 + 2 * d * b_c // max(1, v.patches_per_image // max(1, v.tokens_per_image))


def load_pixel_budget(path: str | os.PathLike[str]) -> tuple[int | None, int | None]:
    """``(min_pixels, max_pixels)`` from a model directory's ``preprocessor_config.json`` (Qwen2-VL/2.5-VL: its
    ``min_pixels``/``max_pixels``, or ``size.shortest_edge``/``size.longest_edge``); ``(None, None)`` when there is
    none, or it sets no budget (Gemma 3's processor has a fixed size)."""
    p = os.fspath(path)
    f = os.path.join(p, "preprocessor_config.json") if os.path.isdir(p) else p
    if not os.path.isfile(f):
        return None, None
    try:
        with open(f, encoding="utf-8") as fh:
            d: Any = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EstimateError(f"{f}: cannot read the image processor's config ({e})".splitlines()[0]) from None
    if not isinstance(d, dict):
        return None, None
    given = d.get("size")
    size = given if isinstance(given, dict) else {}
    lo = d.get("min_pixels", size.get("shortest_edge") if "longest_edge" in size else None)
    hi = d.get("max_pixels", size.get("longest_edge"))
    ok = [v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None for v in (lo, hi)]
    return ok[0], ok[1]
