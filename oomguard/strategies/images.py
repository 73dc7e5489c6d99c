"""Smaller images: a vision-language model's pixel budget per image (``max_pixels``), and with it its image tokens.

An image costs a vision-language model hundreds to thousands of prompt tokens (Qwen2.5-VL: one per 28 x 28 pixels
after its processor's resize, up to ``max_pixels``), and its vision tower runs over four times as many patches. Halving
the budget halves both, for every prompt and every generation: where a user would rather give up resolution than
completions or generations, this rung comes before those in the ladders.
"""

from __future__ import annotations

from oomguard.vocab.diagnosis import Diagnosis
from oomguard.vocab.knobs import Knobs

from .base import Advice, Context, Remedy, halve_request, register
from .params import Param, shrink_factor

# Qwen2-VL's resize makes both sides multiples of 28 (patch 14, merged 2 x 2): a budget in whole merged tokens
TOKEN_PIXELS = 28 * 28


@register
class SmallerImages(Remedy):
    name = "smaller_images"
    summary = "Lower a vision-language model's pixel budget per image (max_pixels): fewer image tokens per prompt."
    cost = "signal"
    trade_note = ("fewer image tokens: the model sees each image at a lower resolution (fine detail and small text "
                  "may be lost)")
    resume = "continue"
    graded = True
    changes = ("max_pixels",)
    shrinks_shapes = True
    params = {"factor": shrink_factor(0.5, "what each step multiplies max_pixels by"),
              "min_pixels": Param(TOKEN_PIXELS * 64, int, low=1,
                                  text="the smallest pixel budget it goes down to (default 64 image tokens' worth)")}

    def foreign(self, ctx: Context) -> str | None:
        """Not a vision-language model's run: no image in its prompts to shrink.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
        >>> SmallerImages().foreign(Context(knobs=TRL_DEFAULTS, facts=RunFacts(images_per_prompt=0)))
        'the run has no images in its prompts (not a vision-language model with images)'
        """
        f = ctx.facts
        config = f.model_config or {}
        if not f.images_per_prompt or (config and "vision_config" not in config):
            return "the run has no images in its prompts (not a vision-language model with images)"
        return None

    def blocked(self, ctx: Context) -> str | None:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
        >>> gemma = RunFacts(images_per_prompt=1, pixel_budget_floor=896 * 896, image_processor="Gemma3ImageProcessor")
        >>> SmallerImages().blocked(Context(knobs=TRL_DEFAULTS.replace(max_pixels=896 * 896), facts=gemma))
        'max_pixels is at its floor (802,816 pixels: what Gemma3ImageProcessor takes at least)'
        >>> qwen = RunFacts(images_per_prompt=1, pixel_budget_floor=3136, image_height=200, image_width=224)
        >>> SmallerImages().blocked(Context(knobs=TRL_DEFAULTS.replace(max_pixels=12845056), facts=qwen))
        "the largest image (200 x 224, 44,800 pixels) is at or below the rung's floor (50,176 pixels: the ladder's min_pixels): no budget it may set changes any image"
        """
        f = ctx.facts
        if f.pixel_budget_floor is None:
            what = f.image_processor or "the run's image processor"
            return f"{what} has no pixel budget oomguard knows how to lower"
        if ctx.knobs.max_pixels is None:
            return "the image processor's pixel budget is not known yet"
        floor = self._floor(ctx)
        if self._effective(ctx) <= floor:
            why = (f"what {f.image_processor or 'the image processor'} takes at least"
                   if floor == f.pixel_budget_floor else "the ladder's min_pixels")
            if f.image_height and f.image_width and f.image_height * f.image_width < int(ctx.knobs.max_pixels):
                # the budget is above the largest image: the images are what they are, and the floor is above them
                return (f"the largest image ({f.image_height} x {f.image_width}, {f.image_height * f.image_width:,} "
                        f"pixels) is at or below the rung's floor ({floor:,} pixels: {why}): no budget it may set "
                        "changes any image")
            return f"max_pixels is at its floor ({floor:,} pixels: {why})"
        return None

    def _floor(self, ctx: Context) -> int:
        return max(int(ctx.facts.pixel_budget_floor or 1), int(self.p["min_pixels"]))

    @staticmethod
    def _effective(ctx: Context) -> int:
        """The pixels the largest image gets now: the budget, or the image itself where it is smaller (a budget
        above it changes nothing)."""
        f, budget = ctx.facts, int(ctx.knobs.max_pixels or 0)
        if f.image_height and f.image_width and f.pixel_budget_floor != budget:
            return min(budget, f.image_height * f.image_width)
        return budget

    def apply(self, ctx: Context) -> Knobs:
        """Half the pixels the largest image gets now (in whole 28 x 28 tokens), not below the floor.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
        >>> qwen = RunFacts(images_per_prompt=1, pixel_budget_floor=3136)
        >>> SmallerImages().apply(Context(knobs=TRL_DEFAULTS.replace(max_pixels=1003520), facts=qwen)).max_pixels
        501760
        >>> small = qwen.replace(image_height=448, image_width=448)   # a budget above the image changes nothing
        >>> SmallerImages().apply(Context(knobs=TRL_DEFAULTS.replace(max_pixels=1003520), facts=small)).max_pixels
        100352
        """
        new = int(self._effective(ctx) * float(self.p["factor"])) // TOKEN_PIXELS * TOKEN_PIXELS
        return ctx.knobs.replace(max_pixels=max(self._floor(ctx), new))

    def relax(self, user: Knobs, current: Knobs, world_size: int = 1) -> list[Knobs]:
        """Budgets between the climbed one and the user's, largest first: eight steps an octave (each halving the
        rung took, in eighths), in whole image tokens. Where the user's budget is above the largest image, the
        steps above the image change nothing and are judged like the user's own.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> cands = SmallerImages().relax(TRL_DEFAULTS.replace(max_pixels=1003520),
        ...                               TRL_DEFAULTS.replace(max_pixels=250880))
        >>> [k.max_pixels for k in cands][:3], [k.max_pixels for k in cands][-2:], len(cands)
        ([940800, 878080, 815360], [313600, 282240], 15)
        """
        u, c = user.max_pixels, current.max_pixels
        if not u or not c or c >= u:
            return []
        values: set[int] = set()
        low = c
        while low < u:
            step = max(TOKEN_PIXELS, low // 8 // TOKEN_PIXELS * TOKEN_PIXELS)
            values.update(v for v in range(low + step, min(u, 2 * low) + 1, step) if c < v < u)
            low *= 2
        return [current.replace(max_pixels=v) for v in sorted(values, reverse=True)]

    def describe_change(self, user: Knobs, final: Knobs, world_size: int = 1) -> str:
        """>>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> SmallerImages().describe_change(TRL_DEFAULTS.replace(max_pixels=1003520),
        ...                                 TRL_DEFAULTS.replace(max_pixels=501760))
        'fewer image tokens: images of at most 501,760 pixels (yours: 1,003,520)'
        """
        u, f = user.max_pixels, final.max_pixels
        if f == u or f is None:
            return self.name
        yours = f"{u:,}" if u else "the processor's own"
        return f"fewer image tokens: images of at most {f:,} pixels (yours: {yours})"

    def advise(self, d: Diagnosis) -> Advice:
        return Advice(self.name, "Halving max_pixels halves each image's tokens (and its vision tower's patches), in "
                                 "every prompt and every generation.",
                      halve_request(d) if d.phase in ("generation", "scoring", "forward", "backward") else None)

