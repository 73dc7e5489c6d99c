"""A vision-language model's images beyond the memory model (issue 41): the ``max_pixels`` knob and the
``smaller_images`` rung that lowers it, the image facts the training process reports (read from the dataset as
GRPOTrainer reads it), the processor's budget read and set, the probe's worst case with the largest image, what the
user's model says (a frozen vision tower, PEFT's target_parameters, MXFP4 experts), and `oomguard plan`'s image
options. The end-to-end runs are tests/test_families_e2e.py's (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.child.datasets import prompt_lengths
from oomguard.child.images import (
    image_facts,
    keeps_mxfp4,
    largest_image_row,
    pixel_budget,
    set_pixel_budget,
    target_parameters,
    vision_frozen,
    with_images_of,
)
from oomguard.decide.cheapest import CostPreference
from oomguard.decide.choose import Rung
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import available_ladders, load_ladder
from oomguard.decide.plan import make_plan
from oomguard.memory.estimate import Images, estimate, fed, image_tokens, images_of, load_model_spec
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.facts import RunFacts
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, parse_knob
from oomguard.vocab.knobtable import TABLE

MODELS = Path(__file__).resolve().parent / "fixtures" / "models"
QWEN_VL = MODELS / "qwen2.5-vl-3b-instruct"
GEMMA = MODELS / "gemma-3-4b-it"
BENCH = Path(__file__).resolve().parent.parent / "bench"
VLM = RunFacts(images_per_prompt=1, image_height=1080, image_width=1920, pixel_budget_floor=3136,
               image_processor="Qwen2VLImageProcessor", prompt_tokens_max=200,
               model_config=json.loads((QWEN_VL / "config.json").read_text()))


def _image(h: int, w: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8))


# -- the knob and the rung --------------------------------------------------------------------------------------------

def test_max_pixels_is_one_knob_reaching_the_trainer():
    info = TABLE["max_pixels"]
    assert info.reaches == ("trainer",) and info.trl is None and "image tokens" in info.meaning
    assert parse_knob("max_pixels", "401408") == 401408
    assert TABLE["max_pixels"].problem(0) is not None


def test_smaller_images_applies_only_to_a_vision_language_run_with_images():
    r = make_remedy("smaller_images")
    text_run = RunFacts(prompt_tokens_max=100, model_config={"model_type": "qwen3"})
    no_images = VLM.replace(images_per_prompt=0)
    for facts in (text_run, no_images, RunFacts()):
        assert "no images" in (r.foreign(Context(knobs=TRL_DEFAULTS, facts=facts)) or "")
    k = TRL_DEFAULTS.replace(max_pixels=1_003_520)
    assert r.foreign(Context(knobs=k, facts=VLM)) is None and r.blocked(Context(knobs=k, facts=VLM)) is None
    assert r.apply(Context(knobs=k, facts=VLM)).max_pixels == 501_760  # halved, in whole 28 x 28 tokens
    # the reasons a user reads when it cannot help
    unknown = VLM.replace(pixel_budget_floor=None, image_processor="SiglipImageProcessor")
    assert r.blocked(Context(knobs=k, facts=unknown)) == ("SiglipImageProcessor has no pixel budget oomguard knows "
                                                           "how to lower")
    assert "not known" in r.blocked(Context(knobs=TRL_DEFAULTS, facts=VLM))
    floor = Context(knobs=TRL_DEFAULTS.replace(max_pixels=64 * 784), facts=VLM)
    assert r.blocked(floor) == "max_pixels is at its floor (50,176 pixels: the ladder's min_pixels)"
    assert r.apply(Context(knobs=TRL_DEFAULTS.replace(max_pixels=80 * 784), facts=VLM)).max_pixels == 64 * 784


def test_a_budget_above_images_at_or_below_the_rungs_floor_is_not_climbed():
    """Issue 46: Qwen2.5-VL's processor budget (12,845,056 pixels) above 224 x 224 images: the rung's floor (64 image
    tokens, 224 x 224) cannot change them, so the climb passes it over, saying why, and climbs on to what can help."""
    small = VLM.replace(image_height=224, image_width=224)
    k = TRL_DEFAULTS.replace(max_pixels=12_845_056, num_generations=8)
    ladder = load_ladder("default").only(["smaller_images", "fewer_generations"])
    step = ladder.next(Context(knobs=k, facts=small))
    assert step.remedy.name == "fewer_generations"
    assert dict(step.skipped)["smaller_images"] == (
        "the largest image (224 x 224, 50,176 pixels) is at or below the rung's floor (50,176 pixels: the ladder's "
        "min_pixels): no budget it may set changes any image")
    # an image above the floor is shrunk, to the floor at most
    big = VLM.replace(image_height=448, image_width=448)
    assert ladder.next(Context(knobs=k, facts=big)).knobs.max_pixels == 100_352


def test_the_cost_line_says_what_resolution_costs():
    r = make_remedy("smaller_images")
    user, final = TRL_DEFAULTS.replace(max_pixels=1_003_520), TRL_DEFAULTS.replace(max_pixels=501_760)
    assert r.cost == "signal" and r.trade_for({"max_pixels": 501_760}).startswith("fewer image tokens: ")
    assert r.describe_change(user, final) == ("fewer image tokens: images of at most 501,760 pixels "
                                              "(yours: 1,003,520)")
    assert r.trade_for({"max_completion_length": 64}) == ""  # not its knob: nothing traded


def test_the_ladders_give_up_resolution_before_completions_and_generations():
    for name in available_ladders():
        names = [r.name for r in load_ladder(name).rungs]
        assert "smaller_images" in names, name
        at = names.index("smaller_images")
        assert at < names.index("shorter_sequences") and at < names.index("fewer_generations"), name
    user = TRL_DEFAULTS.replace(max_pixels=1_003_520, max_completion_length=512)
    rungs = [Rung(make_remedy(n)) for n in ("smaller_images", "shorter_sequences")]
    pref = CostPreference.of(rungs, ["smaller_images", "shorter_sequences"], user)
    half_pixels = pref.key(["smaller_images"], user.replace(max_pixels=501_760))
    assert half_pixels < pref.key(["shorter_sequences"], user.replace(max_completion_length=256))
    assert half_pixels < pref.key(["shorter_sequences"], user.replace(max_completion_length=384))  # a quarter of it


def test_the_choice_lowers_the_resolution_before_the_completions():
    """`oomguard plan` (and run, whose conductor it uses) on Qwen2.5-VL-3B with two 1080p images per prompt, on a
    ladder of signal rungs only: smaller images alone, completions and generations kept."""
    spec = load_model_spec(QWEN_VL)
    k = TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=16, max_pixels=12_845_056, max_completion_length=256,
                             learning_rate=1e-4)
    facts = VLM.replace(images_per_prompt=2, model_config=None)
    lad = load_ladder("default").only(["smaller_images", "fewer_generations", "shorter_sequences"])
    need = make_plan(spec, k, 80 * 2**30, ladder=lad, facts=facts, prompt_tokens=200).estimate.peak_bytes
    p = make_plan(spec, k, int(need * 0.8), ladder=lad, facts=facts, prompt_tokens=200)
    assert not p.fits and p.after is not None and p.after.fits(int(need * 0.8))
    assert [r.name for r in p.rungs] == ["smaller_images"]
    assert set(p.suggest) == {"max_pixels"} and p.suggest["max_pixels"] < 12_845_056


# -- the images reach the memory model ----------------------------------------------------------------------------

def test_the_images_reach_every_prediction_once():
    spec = load_model_spec(QWEN_VL)
    k = TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=16, max_pixels=401_408)
    images = images_of(spec, VLM, k)
    assert images == Images(per_prompt=1, height=1080, width=1920, max_pixels=401_408, min_pixels=3136)
    judged = Judge(80 * 2**30).predict(VLM, k)
    assert judged is not None
    assert judged.peak_bytes == estimate(spec, k, prompt_tokens=200, capacity=80 * 2**30, **fed(spec, VLM, k)).peak_bytes
    text = Judge(80 * 2**30).predict(VLM.replace(images_per_prompt=0), k)
    assert text is not None and text.peak_bytes < judged.peak_bytes
    # prompt lengths measured on the processor's output count the image tokens already: not added twice
    tokens = image_tokens(spec.vision, images)
    counted = VLM.replace(prompt_tokens_max=200 + tokens, prompt_tokens_images=True)
    again = Judge(80 * 2**30).predict(counted, k)
    assert again is not None and again.peak_bytes == judged.peak_bytes
    # a smaller budget is a smaller prediction: the rung is a real remedy
    smaller = Judge(80 * 2**30).predict(VLM, k.replace(max_pixels=200_704))
    assert smaller is not None and smaller.peak_bytes < judged.peak_bytes


def test_gemma3s_budget_counts_whole_images():
    spec = load_model_spec(GEMMA)
    tile = spec.vision.image_size ** 2
    facts = RunFacts(images_per_prompt=1, pixel_budget_floor=tile)
    assert images_of(spec, facts, TRL_DEFAULTS).per_prompt == 1  # the processor's own: one image, no crop
    assert images_of(spec, facts, TRL_DEFAULTS.replace(max_pixels=5 * tile)).per_prompt == 5  # 4 pan-and-scan crops


def test_what_the_user_says_beyond_the_knobs_reaches_the_estimate():
    spec = load_model_spec(QWEN_VL)
    facts = VLM.replace(freeze_vision=True, lora_target_parameters=["mlp.experts.gate_up_proj"], keep_mxfp4=False)
    got = fed(spec, facts, TRL_DEFAULTS)
    assert got["freeze_vision"] and got["lora_target_parameters"] == ("mlp.experts.gate_up_proj",)
    full = TRL_DEFAULTS.replace(dtype="bfloat16")
    frozen, trained = Judge(80 * 2**30).predict(facts, full), Judge(80 * 2**30).predict(VLM, full)
    assert frozen is not None and trained is not None
    assert frozen.trainable_params == trained.trainable_params - spec.vision_params


# -- the training process: the dataset's images, the processor, the model ------------------------------------------

def test_the_dataset_images_are_measured_as_grpo_trainer_reads_them():
    from datasets import Dataset

    one = Dataset.from_list([{"prompt": "a", "image": _image(30, 40)}, {"prompt": "b", "image": _image(90, 20)},
                             {"prompt": "c", "image": _image(50, 50)}])
    assert image_facts(one) == {"images_per_prompt": 1, "image_height": 50, "image_width": 50}
    assert largest_image_row(one) == 2
    many = Dataset.from_list([{"prompt": "a", "images": [_image(10, 10)]},
                              {"prompt": "b", "images": [_image(10, 10), _image(64, 32), _image(8, 8)]}])
    assert image_facts(many) == {"images_per_prompt": 3, "image_height": 64, "image_width": 32,
                                 "prompt_image_sizes": ((10, 10), (64, 32), (8, 8))}
    assert image_facts(Dataset.from_list([{"prompt": "a"}])) == {} and largest_image_row(many) == 1
    paired = with_images_of(one, [0, 0], donor=2)  # the probe: the longest prompt with the largest image
    assert paired["prompt"] == ["a", "a"] and [im.size for im in paired["image"]] == [(50, 50), (50, 50)]


def _in_messages(rows: list[list]) -> object:
    """A dataset whose images are content parts of the prompt's message (``{"type": "image", "image": ...}``), with
    the nested Image feature a chat dataset declares."""
    from datasets import Dataset, Features, List, Value
    from datasets import Image as ImageFeature

    part = {"type": Value("string"), "image": ImageFeature(), "text": Value("string")}
    features = Features({"prompt": List({"role": Value("string"), "content": List(part)})})
    return Dataset.from_list([{"prompt": [{"role": "user", "content": [
        *({"type": "image", "image": im, "text": None} for im in images),
        {"type": "text", "image": None, "text": text}]}]} for text, images in rows], features=features)


def test_images_in_the_prompts_messages_are_found_as_grpo_trainer_finds_them():
    """Images as content parts of the prompt's messages (no image column): GRPOTrainer's ``_tokenize_prompts``
    collects them, and so do the facts: several per prompt, the largest by its pixels, read without decoding."""
    data = _in_messages([("a", [_image(30, 40)]), ("b", [_image(10, 10), _image(64, 32)]), ("c", [])])
    assert image_facts(data) == {"images_per_prompt": 2, "image_height": 64, "image_width": 32,
                                 "prompt_image_sizes": ((10, 10), (64, 32))}
    assert largest_image_row(data) == 1
    paired = with_images_of(data, [0, 0], donor=1)  # the probe: the longest prompt with the largest image
    (part,) = [c for c in paired[0]["prompt"][0]["content"] if c["type"] == "image"]
    assert part["image"].size == (32, 64) and paired[0]["prompt"][0]["content"][-1]["text"] == "a"
    text_only = _in_messages([("a", [])])
    assert image_facts(text_only) == {}


def test_images_are_found_past_text_only_first_rows_and_several_count_as_their_own_pixels():
    """A dataset that opens with text-only prompts still has images (found in any measured row, not the first 8); a
    prompt with images of different sizes counts its own pixels (the heaviest prompt's), not its count times the
    largest image, so the memory model does not predict three of the largest where one is large."""
    from datasets import Dataset

    late = _in_messages([*((f"t{i}", []) for i in range(10)), ("img", [_image(48, 48)])])
    assert image_facts(late) == {"images_per_prompt": 1, "image_height": 48, "image_width": 48}
    text = [{"type": "text", "text": "?", "image": None}]
    by_path = Dataset.from_list([*({"prompt": [{"role": "user", "content": text}]} for _ in range(10)),
                                 {"prompt": [{"role": "user", "content": [{"type": "image", "image": "x.png",
                                                                          "text": None}]}]}])
    assert image_facts(by_path) == {"images_per_prompt": 1}  # an image part whose size cannot be read is still one
    mixed = _in_messages([("a", [_image(64, 64), _image(16, 16), _image(16, 32)]), ("b", [_image(32, 32)])])
    assert image_facts(mixed) == {"images_per_prompt": 3, "image_height": 64, "image_width": 64,
                                  "prompt_image_sizes": ((64, 64), (16, 16), (16, 32))}


def test_the_processor_budget_is_read_and_set_where_each_processor_keeps_it():
    from transformers import Gemma3ImageProcessorPil, Qwen2VLImageProcessorPil

    qwen = SimpleNamespace(image_processor=Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=448 * 448))
    assert pixel_budget(qwen) == {"image_processor": "Qwen2VLImageProcessorPil", "max_pixels": 200_704,
                                  "pixel_budget_floor": 3136}
    assert set_pixel_budget(qwen, 224 * 224)
    grid = qwen.image_processor(images=[_image(448, 448)])["image_grid_thw"].tolist()
    assert grid == [[1, 16, 16]]  # 224 x 224 after the resize: a quarter of the tokens
    gemma = SimpleNamespace(image_processor=Gemma3ImageProcessorPil(size={"height": 896, "width": 896}))
    assert pixel_budget(gemma)["max_pixels"] == pixel_budget(gemma)["pixel_budget_floor"] == 896 * 896
    gemma.image_processor.do_pan_and_scan = True
    assert pixel_budget(gemma)["max_pixels"] == 5 * 896 * 896  # one image and four crops
    set_pixel_budget(gemma, 3 * 896 * 896)
    assert gemma.image_processor.pan_and_scan_max_num_crops == 2
    set_pixel_budget(gemma, 896 * 896)
    assert gemma.image_processor.do_pan_and_scan is False
    assert pixel_budget(SimpleNamespace(image_processor=object())) == {"image_processor": "object"}
    assert pixel_budget(object()) == {} and not set_pixel_budget(object(), 1000)


def test_oomguards_budget_is_set_on_the_processor_and_the_users_observed():
    from transformers import Qwen2VLImageProcessorPil

    from oomguard.child.trainer import budget_facts

    seen: dict = {}
    rt = SimpleNamespace(observe=lambda v: [seen.setdefault(k, x) for k, x in v.items()],
                         overrides=Knobs(max_pixels=100_352))
    processor = SimpleNamespace(image_processor=Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=401_408))
    facts = budget_facts(rt, processor)
    assert seen == {"max_pixels": 401_408}  # the script's own, for the diff
    assert facts == {"image_processor": "Qwen2VLImageProcessorPil", "pixel_budget_floor": 3136}
    assert pixel_budget(processor)["max_pixels"] == 100_352


def test_a_processors_prompts_are_counted_by_its_tokenizer_without_images():
    sys.path.insert(0, str(BENCH))
    from family_calibrate import vlm_processor

    processor = vlm_processor(2048)
    prompt = [{"role": "user", "content": "w5 w6 w7"}]
    # the template's 5 tokens and the text's 3; each image's tokens are the memory model's to add
    assert prompt_lengths([prompt], processor) == [8]


def test_the_budget_oomguard_sets_holds_for_the_run_and_checkpoints_save_the_users_processor(tmp_path):
    """Trainer saves processing_class with each checkpoint: the preprocessor_config.json it writes keeps the user's
    budget, while the processor goes on with oomguard's (a Qwen2.5-VL processor, as the tiny VLM's; Gemma 3's)."""
    from transformers import AutoImageProcessor, Gemma3ImageProcessorPil

    sys.path.insert(0, str(BENCH))
    from family_calibrate import vlm_processor

    processor = vlm_processor(2048, max_pixels=448 * 448)
    assert set_pixel_budget(processor, 224 * 224)
    # what ProcessorMixin.save_pretrained writes beside the tokenizer when Trainer._save saves processing_class (this
    # image-only processor has no video processor for save_pretrained to walk)
    processor.to_json_file(tmp_path / "processor_config.json")
    saved = json.loads((tmp_path / "processor_config.json").read_text())["image_processor"]
    assert saved["size"]["longest_edge"] == 448 * 448 and "_oomguard_users" not in saved
    assert pixel_budget(processor)["max_pixels"] == 224 * 224  # still oomguard's for the rest of the run
    grid = processor.image_processor(images=[_image(448, 448)])["image_grid_thw"].tolist()
    assert grid == [[1, 16, 16]]
    processor.image_processor.save_pretrained(tmp_path / "ip")
    reloaded = AutoImageProcessor.from_pretrained(tmp_path / "ip")
    assert pixel_budget(SimpleNamespace(image_processor=reloaded))["max_pixels"] == 448 * 448

    gemma = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, do_pan_and_scan=True,
                                    pan_and_scan_max_num_crops=4)
    set_pixel_budget(SimpleNamespace(image_processor=gemma), 3 * 896 * 896)
    set_pixel_budget(SimpleNamespace(image_processor=gemma), 896 * 896)  # a second rung: the user's stay the first
    assert gemma.do_pan_and_scan is False and gemma.pan_and_scan_max_num_crops == 2
    gemma.save_pretrained(tmp_path / "gemma")
    saved = json.loads((tmp_path / "gemma" / "preprocessor_config.json").read_text())
    assert (saved["do_pan_and_scan"], saved["pan_and_scan_max_num_crops"]) == (True, 4)


