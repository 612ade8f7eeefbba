"""Function calling in `kiln serve-model` (evaluation/tools.py), through the openai client: the
tools reach the prompt as transformers' `apply_chat_template` renders them; a named function's
arguments, and `required`'s calls, follow the tools' schemas; `auto` reads the calls a model
writes in its template's Hermes tags; streamed calls add up to the calls without streaming; a
conversation goes on with the calls and the tools' answers. The model is random (a byte-level BPE
with ChatML's and Hermes' tokens, a template in the manner of Qwen2.5's, written here), so the
schemas and the parser, not the model, make the calls."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import jax
import pytest
from tokenizers import Tokenizer

from evaluation.generate import Model
from evaluation.server import Service
from tests.test_hf_import import hf, tokenizer_folder  # noqa: F401  (a fixture)
from tests.test_serve_model import serving
from training.config import ModelConfig
from training.model import init_params

NAME = "hermes-tiny"
# Hermes' way, as Qwen2.5's template has it (written here): the tools in a system turn inside
# <tools>, each call in <tool_call> tags, a tool's answer in a user turn inside <tool_response>
HERMES = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}You may call these functions:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall one as <tool_call>\n{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' or (m['role'] == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for call in m.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3.1's way (written here): the tools before the last user message, a call as the whole
# assistant turn in JSON with "parameters", a tool's answer in an `ipython` turn
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{% for call in m.tool_calls %}"
    "{\"name\": \"{{ call.function.name }}\", \"parameters\": {{ call.function.arguments | tojson }}}"
    "{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{% if tools and loop.last %}Call a function "
    "as {\"name\": name, \"parameters\": arguments}: {% for t in tools %}{{ t | tojson }} {% endfor %}\n\n"
    "{% endif %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Mistral's way (written here): the tools before the last user turn, the calls as `[TOOL_CALLS]`
# and a JSON array, each with an id of nine letters and digits (the template refuses others), a
# tool's answer in `[TOOL_RESULTS]`
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for call in m.tool_calls %}"
    "{% if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}, "
    "\"id\": \"{{ call.id }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m['content'] | tojson }}, \"call_id\": "
    "\"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]


def follows(call, tool: dict = None) -> dict:
    """The call's arguments, checked against its tool's schema (the tool it names, or `tool`)."""
    tool = tool or next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    schema = tool["function"]["parameters"]
    assert set(arguments) == set(schema["required"]), arguments
    for key, value in arguments.items():
        rule = schema["properties"][key]
        if "enum" in rule:
            assert value in rule["enum"]
        elif rule["type"] == "string":
            assert isinstance(value, str) and 1 <= len(value) <= 10
        else:
            assert isinstance(value, int) and 0 <= value <= 99
    return arguments


@pytest.fixture(scope="module")
def hermes(tmp_path_factory) -> Model:
    """A random model whose tokenizer has ChatML's turn tokens, Hermes' call tags, the thought
    tags (tests/test_reasoning.py) and Mistral's call token, with HERMES."""
    folder = tokenizer_folder(tmp_path_factory.mktemp("hermes"), {"eos_token": "</s>", "bos_token": "<s>",
                                                                  "chat_template": HERMES})
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])  # plain, as Qwen3's: answers show them
    tokenizer.add_special_tokens(["[TOOL_CALLS]"])  # special, as Mistral's: not in an answer's text
    tokenizer.save(str(folder / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=1536,
                      init_std=0.05)
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(0)), tokenizer, eos_id=tokenizer.token_to_id("</s>"),
                 bos_id=tokenizer.token_to_id("<s>"), end_ids=(tokenizer.token_to_id("<|im_end|>"),),
                 chat_template=HERMES, template_tokens={"eos_token": "</s>", "bos_token": "<s>"})


@pytest.fixture(scope="module")
def client(hermes):
    from openai import OpenAI

    with serving(Service(hermes, NAME, max_batch=4)) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url


def streamed(client, **ask) -> list[dict]:
    """The stream's choice deltas, each choice's in order: [(delta, finish_reason)] per choice."""
    choices: dict[int, list] = {}
    for chunk in client.chat.completions.create(model=NAME, stream=True, **ask):
        for choice in chunk.choices:
            choices.setdefault(choice.index, []).append((choice.delta, choice.finish_reason))
    return [choices[i] for i in sorted(choices)]


