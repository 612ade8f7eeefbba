"""A thinking template's answers in `kiln serve-model` (evaluation/reasoning.py): the thought
apart from the answer as the message's `reasoning`, streamed too, with tool calls read after it;
`chat_template_kwargs` reach the template as transformers passes them (Qwen3's enable_thinking).
The random model of tests/test_tool_calls.py, its answers held to texts by regexes."""

from __future__ import annotations

import dataclasses
import json
import random

import httpx
import pytest

from evaluation.reasoning import StreamedThought, split
from evaluation.server import Service
from tests.test_hf_import import hf, tokenizer_folder  # noqa: F401  (a fixture)
from tests.test_serve_model import serving
from tests.test_tool_calls import ASK, HERMES, NAME, TOOLS, hermes, hermes_call, streamed  # noqa: F401  (a fixture)

# In the manner of Qwen3's (written here): enable_thinking false puts an empty thought in the
# prompt; `open_thought`, a variable of this test's, opens one there, as DeepSeek-R1's template does
QWEN3 = HERMES.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% elif open_thought is defined and open_thought %}<think>\n{% endif %}{% endif %}")
CALL = '<tool_call>\n{"name": "add", "parameters": {"a": 2, "b": 3}}\n</tool_call>'.replace("parameters", "arguments")
# (the answer's text, a regex of which holds it, thought included; logit biases by token text; tools;
# reasoning (None: no field); content; finish_reason)
CASES = [
    ("<think>\nThe user asks about Paris.\n</think>\n\nIt rains.", {}, None, "The user asks about Paris.",
     "It rains.", "stop"),
    # a format without the tags holds what follows a free thought: here none, as no "<" can be drawn
    ("It rains.", {"<think>": -100, "<": -100}, None, None, "It rains.", "stop"),
    (f"<think>\nI should add.\n</think>\n\n{CALL}", {}, TOOLS, "I should add.", None, "tool_calls"),
]


@pytest.fixture(scope="module")
def thinking(hermes):  # noqa: F811
    from openai import OpenAI

    model = dataclasses.replace(hermes, chat_template=QWEN3)
    with serving(Service(model, NAME, max_batch=2)) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url, model


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_thought_comes_apart_from_the_answer(thinking, case):
    openai, _, model = thinking
    text, bias, tools, reasoning, content, finish = CASES[case]
    ask = {"messages": ASK, "max_tokens": 100, "seed": 3, **({"tools": tools} if tools else {}),
           "logit_bias": {str(model.tokenizer.token_to_id(t)): v for t, v in bias.items()},
           "extra_body": {"structured_outputs": {"regex": hermes_call(text)}}}
    choice = openai.chat.completions.create(model=NAME, **ask).choices[0]
    message = choice.message.model_dump()
    assert (message.get("reasoning"), message["content"], choice.finish_reason) == (reasoning, content, finish), message
    if tools:
        call, = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    deltas = [d.model_dump() for d, _ in streamed(openai, **ask)[0]]
    thoughts = [d["reasoning"] for d in deltas if d.get("reasoning")]
    pieces = [d["content"] for d in deltas if d.get("content")]
    assert ("".join(thoughts) or None, "".join(pieces) or None) == (reasoning, content)
    if reasoning and content:  # the thought streams piece by piece, and all of it before the answer
        last_thought = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
        assert len(thoughts) > 1 and last_thought < min(i for i, d in enumerate(deltas) if d.get("content"))
    if tools:
        assert [c["function"]["name"] for c in deltas[-1]["tool_calls"]] == ["add"]


