"""Tool calls (function calling) for `kiln serve-model`'s chat completions: OpenAI's `tools` and
`tool_choice`, answered as vLLM answers them.

The tools reach the model through its chat template (the `tools` variable transformers'
`apply_chat_template` gives it; a template that never reads it, such as kiln's post-training
one, prompts without them). The answer becomes tool calls in one of three ways:

    a named function   the answer is that function's arguments, held to its `parameters` schema
                       (evaluation/structured.py): one call; finish_reason "stop", as vLLM's
    required           the answer is a JSON array of {"name", "parameters"} objects, each one of
                       the tools' (one at most with parallel_tool_calls false): the calls;
                       finish_reason "tool_calls"
    auto               the model answers freely, and the calls it writes in its template's own
                       format are read from its text (`FORMATS`): Hermes' `<tool_call>{"name": ...,
                       "arguments": {...}}</tool_call>` (Qwen2.5's, Qwen3's, Hermes' and
                       SmolLM3's templates), Llama 3.1's JSON, `{"name": ..., "parameters":
                       {...}}` (several joined by `;`) as the whole answer, or Mistral's
                       `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`; finish_reason
                       "tool_calls" when it called one

An answer whose calls do not parse (cut by max_tokens, or not JSON) comes back as the text it is,
with its own finish_reason, as vLLM gives it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Callable

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's, before a call (dropped from the text with skip_special_tokens)
TOOL_CALLS = "[TOOL_CALLS]"  # Mistral's, before its calls (a special token, which auto keeps in the text)

Read = tuple[str | None, list[dict]] | None  # (content, calls) in an answer's text; None: no calls that parse


def call_id(format: str | None = None) -> str:
    """A new call's id: OpenAI's kind, or nine letters and digits for Mistral's templates, which
    refuse any other id when the call comes back in the conversation."""
    if format == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def tool_call(name: str, arguments: str) -> dict:
    """One call as OpenAI's message gives it (`arguments`: the JSON object's text), its id given
    by `ToolChoice.message` or the stream."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _call(value: object, arguments_key: str) -> dict:
    """A call object a model wrote ({"name", arguments_key: {...}}) as OpenAI's; ValueError if it is none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
            value.get(arguments_key), dict):
        raise ValueError(f"not a call: {value!r:.80}")
    return tool_call(value["name"], json.dumps(value[arguments_key], ensure_ascii=False))


def read_hermes(text: str) -> Read:
    """Calls in `<tool_call>` tags; the text before the first is the content (None if only spacing)."""
    at = text.find(HERMES_OPEN)
    if at < 0:
        return None
    try:
        calls = [_call(json.loads(m.group(1)), "arguments") for m in _HERMES_CALL.finditer(text, at)]
    except ValueError:
        return None
    return (text[:at] if text[:at].strip() else None), calls


def hermes_content_end(text: str) -> int:
    """How much of a streamed answer is content for sure: up to a tag, or to a tail that may begin one."""
    at = text.find(HERMES_OPEN)
    if at >= 0:
        return at
    return len(text) - next((k for k in range(len(HERMES_OPEN) - 1, 0, -1) if text.endswith(HERMES_OPEN[:k])), 0)


def read_llama3(text: str) -> Read:
    """A whole answer of JSON calls (`{"name", "parameters"}`, several joined by `;`), no content."""
    body = text.strip().removeprefix(PYTHON_TAG).lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):
            value, at = decoder.raw_decode(body, at)
            calls.append(_call(value, "parameters"))
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    except ValueError:
        return None
    return (None, calls) if calls else None


def read_mistral(text: str) -> Read:
    """A whole answer of `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`, no content."""
    body = text.strip().removeprefix(TOOL_CALLS).lstrip()
    if not body.startswith("["):
        return None
    try:
        calls = [_call(value, "arguments") for value in json.loads(body)]
    except (ValueError, TypeError):
        return None
    return (None, calls) if calls else None


def held_whole(opening: str, tag: str) -> Callable[[str], int]:
    """How much of a streamed answer is content for sure, for a format whose calls are the whole
    answer: none of one that may be calls (it starts as `opening` or as `tag` would), all of any other."""
    def content_end(text: str) -> int:
        start = text.lstrip()
        return 0 if not start or start.startswith((opening, tag)) or tag.startswith(start) else len(text)
    return content_end


@dataclass(frozen=True)
class CallFormat:
    """How a family of chat templates writes tool calls: `mark`, text only such a template holds;
    `read`, the calls in an answer; `content_end`, how much of a streamed answer is surely content."""

    mark: str
    read: Callable[[str], Read]
    content_end: Callable[[str], int]


FORMATS = {"hermes": CallFormat(HERMES_OPEN, read_hermes, hermes_content_end),
           "llama3_json": CallFormat('"parameters": ', read_llama3, held_whole("{", PYTHON_TAG)),
           "mistral": CallFormat(TOOL_CALLS, read_mistral, held_whole("[", TOOL_CALLS))}


def call_format(template_source: str | None) -> str | None:
    """The format a chat template writes tool calls in, where kiln reads it (`FORMATS`, the
    first whose mark the template holds: Hermes' `<tool_call>` tag, Llama 3.1's `"parameters": `
    key, Mistral's `[TOOL_CALLS]`); None for any other."""
    return next((name for name, f in FORMATS.items() if template_source and f.mark in template_source), None)


@dataclass(frozen=True)
class ToolChoice:
    """What a request's `tools` and `tool_choice` ask of its answers. `functions`: OpenAI's
    function definitions ({"name", "description", "parameters"}); `choice`: "auto", "required"
    or a function's name ("none" asks for no tool call: no ToolChoice); `format`: the chat
    template's call format (`call_format`), which "auto" needs."""

    functions: tuple[dict, ...]
    choice: str
    parallel: bool = True
    format: str | None = None

    def __post_init__(self):
        names = [f["name"] for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"tools name a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        if self.choice not in ("auto", "required", *names):
            raise ValueError(f"tool_choice names the function {self.choice!r}, which is not among the tools {names}")
        if self.choice == "auto" and self.format is None:
            raise ValueError("tool_choice \"auto\" reads the calls the model writes in its chat template's format, and "
                             "this model's template has none kiln reads (Hermes' <tool_call> tags, as Qwen2.5's and "
                             "Qwen3's, Llama 3.1's JSON calls or Mistral's [TOOL_CALLS]): send tool_choice "
                             "\"required\" or a named function, whose answers are held to the tools' schemas, or "
                             "\"none\"")

    def mark(self) -> str:
        """The text that starts the calls in the template's format ("" for none): where it is a
        special token (Hermes 3's `<tool_call>`), "auto" reads the answer with special tokens kept."""
        return FORMATS[self.format].mark if self.format else ""

    @property
    def named(self) -> bool:
        return self.choice not in ("auto", "required")

    def schema(self) -> dict | None:
        """The JSON schema the answer is held to (None for "auto": free text)."""
        if self.choice == "auto":
            return None
        parameters = {f["name"]: f.get("parameters") or {"type": "object"} for f in self.functions}
        if self.named:
            return parameters[self.choice]
        one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, schema in parameters.items()]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": {"anyOf": one_of}}

    def read(self, text: str) -> Read:
        """(the content beside the calls, the calls) in an answer's text; None where it holds
        no calls that parse (then the text is the answer's content)."""
        if self.named:
            return None, [tool_call(self.choice, text)]
        if self.choice == "required":
            try:
                return None, [_call(value, "parameters") for value in json.loads(text)]
            except (ValueError, TypeError):  # cut by max_tokens: not the JSON its grammar would end
                return None
        return FORMATS[self.format].read(text)

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The answer's message and finish_reason."""
        read = self.read(text)
        if read is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = read
        calls = [{"id": call_id(self.format), **call} for call in calls]
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                finish if self.named else "tool_calls")

    def stream(self) -> "StreamedCalls":
        return StreamedCalls(self)