def test_tools_and_past_calls_reach_the_prompt_as_transformers_renders_them(hermes, client, hf, tmp_path):  # noqa: F811
    """The tools and a conversation with a call and its answer in it: /tokenize and the chat
    completion's prompt are transformers' `apply_chat_template` ids, and the tools are in them."""
    _, transformers = hf
    openai, url = client
    folder = tokenizer_folder(tmp_path, {"eos_token": "</s>", "bos_token": "<s>", "chat_template": HERMES,
                                         "tokenizer_class": "PreTrainedTokenizerFast"})
    hermes.tokenizer.save(str(folder / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "c"}'}}
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, rain"},
                    {"role": "user", "content": "And in Rome?"}]
    # transformers' form: the call's arguments an object, content text
    as_theirs = [{**m, "content": m["content"] or "", **({"tool_calls": [
        {**call, "function": {**call["function"], "arguments": {"city": "Paris", "unit": "c"}}}]}
        if "tool_calls" in m else {})} for m in conversation]
    for messages, ours in ((ASK, ASK), (as_theirs, conversation)):
        expected = theirs.apply_chat_template(messages, tools=TOOLS, tokenize=True, add_generation_prompt=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        r = httpx.post(f"{url}/tokenize", json={"messages": ours, "tools": TOOLS})
        assert r.status_code == 200 and r.json()["tokens"] == expected, r.text
        done = openai.chat.completions.create(model=NAME, messages=ours, tools=TOOLS, tool_choice="none",
                                              max_tokens=2)
        assert done.usage.prompt_tokens == len(expected)
    assert '"name": "get_weather"' in hermes.tokenizer.decode(expected)  # the tools are in the prompt
    assert "<tool_response>\n18 degrees, rain" in hermes.tokenizer.decode(expected)
    without = httpx.post(f"{url}/tokenize", json={"messages": ASK}).json()["tokens"]
    assert len(without) < len(expected) - 50


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    openai, _ = client
    ask = {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 1.0, "seed": 5, "n": 4,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    done = openai.chat.completions.create(model=NAME, **ask)
    calls = []
    for choice in done.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        assert len(choice.message.tool_calls) == 1
        calls.append(choice.message.tool_calls[0])
        follows(calls[-1])
    assert len({c.id for c in calls}) == 4 and len({c.function.arguments for c in calls}) > 1
    # the same draws without the tools' grammar are no such call
    free = openai.chat.completions.create(model=NAME, **{**ask, "tool_choice": "none"})
    for choice in free.choices:
        assert choice.message.tool_calls is None and choice.message.content
        with pytest.raises((ValueError, AssertionError, AttributeError, TypeError)):
            assert set(json.loads(choice.message.content)) == {"city", "unit"}
    # streamed: the first delta names the call, the arguments' pieces add up to the arguments
    for choice, deltas in zip(done.choices, streamed(openai, **ask)):
        pieces = [d.tool_calls for d, _ in deltas if d.tool_calls]
        assert pieces[0][0].id.startswith("call_") and pieces[0][0].function.name == "get_weather"
        assert all(p[0].index == 0 and p[0].function.name is None for p in pieces[1:])
        assert "".join(p[0].function.arguments for p in pieces) == choice.message.tool_calls[0].function.arguments
        assert len(pieces) > 3 and deltas[-1][1] == "stop" and not any(d.content for d, _ in deltas)


def test_required_calls_tools_each_held_to_its_schema(client):
    openai, _ = client
    ask = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 1.0,
           "seed": 11, "n": 6}
    one = openai.chat.completions.create(model=NAME, parallel_tool_calls=False, **ask)
    names = []
    for choice in one.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        names.append(choice.message.tool_calls[0].function.name)
        follows(choice.message.tool_calls[0])
    assert set(names) == {"get_weather", "add"}, names
    several = openai.chat.completions.create(model=NAME, **ask)
    counts = []
    for choice in several.choices:
        assert choice.finish_reason == "tool_calls", choice
        counts.append(len(choice.message.tool_calls))
        for call in choice.message.tool_calls:
            follows(call)
    assert min(counts) >= 1 and max(counts) > 1, counts
    # streamed: the calls come whole in each choice's last chunk, the same as without streaming
    for choice, deltas in zip(several.choices, streamed(openai, **ask)):
        assert not any(d.content for d, _ in deltas) and deltas[-1][1] == "tool_calls"
        (last, _), = [(d, f) for d, f in deltas if d.tool_calls]
        assert [(c.index, c.function.name, c.function.arguments) for c in last.tool_calls] == [
            (i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]


def hermes_call(text: str) -> str:
    """A regex of exactly `text` (structured_outputs holds an answer to it)."""
    return re.escape(text).replace("\\\n", "\\n")


def test_auto_reads_the_calls_the_model_writes_in_its_templates_tags(client, hermes):
    """The model's own Hermes tags, held to a text by a regex (a random model writes none of its
    own): the text before them is the content, the calls are read from them; a call that does not
    parse stays text; free text is content; the conversation goes on with the call and its answer."""
    openai, url = client
    written = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>')
    ask = {"messages": ASK, "tools": TOOLS, "max_tokens": 100, "temperature": 1.0, "seed": 2}
    forced = {"structured_outputs": {"regex": hermes_call(written)}}
    done = openai.chat.completions.create(model=NAME, extra_body=forced, **ask)  # tool_choice: auto, by default
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n", choice
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    deltas = streamed(openai, extra_body=forced, **ask)[0]
    assert "".join(d.content or "" for d, _ in deltas) == "Let me look.\n" and deltas[-1][1] == "tool_calls"
    (last, _), = [(d, f) for d, f in deltas if d.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in last.tool_calls] == [
        ("get_weather", call.function.arguments)]

    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city"'  # a call that does not parse: text
    for text in (cut, "It rains."):
        done = openai.chat.completions.create(model=NAME, extra_body={"structured_outputs": {
            "regex": hermes_call(text)}}, **ask)
        assert done.choices[0].message.content == text and done.choices[0].message.tool_calls is None
        assert done.choices[0].finish_reason == "stop"
        deltas = streamed(openai, extra_body={"structured_outputs": {"regex": hermes_call(text)}}, **ask)[0]
        assert "".join(d.content or "" for d, _ in deltas) == text and deltas[-1][1] == "stop"
    free = openai.chat.completions.create(model=NAME, **{**ask, "max_tokens": 12}).choices[0]
    assert free.message.tool_calls is None and free.finish_reason in ("stop", "length") and free.message.content

    # the next turn: the call as the client got it, and the tool's answer
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, rain"}]
    tokens = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    after = openai.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=4)
    assert after.usage.prompt_tokens == len(tokens)
    rendered = hermes.tokenizer.decode(tokens, skip_special_tokens=False)
    assert written + "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 degrees, rain" in rendered, rendered


def test_auto_reads_llama_31s_json_calls(hermes):
    """Llama 3.1's format: calls as the whole answer, JSON objects with "parameters" joined by
    `;`, read into tool calls; text, or a call cut short, is content; streamed, an answer that
    starts as JSON is held and comes whole in the last chunk, text streams."""
    from openai import OpenAI

    from evaluation.tools import call_format
    from tests.test_hf_import import CHATML

    assert (call_format(HERMES), call_format(LLAMA3), call_format(CHATML)) == ("hermes", "llama3_json", None)
    llama = dataclasses.replace(hermes, chat_template=LLAMA3)
    with serving(Service(llama, NAME, max_batch=2)) as url:
        openai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = {"messages": ASK, "tools": TOOLS, "max_tokens": 100, "seed": 4}
        two = '{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
        forced = {"structured_outputs": {"regex": hermes_call(two)}}
        choice = openai.chat.completions.create(model=NAME, extra_body=forced, **ask).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Rome"})]
        deltas = streamed(openai, extra_body=forced, **ask)[0]
        assert not any(d.content for d, _ in deltas) and deltas[-1][1] == "tool_calls"
        assert [c.function.arguments for c in deltas[-1][0].tool_calls] == [
            c.function.arguments for c in choice.message.tool_calls]
        for text in ('{"name": "add", "parameters": {"a": 2', "It rains; {\"a\": 1}"):
            regex = {"structured_outputs": {"regex": hermes_call(text)}}
            choice = openai.chat.completions.create(model=NAME, extra_body=regex, **ask).choices[0]
            assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
            deltas = streamed(openai, extra_body=regex, **ask)[0]
            pieces = [d.content for d, _ in deltas if d.content]
            assert "".join(pieces) == text and deltas[-1][1] == "stop"
            assert (len(pieces) == 1) == text.startswith("{")  # held whole, or streamed piece by piece
        prompt = httpx.post(f"{url}/tokenize", json={"messages": ASK, "tools": TOOLS}).json()["tokens"]
        assert '"name": "get_weather"' in llama.tokenizer.decode(prompt)  # the tools reached the prompt


def test_auto_reads_mistrals_calls_and_gives_them_ids_its_template_takes_back(hermes):
    """Mistral's format: `[TOOL_CALLS]` (a special token, so not in the answer's text) and a JSON
    array of calls; each call gets an id of nine letters and digits, which Mistral's templates
    require when the call comes back in the conversation, as it does here."""
    from openai import OpenAI

    from evaluation.tools import call_format

    assert call_format(MISTRAL) == "mistral"
    mistral = dataclasses.replace(hermes, chat_template=MISTRAL)
    with serving(Service(mistral, NAME, max_batch=2)) as url:
        openai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = {"messages": ASK[1:], "tools": TOOLS, "max_tokens": 100, "seed": 4}
        written = ('[{"name": "add", "arguments": {"a": 2, "b": 3}}, '
                   '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
        forced = {"structured_outputs": {"regex": hermes_call(written)}}
        choice = openai.chat.completions.create(model=NAME, extra_body=forced, **ask).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Rome"})]
        assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in choice.message.tool_calls)
        deltas = streamed(openai, extra_body=forced, **ask)[0]
        assert not any(d.content for d, _ in deltas) and deltas[-1][1] == "tool_calls"
        named = openai.chat.completions.create(model=NAME, **{**ask, "tool_choice": "required", "max_tokens": 200})
        assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in named.choices[0].message.tool_calls)
        # the next turn: the calls as the client got them, each tool's answer; the template takes the ids back
        messages = [*ASK[1:], choice.message.model_dump(exclude_none=True),
                    *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in choice.message.tool_calls)]
        tokens = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
        after = openai.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=4)
        assert after.usage.prompt_tokens == len(tokens)
        text = mistral.tokenizer.decode(tokens, skip_special_tokens=False)
        assert f'"id": "{choice.message.tool_calls[0].id}"' in text and '[TOOL_RESULTS]{"content": "5"' in text


