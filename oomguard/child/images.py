"""A vision-language model's images, in the training process: what the dataset's images are (wherever GRPOTrainer
finds them: an ``image`` column of one image per prompt, ``images`` of a list, or the prompt's own messages, whose
``{"type": "image", "image": ...}`` content parts ``_tokenize_prompts`` collects), the processor's pixel budget read and
set (the ``max_pixels`` knob), and what the user's model and PEFT config say beyond the knobs (a frozen vision tower,
PEFT's ``target_parameters``, gpt-oss's experts kept in MXFP4).

How each processor spells the budget (transformers 5.x):

- Qwen2-VL / Qwen2.5-VL (``Qwen2VLImageProcessor``): ``size["longest_edge"]`` in pixels (``max_pixels`` before
  transformers 5), and ``size["shortest_edge"]`` the least (``min_pixels``);
- Gemma 3 (``Gemma3ImageProcessor``): every image resized to ``size`` (896 x 896), and with ``do_pan_and_scan`` up to
  ``pan_and_scan_max_num_crops`` crops more of it: its budget is that many whole images' pixels, its floor one image.

Any other image processor: no budget oomguard can set (``pixel_budget_floor`` None; the ``smaller_images`` rung says
so).

The budget oomguard sets is for this run only: what the image processor saves (``to_dict``, through which its own
``save_pretrained`` and the processor's write ``preprocessor_config.json`` with every checkpoint) is the user's own
values (:func:`set_pixel_budget`).
"""

from __future__ import annotations

import copy
import dataclasses
import io
from typing import Any

IMAGE_COLUMNS = ("images", "image")  # what GRPOTrainer reads, in its order (grpo_trainer.py: "images" first)
IMAGE_STATS_ROWS = 2000  # rows whose images are measured (evenly spaced over a larger dataset)
VISION_PREFIXES = ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.")
GEMMA3_DEFAULT_CROPS = 4  # Gemma3Processor.images_kwargs' pan_and_scan_max_num_crops


def image_column(dataset: Any) -> str | None:
    """The column GRPOTrainer takes images from, or None."""
    cols = list(getattr(dataset, "column_names", None) or [])
    return next((c for c in IMAGE_COLUMNS if c in cols), None)


def image_size(img: Any) -> tuple[int, int] | None:
    """``(height, width)`` of one image as a dataset holds it: a PIL image, ``datasets``' undecoded ``{"bytes",
    "path"}``, a path, or an array (``H x W x C`` or ``C x H x W``); only the header of an encoded image is read.

    >>> image_size({"bytes": None, "path": None}) is None
    True
    >>> import numpy as np
    >>> image_size(np.zeros((3, 20, 30))), image_size(np.zeros((20, 30, 3)))
    ((20, 30), (20, 30))
    """
    if img is None:
        return None
    size = getattr(img, "size", None)
    if isinstance(size, tuple) and len(size) == 2:  # PIL: (width, height)
        return int(size[1]), int(size[0])
    if isinstance(img, (dict, str, bytes)):
        src = (img.get("bytes") or img.get("path")) if isinstance(img, dict) else img
        if not src:
            return None
        try:
            from PIL import Image

            with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as im:
                return int(im.size[1]), int(im.size[0])
        except (OSError, ValueError, ImportError):
            return None
    shape = tuple(getattr(img, "shape", ()) or ())
    if len(shape) == 3:
        return (int(shape[1]), int(shape[2])) if shape[0] in (1, 3, 4) else (int(shape[0]), int(shape[1]))
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    return None


