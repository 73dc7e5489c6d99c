"""The prompts as GRPOTrainer builds them (issue 46, point 1): their length is measured through the trainer's own
construction (its tools' schemas through the chat template, the training template TRL picks for tools, the config's
chat_template_kwargs, the system prompt in the data, a processor's content blocks), for the longest rows; what cannot
be measured is said and makes the model unsure. The end-to-end proof (a tool-calling script's prompts measured as the
trainer itself tokenizes them, predicted within 5%) is tests/test_facts_e2e.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.child.datasets import prepare_dataset, prompt_lengths
from oomguard.child.prompts import (
    CANDIDATES,
    Construction,
    check_built,
    construction_for,
    measure_longest,
    text_only,
)
from oomguard.child.runtime import Runtime
from oomguard.vocab.events import DatasetSeen, read_events
from oomguard.vocab.protocol import Plan

# a ChatML template that renders the tools' schemas in the system turn, as released models' templates do
TEMPLATE = ("{%- if tools %}<|im_start|> system {% for t in tools %}{{ t | tojson }} {% endfor %}<|im_end|> {% endif %}"
            "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% if verbose %}think step by step {% endif %}"
            "{% endif %}")


def tokenizer(template: str = TEMPLATE):
    """A tokenizer whose every whitespace-separated piece is one token, so that lengths are countable by eye."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "<eos>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    out.chat_template = template
    return out