def test_a_thought_the_prompt_opened_is_the_answers_start(thinking):
    """A template that opens the thought in its generation prompt: the answer is reasoning until
    it writes `</think>` (here it may not: all of it is); a format holds what follows the thought."""
    openai, _, model = thinking
    close = str(model.tokenizer.token_to_id("</think>"))
    ask = {"messages": ASK, "max_tokens": 12, "seed": 3, "logit_bias": {close: -100},
           "extra_body": {"chat_template_kwargs": {"open_thought": True}}}
    choice = openai.chat.completions.create(model=NAME, **ask).choices[0]
    message = choice.message.model_dump()
    assert message["content"] is None and message["reasoning"] and choice.finish_reason == "length", message
    free = openai.chat.completions.create(model=NAME, **{**ask, "logit_bias": None}).choices[0]  # it may close it
    assert free.message.model_dump()["reasoning"] and free.message.content  # this seed does, after 4 tokens
    deltas = [d.model_dump() for d, _ in streamed(openai, **ask)[0]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert not any(d.get("content") for d in deltas)
    # held to a regex, the answer thinks first (ending the thought soon: </think> made likely), then answers in it
    ask["extra_body"]["structured_outputs"], ask["logit_bias"], ask["max_tokens"] = {"regex": "Yes\\."}, {close: 8}, 40
    choice = openai.chat.completions.create(model=NAME, **ask).choices[0]
    assert choice.message.content == "Yes." and choice.finish_reason == "stop", choice
    assert "reasoning" in choice.message.model_dump()


def test_a_format_holds_the_answer_after_a_free_thought(thinking):
    """A JSON schema and a named function's arguments on a thinking template: the model may think
    first (<think> and </think> made likely here), and its answer after the thought follows the
    format; streamed, the thought and the call add up to the answer without streaming."""
    openai, _, model = thinking
    likely = {str(model.tokenizer.token_to_id(t)): 8 for t in ("<think>", "</think>")}
    ask = {"messages": ASK, "max_tokens": 80, "seed": 5, "logit_bias": likely}
    schema = {"name": "sum", "schema": TOOLS[1]["function"]["parameters"]}  # no strings for the tags to fill
    choice = openai.chat.completions.create(model=NAME, response_format={"type": "json_schema", "json_schema": schema},
                                            **ask).choices[0]
    # it thought (the field is there; this thought is empty, so null) and the content is the JSON alone
    assert "reasoning" in choice.message.model_dump() and choice.finish_reason == "stop", choice
    assert set(json.loads(choice.message.content)) == {"a", "b"}
    named = {**ask, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    choice = openai.chat.completions.create(model=NAME, **named).choices[0]
    call, = choice.message.tool_calls
    assert "reasoning" in choice.message.model_dump() and set(json.loads(call.function.arguments)) == {"a", "b"}
    deltas = [d for d, _ in streamed(openai, **named)[0]]
    assert "".join(d.model_dump().get("reasoning") or "" for d in deltas) == (choice.message.model_dump()["reasoning"]
                                                                              or "")
    assert "".join(c.function.arguments for d in deltas for c in d.tool_calls or []) == call.function.arguments


TEXTS = [("<think>\nThe user asks.\n</think>\n\nIt rains.", False), ("Because.\n</think>\n\nYes.", True),
         ("<think>\nStill thinking", False), ("Paris is rainy.", False), ("\n<think>a</think>b", False),
         ("  Paris <think> x", False), ("a </thi", True), ("<th", False), ("", True), ("<think></think>", False)]


@pytest.mark.parametrize("text, opened", TEXTS)
def test_a_streamed_thought_adds_up_to_the_whole_answers_parts(text, opened):
    """However the text is cut into pieces, the streamed parts join to `split`'s of the whole."""
    whole = split(text, opened)
    rng = random.Random(text)
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, parts = StreamedThought(opened), ["", ""]
        for i, piece in enumerate(pieces):
            for j, part in enumerate(stream.push(piece, last=i == len(pieces) - 1)):
                parts[j] += part
        assert tuple(parts) == (whole[0] or "", whole[1]), pieces
    assert split("<think>\nHm.\n</think>\n\nYes.", False) == ("Hm.", "Yes.")
    assert split("Because.</think>Yes.", True) == ("Because.", "Yes.")


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(thinking, hf, tmp_path):  # noqa: F811
    """enable_thinking false: the prompt holds an empty thought, as transformers renders it; the
    answer after it is content."""
    _, transformers = hf
    openai, url, model = thinking
    folder = tokenizer_folder(tmp_path, {"eos_token": "</s>", "bos_token": "<s>", "chat_template": QWEN3,
                                         "tokenizer_class": "PreTrainedTokenizerFast"})
    model.tokenizer.save(str(folder / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for variables in ({"enable_thinking": False}, {"enable_thinking": True}, {"open_thought": True}):
        expected = theirs.apply_chat_template(ASK, tokenize=True, add_generation_prompt=True, **variables)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        r = httpx.post(f"{url}/tokenize", json={"messages": ASK, "chat_template_kwargs": variables})
        assert r.status_code == 200 and r.json()["tokens"] == expected, r.text
    assert model.tokenizer.decode(expected, skip_special_tokens=False).endswith("assistant\n<think>\n")
    no_thought = {str(model.tokenizer.token_to_id(t)): -100 for t in ("<think>", "<")}  # a model may think anyway
    off = {"chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": "Yes\\."}}
    choice = openai.chat.completions.create(model=NAME, messages=ASK, max_tokens=8, logit_bias=no_thought,
                                            extra_body=off).choices[0]
    assert choice.message.model_dump().get("reasoning") is None and choice.message.content == "Yes."
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "are the request's own fields" in r.json()["error"]["message"], r.text