def test_what_the_model_and_peft_config_say():
    class Param:
        def __init__(self, grad: bool) -> None:
            self.requires_grad = grad

    class Model:
        def __init__(self, vision_grad: bool) -> None:
            self.params = [("model.visual.blocks.0.attn.qkv.weight", Param(vision_grad)),
                           ("model.language_model.layers.0.q_proj.weight", Param(True))]

        def named_parameters(self):
            return iter(self.params)

        def modules(self):
            return iter([type("Mxfp4GptOssExperts", (), {})()])

    assert vision_frozen(Model(False)) and not vision_frozen(Model(True))
    peft = Model(False)
    peft.peft_config = {}
    assert not vision_frozen(peft)  # LoRA: the tower's adapters follow the target modules
    assert keeps_mxfp4(Model(True))
    assert target_parameters(SimpleNamespace(target_parameters=["mlp.experts.gate_up_proj"])) == (
        "mlp.experts.gate_up_proj",)
    assert target_parameters(SimpleNamespace()) == ()


# -- oomguard plan --------------------------------------------------------------------------------------------------

def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomguard", "plan", *args], capture_output=True, text=True)


def test_plan_takes_a_vision_language_models_images():
    base = ("--model", str(QWEN_VL), "--gpu", "24GiB", "dtype=bfloat16", "lora_r=16", "--json")
    text = json.loads(_plan(*base, "--images-per-prompt", "0").stdout)
    two = json.loads(_plan(*base, "--images-per-prompt", "2", "--image-size", "1080x1920").stdout)
    smaller = json.loads(_plan(*base, "--images-per-prompt", "2", "--image-size", "1080x1920",
                               "max_pixels=401408").stdout)
    assert two["images"] == {"images_per_prompt": 2, "image_height": 1080, "image_width": 1920}
    assert text["peak_bytes"] < smaller["peak_bytes"] < two["peak_bytes"]
    bad = _plan(*base, "--image-size", "1080")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "oomguard: --image-size takes HEIGHTxWIDTH in pixels, e.g. 1080x1920, not '1080'"]
    dense = _plan("--model", str(MODELS / "qwen3-8b"), "--gpu", "24GiB", "--images-per-prompt", "1")
    assert dense.returncode == 2 and "not a vision-language model" in dense.stderr
    assert len(dense.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--images-per-prompt", "--image-size"])
def test_plan_help_documents_the_image_options(flag):
    out = _plan("--help")
    assert flag in out.stdout