def byte_tokenizer(template: str):
    """A tokenizer of one token per byte: any difference in the rendered text is a difference in the tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="!")
    out.chat_template = template
    return out


def lookup(city: str) -> str:
    """
    Look a city up.

    Args:
        city: The city's name.
    """
    return city


def chat(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def runtime(tmp: Path) -> Runtime:
    return Runtime(Plan(events=str(tmp / "events.jsonl")))


def seen(tmp: Path) -> list[DatasetSeen]:
    return [e for e in read_events(tmp / "events.jsonl") if isinstance(e, DatasetSeen)]


def test_the_tools_schemas_and_the_config_s_template_arguments_are_counted():
    tok = tokenizer()
    prompt = chat("what is the weather in Paris", system="you are terse")
    plain = prompt_lengths([prompt], tok)[0]  # the tokenizer's template alone: what oomguard measured before
    args = SimpleNamespace(chat_template_kwargs={"verbose": True})
    c, why = Construction.from_arguments({"processing_class": tok, "tools": [lookup]}, args, "model")
    assert why is None and c.tools == [lookup] and c.kwargs == {"verbose": True}
    (n,) = c.lengths([prompt])
    expected = tok.apply_chat_template([prompt], tools=[lookup], add_generation_prompt=True, tokenize=True,
                                       return_dict=True, verbose=True)["input_ids"][0]
    assert n == len(expected) and n > plain + 10  # the schema, and "think step by step"
    # the system turn in the data counts too: its 3 words and the turn's 3 tokens
    assert n - c.lengths([chat("what is the weather in Paris")])[0] == 6


def test_tools_with_a_template_that_is_not_prefix_preserving_take_trls_training_template():
    from trl.chat_template_utils import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        qwen3_chat_template,
    )

    tok = byte_tokenizer(qwen3_chat_template)
    assert not is_chat_template_prefix_preserving(tok)
    c, _ = Construction.from_arguments({"processing_class": tok, "tools": [lookup]}, SimpleNamespace(), "m")
    assert c.chat_template == get_training_chat_template(tok) is not None
    no_tools, _ = Construction.from_arguments({"processing_class": tok}, SimpleNamespace(), "m")
    assert no_tools.chat_template is None and not no_tools.tools  # TRL 0.29 passes [], TRL 1.x None
    prompt = chat("how far is Lima")
    assert c.lengths([prompt])[0] > no_tools.lengths([prompt])[0] + 20


def test_a_processors_prompts_are_content_blocks_without_their_images():
    part = {"type": "image", "image": object()}
    assert text_only([{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], blocks=False) == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert text_only("a plain prompt", blocks=True) == "a plain prompt"


def test_a_plain_text_prompt_is_what_the_processing_class_makes_of_it():
    c = Construction(tokenizer())
    assert c.lengths(["one two three", "four"]) == [3, 1]


def test_the_longest_rows_are_measured_exactly_and_the_rest_shifted_by_the_largest_difference():
    prompts = [chat(" ".join(["w"] * n)) for n in range(1, 40)]
    cheap = prompt_lengths(prompts, tokenizer())
    m = measure_longest(prompts, cheap, Construction(tokenizer(), tools=[lookup]))
    assert len(m.rows) == CANDIDATES and m.rows[0] == 38 and m.longest == 38
    assert m.most == cheap[38] + m.offset and m.offset > 10
    assert measure_longest(prompts, cheap, None) is None


def test_the_dataset_event_carries_the_trainers_lengths_and_max_prompt_tokens_drops_by_them(tmp_path):
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": chat(" ".join(["w"] * n))} for n in (3, 5, 30)])
    tok = tokenizer()
    c = Construction(tok, tools=[lookup])
    rt = runtime(tmp_path)
    prepare_dataset(rt, data, tok, "m", construction=c)
    (ev,) = seen(tmp_path)
    exact = c.lengths(list(data["prompt"]))
    assert ev.prompt_tokens_max == max(exact) and rt.facts()["prompt_tokens_max"] == max(exact)
    limit = exact[1]  # the cheap count of every row is under it; the trainer's count of the longest is not
    assert prompt_lengths(list(data["prompt"]), tok)[2] < limit < exact[2]
    rt2 = Runtime(Plan(events=str(tmp_path / "b.jsonl"), overrides={"max_prompt_tokens": limit}))
    kept = prepare_dataset(rt2, data, tok, "m", construction=c)
    assert len(kept) == 2


def test_a_dataset_that_cannot_be_measured_is_said(tmp_path):
    from datasets import Dataset

    rt = runtime(tmp_path)
    prepare_dataset(rt, Dataset.from_list([{"prompt": "a b"}]).to_iterable_dataset(), tokenizer(), "m")
    (line,) = rt.facts()["unobserved"]
    assert "IterableDataset" in line and "256 tokens" in line
    construction_for(rt, {"processing_class": tokenizer(), "environment_factory": object}, SimpleNamespace(), "m")
    assert len(rt.facts()["unobserved"]) == 3  # the environments' tools, and their prompts without a dataset


def test_tools_the_template_cannot_render_are_said_and_the_tokenizers_template_measures(tmp_path):
    from datasets import Dataset

    tok = tokenizer("{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
                    "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    rt = runtime(tmp_path)
    prepare_dataset(rt, Dataset.from_list([{"prompt": chat("a b c")}]), tok, "m",
                    construction=Construction(tok, tools=[lookup]))
    (line,) = rt.facts()["unobserved"]
    assert line.startswith("the prompts as GRPOTrainer builds them (TemplateError: no tools here)")
    assert seen(tmp_path)[0].prompt_tokens_max == 3


def test_the_built_trainers_own_tokenization_corrects_a_length_measured_before_it(tmp_path):
    from datasets import Dataset

    tok = tokenizer()
    rt = runtime(tmp_path)
    prepare_dataset(rt, Dataset.from_list([{"prompt": chat("a b c")}]), tok, "m", construction=Construction(tok))
    before = seen(tmp_path)[-1].prompt_tokens_max
    same = SimpleNamespace(_tokenize_prompts=lambda ps: ([[0] * before], None, {}))
    check_built(rt, same)
    assert len(seen(tmp_path)) == 1 and "unobserved" not in rt.facts()
    longer = SimpleNamespace(_tokenize_prompts=lambda ps: ([list(range(before + 7))], None, {}))
    check_built(rt, longer)
    assert seen(tmp_path)[-1].prompt_tokens_max == before + 7 == rt.facts()["prompt_tokens_max"]
    assert f"({before + 7} tokens, {before} as measured before it was built)" in rt.facts()["unobserved"][0]


@pytest.mark.core
def test_the_construction_before_the_trainer_is_the_built_trainers_own(tmp_path, tiny_model):
    """Under each end of the supported range (tests/compat.sh runs the ``core`` tests under TRL 0.29.1): the lengths
    measured from GRPOTrainer's arguments before it is built are those its own ``_tokenize_prompts`` gives once it is,
    for a tool-calling config with ``chat_template_kwargs`` and a system prompt in the data."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = qwen3_chat_template
    prompts = [chat("the weather in Lima " * n, system="be brief") for n in (1, 3, 2)]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=8, report_to=[],
                      chat_template_kwargs={"enable_thinking": False})
    a = {"processing_class": tok, "tools": [lookup]}
    before, why = Construction.from_arguments(a, args, tiny_model)
    assert why is None
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), **a)
    built = Construction.from_trainer(trainer)
    assert before.lengths(prompts) == built.lengths(prompts)
    assert built.lengths(prompts) == [len(trainer._tokenize_prompts([p])[0][0]) for p in prompts]
    assert min(built.lengths(prompts)) > max(prompt_lengths(prompts, tok)) + 20  # the tool's schema
    # without tools: TRL 0.29 passes an empty list, TRL 1.x None, and Llama's template renders its tool boilerplate
    # for the one and not the other
    tok.chat_template = ("{% if tools is not none %}Environment: ipython tools {% endif %}"
                         "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    plain, _ = Construction.from_arguments({"processing_class": tok}, args, tiny_model)
    no_tools = GRPOTrainer(model=tiny_model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                           args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                           processing_class=tok)
    assert plain.lengths(prompts) == Construction.from_trainer(no_tools).lengths(prompts)