def content_images(prompt: Any) -> list[Any]:
    """The images in a conversational prompt's content parts, in order (``GRPOTrainer._tokenize_prompts`` collects
    the same); none in a plain-text prompt.

    >>> content_images([{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "?"}]}])
    ['a.png']
    >>> content_images("a question")
    []
    """
    if not isinstance(prompt, list):
        return []
    return [part.get("image") for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def _without_decoding(feature: Any) -> Any:
    """``feature`` with every ``datasets.Image`` in it left encoded (nested in lists and structs too)."""
    from datasets import Image

    if isinstance(feature, Image):
        return Image(decode=False)
    if isinstance(feature, dict):
        return {k: _without_decoding(v) for k, v in feature.items()}
    if isinstance(feature, (list, tuple)):
        return type(feature)(_without_decoding(v) for v in feature)
    inner = getattr(feature, "feature", None)
    if inner is not None:
        try:
            return type(feature)(_without_decoding(inner))
        except TypeError:
            return feature
    return feature


def _undecoded(dataset: Any, column: str) -> Any:
    """The dataset with ``column``'s images left encoded (``datasets``' Image feature without decoding, nested in the
    prompt's messages too), so that only their headers are read; the dataset itself where that cannot be done."""
    try:
        feature = dataset.features[column]
        undecoded = _without_decoding(feature)
        if undecoded != feature:
            return dataset.cast_column(column, undecoded)
    except Exception:  # any datasets release: measuring decoded images is slower, never wrong
        pass
    return dataset


def _images_of(value: Any, column: str) -> list[Any]:
    if column == "prompt":
        return content_images(value)
    return list(value) if isinstance(value, (list, tuple)) else [value] if value is not None else []


def _sample(n: int) -> range:
    """The rows measured of ``n``: all, or ``IMAGE_STATS_ROWS`` of them evenly spaced."""
    return range(0, n, max(1, -(-n // IMAGE_STATS_ROWS)))


def images_source(dataset: Any) -> str | None:
    """Where GRPOTrainer finds the dataset's images: its ``images`` or ``image`` column, or ``prompt`` (content parts
    of the messages: an ``Image`` in the prompt's features, or an image part in any measured row, not only the first
    rows, since a dataset may open with text-only prompts); None without images."""
    column = image_column(dataset)
    if column is not None:
        return column
    cols = list(getattr(dataset, "column_names", None) or [])
    if "prompt" not in cols or not hasattr(dataset, "__len__") or not len(dataset):
        return None
    try:
        feature = dataset.features["prompt"]
        if _without_decoding(feature) != feature:  # an Image nested in the messages' features
            return "prompt"
    except Exception:  # a dataset without ``datasets``' features: its rows say it
        pass
    try:
        prompts = _undecoded(dataset, "prompt").select(_sample(len(dataset)))["prompt"]
    except Exception:
        return None
    return "prompt" if any(content_images(p) for p in prompts) else None


def _scan(dataset: Any) -> tuple[int, tuple[int, int] | None, int | None, tuple[tuple[int, int], ...]]:
    """(the most images in one prompt, the largest image's ``(height, width)``, its row, the sizes of the images of
    the prompt whose images hold the most pixels together) over the dataset's rows, or ``IMAGE_STATS_ROWS`` of them
    evenly spaced; ``(0, None, None, ())`` without images."""
    column = images_source(dataset)
    if column is None or not hasattr(dataset, "__len__") or not len(dataset):
        return 0, None, None, ()
    view = _undecoded(dataset, column)
    per_prompt, largest, row = 0, None, None
    heaviest: tuple[tuple[int, int], ...] = ()
    for i in _sample(len(dataset)):
        imgs = _images_of(view[i][column], column)
        per_prompt = max(per_prompt, len(imgs))
        sizes = tuple(hw for hw in map(image_size, imgs) if hw is not None)
        if sum(h * w for h, w in sizes) > sum(h * w for h, w in heaviest):
            heaviest = sizes
        big = max(sizes, key=lambda hw: hw[0] * hw[1], default=None)
        if big is not None and (largest is None or big[0] * big[1] > largest[0] * largest[1]):
            largest, row = big, i
    return per_prompt, largest, row, heaviest


def image_facts(dataset: Any) -> dict[str, Any]:
    """RunFacts of the dataset's images: the most images in one prompt, the largest image's size (by pixels) and,
    with several images per prompt, the sizes of the heaviest prompt's own images; nothing for a dataset without
    images (wherever a prompt might hold them, none does)."""
    if images_source(dataset) is None:
        return {}
    per_prompt, largest, _row, heaviest = _scan(dataset)
    if not per_prompt:
        return {}
    out: dict[str, Any] = {"images_per_prompt": per_prompt}
    if largest is not None:
        out.update(image_height=largest[0], image_width=largest[1])
        if per_prompt > 1:
            out.update(prompt_image_sizes=heaviest)
    return out


def largest_image_row(dataset: Any) -> int | None:
    """The row with the largest image (of those :func:`image_facts` measures), which the probe pairs with the longest
    prompt; None without images."""
    return _scan(dataset)[2]


def _largest(images: list[Any]) -> Any:
    sized = [(hw[0] * hw[1], i) for i, hw in enumerate(map(image_size, images)) if hw is not None]
    return images[max(sized)[1]] if sized else (images[0] if images else None)


def with_images_of(dataset: Any, rows: list[int], donor: int) -> Any:
    """``dataset.select(rows)`` with every row's images replaced by row ``donor``'s (the probe's longest prompt with the
    largest image): a column's images, or each image part of the prompt's messages the donor's largest image."""
    column = images_source(dataset)
    picked = dataset.select(rows)
    if column is None or donor in rows:
        return picked
    if column == "prompt":
        big = _largest(content_images(dataset[donor]["prompt"]))

        def swap(prompt: Any) -> Any:
            return [{**m, "content": [{**c, "image": big} if isinstance(c, dict) and c.get("type") == "image" else c
                                      for c in m["content"]]} if isinstance(m, dict)
                    and isinstance(m.get("content"), list) else m for m in prompt]

        return picked.map(lambda row: {"prompt": swap(row["prompt"])}, features=dataset.features)
    images = dataset[donor][column]
    return picked.map(lambda _row: {column: images})


# -- the processor's pixel budget --------------------------------------------------------------------------------
def _image_processor(processor: Any) -> Any:
    return getattr(processor, "image_processor", None)


def _size(ip: Any) -> dict[str, Any]:
    size = getattr(ip, "size", None)
    if size is None:
        return {}
    if dataclasses.is_dataclass(size) and not isinstance(size, type):
        return {f.name: getattr(size, f.name) for f in dataclasses.fields(size)}
    return dict(size) if isinstance(size, dict) else {}


def _gemma_tile(ip: Any) -> int | None:
    """Gemma 3's fixed image size in pixels (896 x 896), or None for another processor."""
    if not hasattr(ip, "do_pan_and_scan"):
        return None
    s = _size(ip)
    h, w = s.get("height"), s.get("width")
    return int(h) * int(w) if h and w else None


def pixel_budget(processor: Any) -> dict[str, Any]:
    """What the processor says of its pixel budget: ``max_pixels`` (the budget in force), ``pixel_budget_floor`` (the
    least it takes) and ``image_processor`` (its class); only ``image_processor`` for a processor without a budget
    oomguard knows, nothing without an image processor.

    >>> from types import SimpleNamespace
    >>> pixel_budget(SimpleNamespace(image_processor=SimpleNamespace(size={"shortest_edge": 3136,
    ...                                                                    "longest_edge": 1003520}, merge_size=2)))
    {'image_processor': 'SimpleNamespace', 'max_pixels': 1003520, 'pixel_budget_floor': 3136}
    """
    ip = _image_processor(processor)
    if ip is None:
        return {}
    out: dict[str, Any] = {"image_processor": type(ip).__name__}
    tile = _gemma_tile(ip)
    if tile is not None:
        crops = getattr(ip, "pan_and_scan_max_num_crops", None) or GEMMA3_DEFAULT_CROPS
        return {**out, "max_pixels": tile * (1 + (int(crops) if getattr(ip, "do_pan_and_scan", None) else 0)),
                "pixel_budget_floor": tile}
    s = _size(ip)
    if s.get("longest_edge") and hasattr(ip, "merge_size"):
        return {**out, "max_pixels": int(s["longest_edge"]), "pixel_budget_floor": int(s.get("shortest_edge") or 1)}
    return out


def set_pixel_budget(processor: Any, pixels: int) -> bool:
    """Set the processor's budget to ``pixels`` (as :func:`pixel_budget` reads it); False where it has none. What the
    image processor saves stays the user's (:func:`_saves_the_users`).

    >>> from types import SimpleNamespace
    >>> ip = SimpleNamespace(size={"shortest_edge": 3136, "longest_edge": 1003520}, merge_size=2)
    >>> set_pixel_budget(SimpleNamespace(image_processor=ip), 401408), ip.size["longest_edge"]
    (True, 401408)
    """
    ip = _image_processor(processor)
    if ip is None:
        return False
    tile = _gemma_tile(ip)
    if tile is not None:
        crops = int(pixels) // tile - 1
        _saves_the_users(ip, ("do_pan_and_scan", "pan_and_scan_max_num_crops"))
        if crops <= 0:
            ip.do_pan_and_scan = False
        else:
            ip.pan_and_scan_max_num_crops = crops
        return True
    s = _size(ip)
    if not (s.get("longest_edge") and hasattr(ip, "merge_size")):
        return False
    new = {**s, "longest_edge": int(pixels), "shortest_edge": min(int(s.get("shortest_edge") or 1), int(pixels))}
    size = ip.size
    _saves_the_users(ip, ("size",))
    ip.size = dataclasses.replace(size, **{k: new[k] for k in ("longest_edge", "shortest_edge")}) \
        if dataclasses.is_dataclass(size) and not isinstance(size, type) else new
    return True


_ABSENT = "<oomguard: absent>"  # an attribute the user's image processor did not have (a string survives deepcopy)
# in the image processor's own attributes, so that it travels with the deep copy a processor's ``to_dict`` makes: the
# user's own values of the attributes oomguard's budget changed (the first seen: the user's)
USERS = "_oomguard_users"


def _saves_the_users(ip: Any, names: tuple[str, ...]) -> None:
    """Remember the user's values of ``names`` before oomguard's budget changes them, and make the image processor's
    class serialise each of its instances with the user's values (``to_dict``: what ``save_pretrained``, the
    processor's and the trainer's checkpoints, write), not oomguard's, which hold for this run only."""
    own = getattr(ip, "__dict__", None)
    if own is None:
        return
    users = own.setdefault(USERS, {})
    for name in names:
        users.setdefault(name, copy.deepcopy(own.get(name, _ABSENT)))
    cls = type(ip)
    if not callable(getattr(cls, "to_dict", None)) or getattr(cls.to_dict, "_oomguard_users", False):
        return
    inner = cls.to_dict

    def to_dict(self: Any) -> Any:
        users = vars(self).get(USERS)
        if not users:
            return inner(self)
        ours = {name: vars(self).get(name, _ABSENT) for name in users}
        _put(self, users)
        try:
            out = inner(self)
        finally:
            _put(self, ours)
        if isinstance(out, dict):
            out.pop(USERS, None)
        return out

    to_dict._oomguard_users = True  # type: ignore[attr-defined]
    to_dict.__doc__ = inner.__doc__
    cls.to_dict = to_dict


def _put(ip: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        if isinstance(value, str) and value == _ABSENT:
            vars(ip).pop(name, None)
        else:
            vars(ip)[name] = value


# -- what the user's model and PEFT config say --------------------------------------------------------------------
def vision_frozen(model: Any) -> bool:
    """A full fine-tune whose script froze the vision tower: every parameter of the tower and its projector has
    ``requires_grad`` off (a PEFT model is not a full fine-tune: its adapters follow its target modules)."""
    if model is None or hasattr(model, "peft_config"):
        return False
    vision = [p for n, p in model.named_parameters() if any(n.startswith(x) or f".{x}" in n for x in VISION_PREFIXES)]
    return bool(vision) and not any(p.requires_grad for p in vision)


def keeps_mxfp4(model: Any) -> bool:
    """gpt-oss loaded without dequantising: its experts are transformers' MXFP4 modules."""
    return model is not None and any(type(m).__name__.startswith("Mxfp4") for m in model.modules())


def target_parameters(peft_config: Any) -> tuple[str, ...]:
    """PEFT's ``target_parameters`` (experts adapted as parameters), or nothing."""
    tp = getattr(peft_config, "target_parameters", None)
    if isinstance(tp, str):
        return (tp,)
    return tuple(str(t) for t in tp) if isinstance(tp, (list, tuple, set, frozenset)) else ()