def test_auto_reads_hermes_tags_that_are_special_tokens(hermes, tmp_path):
    """Hermes 3 marks `<tool_call>` special, so the answer's text would leave it out (skip_special_tokens):
    for `auto` the server keeps special tokens in the text, as vLLM's parser does, and reads the call."""
    from openai import OpenAI

    folder = tokenizer_folder(tmp_path, {})
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))  # the same ids as the fixture's; the tags special
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])
    tokenizer.add_tokens(["<think>", "</think>"])
    assert [tokenizer.token_to_id(t) for t in ("<tool_call>", "</think>")] == [
        hermes.tokenizer.token_to_id(t) for t in ("<tool_call>", "</think>")]
    with serving(Service(dataclasses.replace(hermes, tokenizer=tokenizer), NAME, max_batch=2)) as url:
        openai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        call = '"\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 2, \\"b\\": 3}}\\n"'
        grammar = f'start: "Let me add." <tool_call> {call} </tool_call>\n'  # special tokens, as Lark names them
        ask = {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "seed": 2,
               "extra_body": {"structured_outputs": {"grammar": grammar}}}
        choice = openai.chat.completions.create(model=NAME, **ask).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add.", choice
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
        plain = openai.chat.completions.create(model=NAME, **{**ask, "tools": None}).choices[0]
        assert plain.message.content == 'Let me add.\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'  # tags left out