@dataclass
class StreamedCalls:
    """One streamed choice's deltas. A named function's arguments stream as they are drawn (the
    first delta names the call); "required"'s calls come whole in the last chunk; "auto"'s text
    streams as content up to where a call starts, and its calls come whole in the last chunk. A
    text that holds no calls after all goes out as content there, so the deltas add up."""

    tools: ToolChoice
    text: str = ""
    sent: int = 0  # of `text`, the characters that went out

    def delta(self, piece: str, finish: str | None) -> tuple[dict | None, str | None]:
        """The delta for the next piece of the answer's text (None: nothing to send yet), and
        the finish_reason with the last piece (`finish` given)."""
        self.text += piece
        if self.tools.named:
            head = {"index": 0, "id": call_id(self.tools.format), "type": "function",
                    "function": {"name": self.tools.choice, "arguments": piece}}
            delta = {"tool_calls": [head if self.sent == 0 else {"index": 0, "function": {"arguments": piece}}]}
            self.sent = len(self.text)
            return (delta if piece or finish else None), finish
        if finish is None:
            if self.tools.choice == "required":
                return None, None
            end = FORMATS[self.tools.format].content_end(self.text)
            if not self.text[:end].strip():  # content that is only spacing is no content (`read`): held
                return None, None
            return self._content(max(end, self.sent)), None
        read = self.tools.read(self.text)
        if read is None:
            return self._content(len(self.text)) or {"content": ""}, finish
        content, calls = read
        delta = self._content(len(content or "")) or {}
        calls = [{"index": i, "id": call_id(self.tools.format), **call} for i, call in enumerate(calls)]
        return {**delta, "tool_calls": calls}, "tool_calls"

    def _content(self, end: int) -> dict | None:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return {"content": piece} if piece else None
