"""`kiln serve-model`: an OpenAI-compatible HTTP server over one kiln model (a train, SFT, DPO or
Hugging Face folder: an export, or a checkpoint of a class training/hf_import.py reads), so that
lm-eval's API models (`local-completions`), chat clients, LLM judges and RL rollouts reach it the
way they reach vLLM.
FastAPI routes, uvicorn serving, on 127.0.0.1 by default; docs/serving.md is the user's page.

    GET  /v1/models               the one model served here, under its name
    POST /v1/completions          text or token-id prompts; echo; logprobs of the prompt and of the
                                  new tokens; max_tokens, temperature, top_p, stop, seed, n,
                                  logit_bias, presence and frequency penalties; vLLM's top_k,
                                  min_p, min_tokens, repetition_penalty, stop_token_ids,
                                  ignore_eos, include_stop_str_in_output,
                                  return_tokens_as_token_ids and skip_special_tokens
                                  (default true); stream; structured outputs (OpenAI's
                                  response_format, vLLM's structured_outputs)
    POST /v1/chat/completions     messages rendered with the model's chat template (post-training's
                                  for SFT and DPO outputs, a checkpoint's own Jinja one:
                                  evaluation/chat_prompt.py); 400 for a model with neither; tool
                                  calls (tools, tool_choice: evaluation/tools.py); a thinking
                                  model's reasoning apart (evaluation/reasoning.py)
    POST /tokenize, /detokenize   vLLM's tokenizer endpoints (a text prompt, or chat messages as chat
                                  completions prompt them), and GET /tokenizer_info: with them
                                  lm-eval finds the tokenizer on the server (its "remote" backend)
    GET  /health, /metrics        liveness, and Prometheus metrics (evaluation/serving_metrics.py)

Requests are continuously batched (`Scheduler`, evaluation/slots.py): up to `max_batch`
prompts decode together over one key/value cache, a few tokens at a time, and between those
chunks finished answers go out and waiting prompts take the free slots, so a short request
waits for a free slot, not for a whole batch to end. Each row's tokens are drawn as
`evaluation.generate.sample_batch` would draw them alone (its seed, settings and stops); an
echoed prompt's log-probabilities come from `evaluation.scoring.make_prompt_scorer` (the
lm-eval adapter's computation). If a batch fails, its requests run again one by one, so an
error fails only the request that causes it. A prompt that starts as an earlier one did (the
same few-shot context, system prompt or conversation) prefills only what follows the part
whose keys and values the prefix cache kept (evaluation/prefix_cache.py). An answer with a
structured output draws each token under its grammar's mask (evaluation/structured.py). With `stream`, each
token (with its log-probabilities, when asked for) is sent as server-sent events as its chunk
ends. A bad request gets a 4xx with an OpenAI-style body, `{"error": {"message", "type",
"param", "code"}}`, whose message says what to change; the server goes on answering.

No Prefect and no Ray here.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import queue
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable, Literal

import jax
import numpy as np
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo, field_validator,
                      model_validator)
from starlette.exceptions import HTTPException
from tokenizers import Tokenizer

from evaluation import slots
from evaluation.chat_prompt import chat_for
from evaluation.generate import (MAX_LOGPROBS, Model, Request, Sampled, Stream, TextStream, check_rows, sample_batch,
                                 stop_end, top_k_size)
from evaluation.prefix_cache import PrefixCache, default_prefix_tokens, pool_bytes
from evaluation.reasoning import THINK_CLOSE, StreamedThought, left_open, split, thinks
from evaluation.scoring import bucket_for, buckets, make_prompt_scorer, pad_rows
from evaluation.serving_metrics import CountRequests, ServingMetrics
from evaluation.structured import Grammar, after_thought, compile_grammar, grammar_of, json_grammar, vocabulary
from evaluation.tools import ToolChoice, call_format

WINDOW_S = 0.005  # how long a request that finds the server idle waits for company
log = logging.getLogger("kiln.serve")
DISCONNECT_POLL_S = 0.25  # how often a request waiting for its answer checks that its client is still there
SCORE_FLOATS = 1 << 28  # log-probabilities one scoring call holds at most (1 GiB of float32)
DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's and vLLM's
MAX_CHOICES = 128  # `n` at most: each choice is a row of its own in the batches


# --- request bodies ----------------------------------------------------------------------------------


class ApiError(Exception):
    """A request the server cannot answer: HTTP status, and the message the client gets."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


# Fields of OpenAI's API that kiln does not implement: accepted at their neutral values only.
NEUTRAL_ONLY = {
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "suffix": ((None, ""), "suffix (insertion) is not supported: leave it out"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with `usage` and no choices (and `usage: null` before it)


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # kiln's answers always follow the schema


class ResponseFormat(BaseModel):
    """OpenAI's: free text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's: exactly one of a JSON schema, a regex, a list of choices or a Lark grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


class _Body(BaseModel):
    """What both endpoints take. Fields OpenAI defines that kiln does not implement are accepted
    at their neutral values only (best_of=1, no suffix); any other field is an error."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the model served here
    max_tokens: StrictInt | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None  # None: a fresh random seed
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt, each drawn with a seed of its own
    stream: bool = False  # server-sent events, text as it is generated (Service.stream)
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)  # OpenAI's range
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (a string) -> bias
    user: str | None = None
    # vLLM's: special tokens the model generates (<|user|>, ...) are left out of the answer's text and
    # of its logprobs' token strings, as vLLM leaves them out by default; false keeps them
    skip_special_tokens: bool = True
    # vLLM's sampling extras (evaluation.generate.Request): top_k -1 or 0 for all tokens
    top_k: StrictInt = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: StrictInt = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    stop_token_ids: list[StrictInt] | None = None  # more tokens that end the answer, as EOS does
    ignore_eos: bool = False  # the model's own stop tokens do not end the answer (stop_token_ids still do)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>": exact where strings are not
    include_stop_str_in_output: bool = False  # the answer ends after the stop string it met, not before
    response_format: ResponseFormat | None = None  # the answer held to JSON (evaluation/structured.py)
    structured_outputs: StructuredOutputs | None = None  # vLLM's: a schema, regex, choices or Lark grammar

    @field_validator(*NEUTRAL_ONLY, check_fields=False)
    @classmethod
    def _neutral(cls, v, info: ValidationInfo):
        allowed, advice = NEUTRAL_ONLY[info.field_name]
        if v not in allowed:
            raise ValueError(advice)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        bad = [k for k in (v or {}) if not k.isdigit()]
        if bad:
            raise ValueError(f"logit_bias maps token ids (strings of digits, as OpenAI's) to biases; {bad[:3]} are not")
        return v

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    def stop_ids(self, model_stops: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that end an answer: the model's (unless ignore_eos) and stop_token_ids."""
        return (*(() if self.ignore_eos else model_stops), *(self.stop_token_ids or ()))

    def formatted(self) -> bool:
        """Whether the answer is held to a structured output (not free text)."""
        return self.structured_outputs is not None or (self.response_format is not None
                                                       and self.response_format.type != "text")

    def check(self, max_tokens: int) -> None:
        """400 for stream_options without stream, for min_tokens above the answer's max_tokens, and
        for min_tokens or ignore_eos with a structured output (its grammar decides where it ends)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream=true", "stream_options")
        for name, value in (("min_tokens", self.min_tokens), ("ignore_eos", self.ignore_eos)):
            if self.formatted() and value:
                raise ApiError(400, f"{name} with a structured output: the answer ends where its format is "
                               f"complete; leave {name} out", name)
        if self.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens={self.min_tokens} is more than max_tokens={max_tokens}: lower it or "
                           "raise max_tokens", "min_tokens")


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("a prompt is a string, a list of strings, a list of token ids or a list of such "
                             "lists, none of them empty (for nothing before the completion, send \"\")")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    arguments: StrictStr  # a JSON object's text, as the answer gave it


class ToolCall(BaseModel):
    """A call an earlier assistant message made: sent back so the template renders it."""

    model_config = ConfigDict(extra="forbid")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # refusal, audio, ...: not used by templates
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None  # None: an assistant message that only called tools
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # the assistant's
    tool_call_id: StrictStr | None = None  # a tool's message: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs its content (only an assistant message with tool_calls may leave it "
                             "out)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as a chat template reads it (transformers' form): a call's arguments as the
        object they are, which templates write with `tojson`."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{**({"id": c.id} if c.id else {}), "type": c.type,
                                      "function": {"name": c.function.name,
                                                   "arguments": _arguments(c.function.arguments)}}
                                     for c in self.tool_calls]
        return message


def _arguments(text: str) -> dict:
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"a tool call's arguments are the text of a JSON object, as answers give them; got "
                       f"{text!r:.100}", "messages")
    return arguments


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of its arguments (None: any object)
    strict: bool | None = None  # kiln holds a called function's arguments to its schema either way


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as a chat template reads them (transformers passes OpenAI's dicts as they are)."""
    return [t.model_dump(exclude_unset=True) for t in tools] if tools else None


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: the assistant's turn opened after the messages (false: the model writes the next role
    # token itself); or the last message, the assistant's, continued where it stops (a prefill)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # function calling (evaluation/tools.py): the tools go into the prompt through the template;
    # tool_choice None: "auto" with tools, "none" without
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # more variables for the chat template (Qwen3's enable_thinking), as vLLM passes them
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_choice_name(self) -> str:
        """"none", "auto", "required" or the named function's name."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    def tool_use(self, call_format: str | None) -> ToolChoice | None:
        """What the answers' tool calls must be (None: free text); 400 for a choice without tools,
        a named function not among them, or "auto" for a template whose calls kiln cannot read."""
        choice = self.tool_choice_name()
        if choice == "none":
            return None
        if choice != "auto" and _Body.formatted(self):
            raise ApiError(400, f"tool_choice {choice!r} holds the answer to the tools' schemas: leave response_format "
                           "and structured_outputs out", "tool_choice")
        if not self.tools:
            raise ApiError(400, f"tool_choice {choice!r} needs tools to choose from", "tool_choice")
        try:
            return ToolChoice(tuple(t["function"] for t in template_tools(self.tools)), choice,
                              self.parallel_tool_calls, call_format)
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice") from None

    def writes_thought(self) -> bool:
        """Whether its structured output spells a thought's end tag itself (then it holds the whole
        answer, the thought too: evaluation/reasoning.py)."""
        asked = self.structured_outputs
        return asked is not None and any(THINK_CLOSE in pattern.replace("\\/", "/")
                                         for pattern in (asked.regex or "", asked.grammar or "", *(asked.choice or ())))

    def formatted(self) -> bool:
        """A structured output, or a tool call the answer must be (required, or a named function)."""
        return super().formatted() or self.tool_choice_name() not in ("none", "auto")


class TokenizeBody(BaseModel):
    """vLLM's two forms: a text `prompt`, or chat `messages` tokenized as /v1/chat/completions
    prompts them (a client counts a conversation's tokens before sending it)."""

    model_config = ConfigDict(extra="ignore")
    prompt: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # kiln's tokenizers add none either way
    tools: list[Tool] | None = None  # rendered into the prompt as chat completions render them
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt (a text) or messages (a chat), one of the two")
        return self


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[StrictInt]


# --- the engine: jobs on the model, continuously batched ------------------------------------------


@dataclass(frozen=True)
class Job:
    """One prompt of a request, as the engine runs it."""

    row: Request  # prompt ids, max_tokens (may be 0), sampling settings, stop ids
    score_prompt: bool = False  # echo with logprobs: each prompt token's log-probability
    top_logprobs: int | None = None  # alternatives per token; None: no log-probabilities asked for
    grammar: Grammar | None = None  # a structured output: the answer's tokens held to it


@dataclass(frozen=True)
class Result:
    prompt_logprobs: list[float | None] | None  # None unless score_prompt; the first token's is None
    prompt_top: list[list[tuple[int, float]]] | None
    sampled: Sampled
    cached_tokens: int = 0  # of the prompt's tokens, those admission read from the prefix cache


@dataclass(eq=False)  # a row is itself only
class _Row:
    """A job taken: its future, its prompt's scores (if asked for), and its answer so far."""

    job: Job
    future: concurrent.futures.Future
    prompt: tuple = (None, None)  # (log-probabilities, top alternatives) of the prompt, with score_prompt
    cached: int = 0  # its prompt's tokens the prefix cache held when it was admitted
    guide: object = None  # with a grammar: its evaluation.structured.Guide, where the answer is in it
    bias: np.ndarray | None = None  # with a grammar: the request's own logit bias [vocab], the mask added to it
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top: list = field(default_factory=list)


def settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """A job's answer (or error) to its future, unless its caller cancelled it meanwhile (a
    client that went away: nobody waits for it)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        if not future.cancelled():  # answered twice: a kiln bug
            raise


class Scheduler:
    """Runs jobs on the model in a thread of its own (the one that touches the model),
    continuously batched (evaluation/slots.py): up to `max_batch` prompts decode together, a
    chunk of `steps` tokens at a time (fewer while an answer streams: as many as take
    `stream_interval_s` at the last chunk's pace, one at least, so that its text goes out that
    often); after each chunk, finished answers go out and waiting prompts take the free slots,
    so a request waits for a free slot, not for a batch to end. When idle, the first job waits
    `window_s` for company, so that a burst is prefilled together. Admitted prompts reuse the
    keys and values of their leading blocks that the prefix cache holds (`prefix_tokens` of them
    at most: None, `default_prefix_tokens`; 0, none), and leave theirs there, as answers that end
    leave theirs (a conversation's next turn prefills only its new message).
    A prompt to echo with logprobs is scored when it is taken (with the others taken then, by
    `evaluation.scoring.make_prompt_scorer`: the lm-eval adapter's computation).

    If scoring a group fails, each of its jobs is scored again alone; if admitting prompts or a
    chunk fails, every row in the slots runs again alone (`sample_batch`, its stream sending
    its tokens again): an error fails only the job that causes it. `submit` returns a future;
    cancelling it (the server does, for a client that went away) frees the job's slot at the
    next token it would have been handed."""

    def __init__(self, model: Model, max_batch: int = 8, window_s: float = WINDOW_S, steps: int = slots.STEPS,
                 on_chunk: Callable[[int, float], None] | None = None,
                 stream_interval_s: float = slots.STREAM_INTERVAL_S, prefix_tokens: int | None = None,
                 on_prefix: Callable[[int, int], None] | None = None):
        self.model, self.max_batch, self.window_s, self.steps = model, max_batch, window_s, steps
        self.stream_interval_s = stream_interval_s
        self.step_s = 0.0  # seconds per decoding step in the last chunk (0: none run yet)
        self.on_chunk = on_chunk  # told each chunk's rows and seconds (the server's metrics)
        prefix_tokens = default_prefix_tokens(model.cfg, max_batch) if prefix_tokens is None else prefix_tokens
        self.prefixes = PrefixCache(model.cfg, prefix_tokens) if prefix_tokens else None
        # answers' blocks too, where a slot holds every column (no sliding layer's ring)
        self.keeps_answers = self.prefixes is not None and all(
            model.cfg.layer_reach(i, model.cfg.seq_len) == model.cfg.seq_len for i in range(model.cfg.n_layers))
        self.finished: list[tuple[int, list[int]]] = []  # (slot, tokens fed) of answers that ended, to keep
        self.on_prefix = on_prefix  # told each admission's prompt tokens, and those the prefix cache held
        self.scorer = make_prompt_scorer(model.cfg)
        self.buckets = buckets(model.cfg.seq_len)
        self.jobs: queue.Queue = queue.Queue()
        self.waiting: collections.deque[_Row] = collections.deque()
        self.live: list[_Row | None] = [None] * max_batch  # slot -> the row decoding there
        self.masks: dict[int, np.ndarray] = {}  # slot -> the logit bias of its next token, a structured output's
        self.state: dict | None = None  # the slots on the device (made on first use, and after a failure)
        self.taken = 0  # jobs taken, and the rows of the last calls on the model (a scoring group, an
        self.rows_run: collections.deque[int] = collections.deque(maxlen=4096)  # admission, a chunk): for tests
        self.admitted: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)  # (prompts, rows)
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="kiln-scheduler", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.closed:
            future.set_exception(ApiError(503, "the server is shutting down: retry on another", kind="server_error"))
        else:
            self.jobs.put((job, future))
        return future

    def close(self, timeout_s: float = 30) -> None:
        """Stop taking jobs, finish those already taken, then end the thread."""
        self.closed = True
        self.jobs.put(None)
        self.thread.join(timeout_s)

    def waiting_count(self) -> int:
        return self.jobs.qsize() + len(self.waiting)

    def running_count(self) -> int:
        return sum(row is not None for row in self.live)

    # --- the thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        open_ = True
        while True:
            idle = not self.waiting and not self.running_count()
            if idle and not open_:
                return
            open_ &= self._take(wait=idle and open_)
            for slot, row in enumerate(self.live):
                if row is not None and row.future.cancelled():  # its client went away
                    self._free(slot)
            if any(row.future.cancelled() for row in self.waiting):
                self.waiting = collections.deque(row for row in self.waiting if not row.future.cancelled())
            free = [slot for slot, row in enumerate(self.live) if row is None]
            if free and self.waiting:
                admitted = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
                self._guarded(lambda: self._admit(admitted), admitted)
            if self.running_count():
                self._guarded(self._chunk)

    def _take(self, wait: bool) -> bool:
        """Queued jobs to `waiting` (or answered, for a prompt to score only), their prompts
        scored where asked; with `wait`, the first blocks, then others are gathered for
        window_s. False once `close` was called."""
        items = []
        if wait:
            items.append(self.jobs.get())
            deadline = time.monotonic() + self.window_s
            while items[-1] is not None and len(items) < self.max_batch:
                try:
                    items.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:  # the window has passed
                    break
        while not self.jobs.empty():  # this thread is the queue's only reader: what is there can be taken
            items.append(self.jobs.get_nowait())
        rows = [_Row(*item) for item in items if item is not None and not item[1].cancelled()]
        self.taken += len(rows)
        for row in rows:  # a row the model cannot run fails now, alone (the server checked it before)
            try:
                if row.job.row.max_tokens > 0:
                    check_rows(self.model, [row.job.row])
            except ValueError as e:
                settle(row.future, error=e)
        scoring = [row for row in rows if row.job.score_prompt and not row.future.done()]
        for start in range(0, len(scoring), self.max_batch):
            self._alone_on_error(self._score, scoring[start:start + self.max_batch])
        for row in rows:
            if row.future.done():  # its scoring failed, or its caller cancelled it
                continue
            if row.job.row.max_tokens == 0:
                settle(row.future, Result(*row.prompt, Sampled([], [], [], False)))
            else:
                self.waiting.append(row)
        return None not in items

    def _alone_on_error(self, work: Callable[[list[_Row]], None], rows: list[_Row]) -> None:
        try:
            work(rows)
        except Exception as e:  # noqa: BLE001 - it goes to the job, and a group is retried alone
            if len(rows) == 1:
                settle(rows[0].future, error=e)
                return
            for row in rows:  # one of them caused it: run each alone, so only that one fails
                self._alone_on_error(work, [row])

    def _guarded(self, work: Callable[[], None], admitted: list[_Row] = ()) -> None:
        """`work` on the slots; if it fails, the slots' state is lost: every row in them (and
        `admitted`) runs again alone, and the slots start empty."""
        try:
            work()
        except Exception:  # noqa: BLE001 - each row is run again alone, and fails alone
            log.exception("kiln serve-model: decoding the slots failed; each of their requests runs again alone")
            rows = [row for row in self.live if row is not None]
            rows += [row for row in admitted if row not in rows and not row.future.done()]
            self._lose_slots()
            for row in rows:
                self._alone_on_error(self._sample_alone, [row])

    def _lose_slots(self) -> None:
        """After a failed call on the slots: they start empty, and what was pending for them goes."""
        self.live, self.state = [None] * self.max_batch, None
        self.masks.clear()
        self.finished.clear()
        if self.prefixes is not None:  # its pool may have gone with the failed call
            self.prefixes.forget()

    def _sample_alone(self, rows: list[_Row]) -> None:
        (row,) = rows
        job = row.job
        if job.grammar is not None:  # sample_batch knows no grammar: the row decodes alone in the slots
            row.ids, row.logprobs, row.top = [], [], []
            try:
                self._admit([row])
                while row in self.live:
                    self._chunk()
            except Exception:
                self._lose_slots()
                raise
            return
        (sampled,) = sample_batch(self.model, [job.row], job.top_logprobs, 1)
        settle(row.future, Result(*row.prompt, sampled))

    def _admit(self, rows: list[_Row]) -> None:
        """Prefill `rows` into free slots together (one row alone, several as max_batch rows) and
        hand out their first tokens. Rows that all share one prompt (a request's `n` choices)
        prefill it once: admission compiles for three shapes per prompt length. Prompts that start
        with the same block the prefix cache lacks (a burst of questions after one new few-shot
        context) are admitted in two: one of them first, which leaves its blocks in the cache, then
        the others, which find them."""
        cfg = self.model.cfg
        if self.state is None:
            self.state = slots.empty(cfg, self.max_batch)
        n = 1 if len(rows) == 1 else self.max_batch
        prompts = [row.job.row.prompt for row in rows]
        shared = all(p == prompts[0] for p in prompts)
        distinct = prompts[:1] if shared else prompts
        lead = None if shared or self.prefixes is None else self.prefixes.shared_new(distinct)
        if lead is not None:
            first = [row for row in rows if row.job.row.prompt == distinct[lead]]
            self._admit(first)
            self._admit([row for row in rows if all(row is not other for other in first)])
            return
        m = 1 if shared else n
        plan = None if self.prefixes is None else self.prefixes.plan(distinct)
        done = np.zeros(len(distinct), np.int32) if plan is None else plan.done
        P = bucket_for(max(len(p) for p in distinct), self.buckets) if plan is None else plan.width
        tokens, lengths = np.zeros((m, P), np.int32), np.ones(m, np.int32)
        for i, prompt in enumerate(distinct):
            tokens[i, :len(prompt) - done[i]] = prompt[done[i]:]
            lengths[i] = len(prompt) - done[i]
        source = np.zeros(n, np.int32) if shared else np.arange(n, dtype=np.int32)
        free = [slot for slot, live in enumerate(self.live) if live is None][:len(rows)]
        where = np.full(n, self.max_batch, np.int32)  # padding rows go to no slot
        where[:len(rows)] = free
        settings = slots.settings_of([row.job.row for row in rows], cfg.vocab_size, n)
        for b, row in enumerate(rows):
            if row.job.grammar is not None:  # its first token is one its grammar allows
                row.guide, row.bias = row.job.grammar.guide(), settings["bias"][b].copy()
                settings["bias"][b] += row.guide.mask()
                settings["adjusts"][b] = True
        self.state, first, pool = slots.admit(
            self.model.params, self.state, where, tokens, lengths, settings, source,
            None if plan is None else self.prefixes.pool, None if plan is None else plan.arrays(m), cfg=cfg)
        if plan is not None:
            self.prefixes.pool = pool
            if self.on_prefix is not None:
                self.on_prefix(sum(len(p) for p in distinct), int(done.sum()))
        token, logprob, top_ids, top_lps = jax.device_get(first)
        self.rows_run.append(len(rows))
        self.admitted.append((len(distinct), len(rows)))
        for b, (slot, row) in enumerate(zip(free, rows)):
            self.live[slot] = row
            row.cached = int(done[source[b]])
            self._hand_out(slot, int(token[b]), float(logprob[b]), top_ids[b], top_lps[b])
        self._keep_answers()
        self._set_masks()

    def _chunk(self) -> None:
        """One chunk of decoding steps of every slot, its tokens handed out."""
        wanted = [row.job.top_logprobs for row in self.live if row is not None and row.job.top_logprobs is not None]
        started, running = time.monotonic(), self.running_count()
        busy = max(slot for slot, row in enumerate(self.live) if row is not None) + 1
        width = min(1 << (busy - 1).bit_length(), self.max_batch)  # few compiled widths: powers of two
        self.state, out = slots.decode_chunk(self.model.params, self.state, np.int32(self._chunk_steps()),
                                             cfg=self.model.cfg, steps=self.steps, width=width,
                                             alternatives=top_k_size(max(wanted)) if wanted else None)
        ids, logprobs, top_ids, top_lps, valid = jax.device_get(out)
        self.step_s = (time.monotonic() - started) / max(1, int(valid.any(axis=0).sum()))
        self.rows_run.append(running)
        for slot in range(width):
            for k in np.flatnonzero(valid[slot]):
                if self.live[slot] is None:
                    break
                self._hand_out(slot, int(ids[slot, k]), float(logprobs[slot, k]), top_ids[slot, k],
                               top_lps[slot, k])
        self._keep_answers()
        self._set_masks()
        if self.on_chunk is not None:
            self.on_chunk(running, time.monotonic() - started)

    def _keep_answers(self) -> None:
        """The whole blocks of the answers that ended, from their slots into the prefix cache
        (before an admission takes the slot)."""
        for slot, fed in self.finished:
            claim = self.prefixes.keep(fed)
            if claim is not None:
                self.prefixes.pool = slots.keep_blocks(self.prefixes.pool, self.state["layers"], np.int32(slot),
                                                       *claim)
        self.finished.clear()

    def _set_masks(self) -> None:
        """The next token's logit bias of each slot whose structured output moved on, to the device."""
        if not self.masks:
            return
        where = np.full(self.max_batch, self.max_batch, np.int32)  # one shape: the rest go nowhere
        rows = np.zeros((self.max_batch, self.model.cfg.vocab_size), np.float32)
        for i, (slot, mask) in enumerate(self.masks.items()):
            where[i], rows[i] = slot, mask
        self.state["bias"] = slots.set_rows(self.state["bias"], where, rows)
        self.masks.clear()

    def _chunk_steps(self) -> int:
        """`steps`; one while a structured output decodes (each token's mask depends on the one
        before); while an answer streams, as many as take `stream_interval_s` at the last chunk's
        pace (one when none ran yet), at least one."""
        if any(row is not None and row.guide is not None for row in self.live):
            return 1
        if not any(row is not None and row.job.row.stream is not None for row in self.live):
            return self.steps
        if not self.step_s:
            return 1
        return max(1, min(self.steps, int(self.stream_interval_s / self.step_s)))

    def _hand_out(self, slot: int, token: int, logprob: float, top_ids, top_lps) -> None:
        """Slot `slot`'s next token to its row (and its stream); the row is answered once it ends
        (a stop id: not part of the answer; or max_tokens), and its slot freed."""
        row = self.live[slot]
        if row.future.cancelled():  # its client went away
            self._free(slot)
            return
        request, wanted = row.job.row, row.job.top_logprobs
        stopped = token in request.stop_ids
        try:
            if not stopped:
                top = [] if wanted is None else list(zip(top_ids[:wanted].tolist(), top_lps[:wanted].tolist()))
                row.ids.append(token)
                if wanted is not None:
                    row.logprobs.append(logprob)
                    row.top.append(top)
                if request.stream is not None:
                    request.stream(len(row.ids) - 1, token, None if wanted is None else logprob, top)
                if row.guide is not None:
                    row.guide.advance(token)
        except Exception as e:  # noqa: BLE001 - a failing stream (or grammar) fails its own job only
            settle(row.future, error=e)
            self._free(slot)
            return
        if stopped or len(row.ids) == request.max_tokens:
            settle(row.future, Result(*row.prompt, Sampled(row.ids, row.logprobs, row.top, stopped), row.cached))
            self.live[slot] = None
            if self.keeps_answers:  # its slot holds the prompt and every token drawn but the last
                self.finished.append((slot, [*request.prompt, *row.ids, *([token] if stopped else [])][:-1]))
        elif row.guide is not None:
            self.masks[slot] = row.bias + row.guide.mask()

    def _free(self, slot: int) -> None:
        """Slot `slot`'s row ended before its answer (a failed stream, a cancelled job): the slot
        is free, and decodes no more."""
        self.live[slot] = None
        self.masks.pop(slot, None)
        self.state["done"] = self.state["done"].at[slot].set(True)

    def _score(self, rows: list[_Row]) -> None:
        """Each row's prompt's log-probabilities and top alternatives (`row.prompt`); rows go
        through the scorer in groups whose log-softmax fits SCORE_FLOATS, one row alone, several
        as max_batch rows (or fewer, where SCORE_FLOATS allows fewer)."""
        seqs = [np.asarray(row.job.row.prompt, np.int32) for row in rows]
        k = top_k_size(max((row.job.top_logprobs or 0 for row in rows), default=0))
        L = bucket_for(max((len(s) - 1 for s in seqs), default=1) or 1, self.buckets)
        cap = max(1, SCORE_FLOATS // (L * self.model.cfg.vocab_size))
        for start in range(0, len(rows), cap):
            group = seqs[start:start + cap]
            B = 1 if len(group) == 1 else max(len(group), min(self.max_batch, cap))
            logprob, top_ids, top_lps = jax.device_get(self.scorer(
                self.model.params, pad_rows([s[:-1] for s in group], L, B), pad_rows([s[1:] for s in group], L, B), k))
            self.rows_run.append(len(group))
            for b, (row, s) in enumerate(zip(rows[start:start + cap], group)):
                n, wanted = len(s) - 1, row.job.top_logprobs or 0
                top = [list(zip(top_ids[b, i, :wanted].tolist(), top_lps[b, i, :wanted].tolist())) for i in range(n)]
                row.prompt = ([None, *logprob[b, :n].tolist()], [[], *top])


# --- turning requests into jobs and results into OpenAI's answers ----------------------------------


class Service:
    """The served model under its name: validation, tokenization and answers around the scheduler."""

    def __init__(self, model: Model, name: str, max_batch: int = 8, prefix_tokens: int | None = None):
        self.model, self.name = model, name
        self.created = int(time.time())
        self.metrics = ServingMetrics(name, lambda: self.scheduler.waiting_count(),
                                      lambda: self.scheduler.running_count())
        self.scheduler = Scheduler(model, max_batch, on_chunk=self.metrics.ran_chunk, prefix_tokens=prefix_tokens,
                                   on_prefix=self.metrics.looked_up)
        self.tok = Tokenizer.from_str(model.tokenizer.to_str())
        self.tok.encode_special_tokens = False  # text prompts: special-token strings become their tokens, as in HF
        try:
            self.template, self.no_template = chat_for(model), ""
        except ValueError as e:
            self.template, self.no_template = None, str(e)
        self._pieces: dict[tuple[int, bool], str] = {}
        self._vocabularies: dict[tuple[int, ...], object] = {}  # stop ids -> llguidance's tokenizer

    # --- helpers --------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name:
            raise ApiError(404, f"the model {name!r} is not served here: this server serves {self.name!r} "
                           "(GET /v1/models); send that name, or leave `model` out", "model")

    def piece(self, token: int, skip_special: bool = False) -> str:
        """One token's text ('' for a special token when `skip_special`)."""
        key = (token, skip_special)
        if key not in self._pieces:
            self._pieces[key] = self.model.tokenizer.decode([token], skip_special_tokens=skip_special)
        return self._pieces[key]

    def special(self, text: str) -> bool:
        """Whether `text` is one special token of the tokenizer (left out of answers' text by default)."""
        token = self.model.tokenizer.token_to_id(text)
        return token is not None and self.piece(token, skip_special=True) == ""

    def label(self, token: int, skip_special: bool, as_id: bool) -> str:
        """How logprobs name a token: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token}" if as_id else self.piece(token, skip_special)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.model.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def check_fits(self, ids: list[int], max_tokens: int, param: str) -> None:
        T = self.model.cfg.seq_len
        if len(ids) + max_tokens > T:
            raise ApiError(400, f"this model's context is {T} tokens, but the request asks for "
                           f"{len(ids) + max_tokens}: {len(ids)} in the prompt and max_tokens={max_tokens}; "
                           "shorten the prompt or lower max_tokens", param)
        self.check_vocabulary(ids, param)

    def grammar(self, body: _Body, ends: tuple[int, ...], tools: ToolChoice | None = None,
                thought: bool | None = None) -> Grammar | None:
        """The structured output `body` asks for (None: `{"type": "text"}`), or the tool calls
        `tools` hold the answer to, whose answers end at one of the stop ids `ends` once complete;
        with `thought` (whether the prompt opened it; None: no thought), held after a free thought
        (`after_thought`). 400 for a format llguidance cannot build, saying why. Run in a worker
        thread: llguidance's view of a vocabulary takes ~0.6 s to build (GPT-2's; once per
        `ends`), which would hold up every other request's answers on the event loop."""
        schema = None if tools is None else tools.schema()
        param = "tools" if schema is not None else (
            "structured_outputs" if body.structured_outputs is not None else "response_format")
        try:
            text = json_grammar(schema) if schema is not None else grammar_of(
                body.response_format and body.response_format.model_dump(by_alias=True),
                body.structured_outputs and body.structured_outputs.model_dump(by_alias=True))
            if text is None:
                return None
            if thought is not None:
                text = after_thought(text, thought)
            if ends not in self._vocabularies:
                self._vocabularies[ends] = vocabulary(self.model.tokenizer.to_str(), self.model.cfg.vocab_size, ends)
            return compile_grammar(text, self._vocabularies[ends])
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param) from None

    def check_token_fields(self, body: _Body) -> None:
        self.check_vocabulary(body.logit_bias or {}, "logit_bias")
        self.check_vocabulary(body.stop_token_ids or [], "stop_token_ids")

    def check_vocabulary(self, ids, param: str) -> None:
        bad = [t for t in ids if not 0 <= int(t) < self.model.cfg.vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside this model's vocabulary of "
                           f"{self.model.cfg.vocab_size}", param)

    def row(self, body: _Body, ids: list[int], max_tokens: int, stop_ids: tuple[int, ...], choice: int = 0,
            stream: Stream | None = None) -> Request:
        """Choice `choice` (of `n`) of a prompt, as the engine runs it."""
        seed = secrets.randbits(64) if body.seed is None else choice_seed(body.seed, choice)
        bias = tuple((int(t), v) for t, v in (body.logit_bias or {}).items())
        return Request(ids, max_tokens, body.temperature, body.top_p, seed, stop_ids, stream, bias,
                       body.presence_penalty, body.frequency_penalty, max(body.top_k, 0), body.min_p,
                       min(body.min_tokens, max_tokens),  # max_tokens 0: a prompt to score, no answer
                       body.repetition_penalty)

    async def run(self, jobs: list[Job]) -> list[Result]:
        return await asyncio.gather(*(asyncio.wrap_future(self.scheduler.submit(j)) for j in jobs))

    def cut(self, sampled: Sampled, body: _Body) -> tuple[list[int], str, str]:
        """(the tokens kept, their text, finish_reason) after cutting at the first stop string,
        which is looked for in the text as the answer shows it (as vLLM does): before it, or
        after it with include_stop_str_in_output."""
        skip_special = body.skip_special_tokens
        text = self.decode(sampled.ids, skip_special)
        at = stop_end(text, body.stop_strings(), body.include_stop_str_in_output)
        if at is None:
            return sampled.ids, text, "stop" if sampled.stopped else "length"
        ends = np.cumsum([len(self.piece(t, skip_special)) for t in sampled.ids])
        keep = int(np.searchsorted(ends, at, side="left")) + 1 if at > 0 else 0  # through the token holding `at`
        return sampled.ids[:keep], text[:at], "stop"

    def usage(self, prompts: int, completions: int, cached: int) -> dict:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens whose keys and
        values came from the prefix cache (of each prompt, its first choice's)."""
        return {"prompt_tokens": prompts, "completion_tokens": completions, "total_tokens": prompts + completions,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # --- /v1/completions ----------------------------------------------------------------------------

    async def completions(self, body: CompletionBody) -> dict | AsyncIterator[str]:
        arrived = time.monotonic()
        self.check_model(body.model)
        self.check_token_fields(body)
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        several = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
        prompts = body.prompt if several else [body.prompt]
        encoded = []  # (ids, the prompt's text for echo, whether the first id is the start token kiln added)
        for p in prompts:
            if isinstance(p, str):
                encoded.append(([self.model.start_id, *self.tok.encode(p, add_special_tokens=False).ids], p, True))
            else:
                encoded.append((list(p), None, False))
            self.check_fits(encoded[-1][0], max_tokens, "prompt")
        want_logprobs = body.logprobs is not None
        body.check(max_tokens)
        k, skip, stop_ids = body.logprobs, body.skip_special_tokens, body.stop_ids(self.model.stop_ids)
        grammar = await asyncio.to_thread(self.grammar, body, self.model.stop_ids) if body.formatted() else None
        as_ids = body.return_tokens_as_token_ids
        scored = body.echo and want_logprobs  # each prompt scored once, however many choices it has
        # OpenAI's order: prompt p's choices are p*n ... p*n + n-1
        choices_of = [(p, j) for p in range(len(encoded)) for j in range(body.n)]
        prompt_tokens = sum(len(ids) for ids, _, _ in encoded)

        def echoed(p: int, scores: list[Result]) -> dict:
            """The echoed prompt p: its text and, when it was scored, its tokens' logprobs."""
            ids, text, added = encoded[p]
            prompt_text = text if text is not None else self.decode(ids)
            if not scores:
                return {"text": prompt_text, "logprobs": None}
            score = scores[p]
            return {"text": prompt_text, "logprobs": self.completion_logprobs(
                ids, score.prompt_logprobs, score.prompt_top, k, hidden=int(added), skip_special=False, as_ids=as_ids)}

        # where each prompt's new tokens' text_offset begins: after an echoed prompt
        starts = [self.text_end(ids, int(added)) if body.echo else 0 for ids, _, added in encoded]

        if body.stream:  # the prompts scored before the first chunk: an echoed prompt comes first
            scores = await self.run([Job(self.row(body, ids, 0, ()), score_prompt=True, top_logprobs=k)
                                     for ids, _, _ in encoded]) if scored else []
            echoes = [echoed(p, scores) for p in range(len(encoded))] if body.echo else None
            firsts = [{**echoes[p], "finish_reason": None} for p, _ in choices_of] if echoes else None

            def chunk(n: int, piece: str, drawn: list | None, start: int, finish: str | None) -> dict:
                if drawn is None:
                    return {"text": piece, "logprobs": None, "finish_reason": finish}
                return {"text": piece, "logprobs": self.completion_logprobs(
                    [t for t, _, _ in drawn], [lp for _, lp, _ in drawn], [top for _, _, top in drawn], k, 0, skip,
                    starts[choices_of[n][0]] + start, as_ids), "finish_reason": finish}

            rows = [(encoded[p][0], max_tokens, stop_ids, j) for p, j in choices_of]
            return self.stream(body, "text_completion", rows, prompt_tokens, chunk, firsts, k, arrived, grammar)
        # the first choice of each prompt scores it too: one job, as lm-eval's loglikelihood requests need
        results = await self.run([Job(self.row(body, encoded[p][0], max_tokens, stop_ids, j),
                                      scored and j == 0, k, grammar) for p, j in choices_of])
        scores = results[::body.n] if scored else []
        echoes = [echoed(p, scores) for p in range(len(encoded))] if body.echo else None
        choices, used = [], 0
        for i, (p, _) in enumerate(choices_of):
            sampled = results[i].sampled
            new, new_text, finish = self.cut(sampled, body)
            used += spent(new, sampled)
            prompt = echoes[p] if echoes else {"text": "", "logprobs": None}
            logprobs = None
            if want_logprobs:
                n = len(new)
                logprobs = self.completion_logprobs(new, sampled.logprobs[:n], sampled.top[:n], k, 0, skip, starts[p],
                                                    as_ids)
                if body.echo:
                    logprobs = {key: prompt["logprobs"][key] + logprobs[key] for key in logprobs}
            choices.append({"index": i, "text": prompt["text"] + new_text, "logprobs": logprobs,
                            "finish_reason": finish})
        self.metrics.answered("/v1/completions", prompt_tokens, used, time.monotonic() - arrived)
        return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": self.usage(prompt_tokens, used, sum(r.cached_tokens for r in results[::body.n]))}

    def text_end(self, ids: list[int], hidden: int) -> int:
        """Where the text of `ids` ends, as `completion_logprobs` counts offsets (the first `hidden`
        tokens add none; special tokens are counted as they are written)."""
        return sum(len(self.piece(t)) for t in ids[hidden:])

    def completion_logprobs(self, tokens: list[int], lps: list, tops: list, k: int, hidden: int,
                            skip_special: bool, start: int = 0, as_ids: bool = False) -> dict:
        """OpenAI's completion logprobs. `top_logprobs[i]`: the k most likely tokens at i and the token
        chosen (as vLLM); null where nothing came before. `text_offset[i]`: where token i's text starts
        in the choice's `text`, counted from `start` (the first token's); the first `hidden` tokens
        (the start token before a text prompt) add none. The token strings follow `skip_special`
        (false for an echoed prompt, whose text is as sent), or are "token_id:<id>" with `as_ids`."""
        offsets, at = [], start
        top_dicts: list[dict | None] = []
        for i, (token, lp, top) in enumerate(zip(tokens, lps, tops)):
            offsets.append(at)
            at += 0 if i < hidden else len(self.piece(token, skip_special))
            if lp is None:
                top_dicts.append(None)
                continue
            entry = {}
            for alt, alt_lp in [*top[:k], (token, lp)]:
                entry.setdefault(self.label(alt, skip_special, as_ids), alt_lp)
            top_dicts.append(entry)
        pieces = [self.label(t, skip_special, as_ids) for t in tokens]
        return {"tokens": pieces, "token_logprobs": list(lps), "top_logprobs": top_dicts, "text_offset": offsets}

    # --- /v1/chat/completions ----------------------------------------------------------------------

    def chat_prompt(self, messages: list[Message], add_generation_prompt: bool, continue_final_message: bool,
                    tools: list[dict] | None = None, variables: dict | None = None) -> list[int]:
        """The prompt ids of chat messages (and the tools they may call) in the model's template,
        with the request's `chat_template_kwargs` as more `variables` (chat completions, /tokenize)."""
        if self.template is None:
            raise ApiError(400, f"{self.name} has no chat template ({self.no_template}); for this model use "
                           "/v1/completions", "messages")
        messages = [m.for_template() for m in messages]
        if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise ApiError(400, "continue_final_message continues the last message, which must be the assistant's, "
                           "and needs add_generation_prompt=false (the two open different turns)", "messages")
        try:
            return self.template.prompt(messages, add_generation_prompt, continue_final_message, tools, variables)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None

    async def chat(self, body: ChatBody) -> dict | AsyncIterator[str]:
        arrived = time.monotonic()
        self.check_model(body.model)
        self.check_token_fields(body)
        ids = self.chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message,
                               template_tools(body.tools), body.chat_template_kwargs)
        tools = body.tool_use(call_format(self.template.source))
        if tools is not None and tools.choice == "auto" and body.skip_special_tokens and self.special(tools.mark()):
            body = body.model_copy(update={"skip_special_tokens": False})  # the text keeps the calls' tag, as vLLM's
        # a thinking template's answer: whether its thought is open from its start (None: no thought to part);
        # a format holds what follows a free thought, unless it spells the thought's tags itself
        opened = left_open(self.decode(ids)) if thinks(self.template.source) else None
        thought = None if body.writes_thought() else opened
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self.model.cfg.seq_len - len(ids) if limit is None else limit
        if max_tokens < 1 and limit is None:
            raise ApiError(400, f"the messages take {len(ids)} tokens, all of this model's context of "
                           f"{self.model.cfg.seq_len}: send fewer or shorter messages", "messages")
        self.check_fits(ids, max_tokens, "messages")
        body.check(max_tokens)
        ends = (*self.model.stop_ids, *self.template.stop_ids)
        stop_ids = body.stop_ids(ends)
        grammar = await asyncio.to_thread(self.grammar, body, ends, tools, thought) if body.formatted() else None
        k = (body.top_logprobs or 0) if body.logprobs else None
        if body.stream:
            calls = [tools.stream() for _ in range(body.n)] if tools is not None else None
            thoughts = [StreamedThought(opened) for _ in range(body.n)] if opened is not None else None

            def chunk(n: int, piece: str, drawn: list | None, start: int, finish: str | None) -> dict | None:
                delta = {}
                if thoughts is not None:
                    reasoning, piece = thoughts[n].push(piece, last=finish is not None)
                    delta = {"reasoning": reasoning} if reasoning else {}
                if calls is not None:
                    more, finish = calls[n].delta(piece, finish)
                    delta.update(more or {})
                elif piece or thoughts is None:
                    delta["content"] = piece
                if not delta:  # text held back (a tool call's, a tail that may begin a tag) or none
                    if finish is None:
                        return None
                    delta = {"content": ""}
                return {"delta": delta, "logprobs": None if drawn is None else {"content": [
                    self.chat_logprob(t, lp, top[:k], body.skip_special_tokens, body.return_tokens_as_token_ids)
                    for t, lp, top in drawn]}, "finish_reason": finish}

            first = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            return self.stream(body, "chat.completion.chunk", [(ids, max_tokens, stop_ids, j) for j in range(body.n)],
                               len(ids), chunk, [first] * body.n, k, arrived, grammar)
        results = await self.run([Job(self.row(body, ids, max_tokens, stop_ids, j), top_logprobs=k, grammar=grammar)
                                  for j in range(body.n)])
        choices, used = [], 0
        for j, result in enumerate(results):
            new, text, finish = self.cut(result.sampled, body)
            used += spent(new, result.sampled)
            logprobs = None
            if body.logprobs:
                logprobs = {"content": [self.chat_logprob(t, lp, top[:k], body.skip_special_tokens,
                                                          body.return_tokens_as_token_ids)
                                        for t, lp, top in zip(new, result.sampled.logprobs, result.sampled.top)]}
            message, finish = chat_message(text, finish, tools, opened)
            choices.append({"index": j, "message": message, "logprobs": logprobs, "finish_reason": finish})
        self.metrics.answered("/v1/chat/completions", len(ids), used, time.monotonic() - arrived)
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": choices, "usage": self.usage(len(ids), used, results[0].cached_tokens)}

    # --- stream: true ---------------------------------------------------------------------------

    async def stream(self, body: _Body, kind: str, rows: list[tuple[list[int], int, tuple[int, ...], int]],
                     prompt_tokens: int, chunk: Callable[[int, str, list | None, int, str | None], dict | None],
                     firsts: list[dict] | None, top_logprobs: int | None, arrived: float,
                     grammar: Grammar | None = None) -> AsyncIterator[str]:
        """Server-sent events, OpenAI's: a chunk per piece of text as the tokens are drawn (each
        choice's own `index`), a last chunk per choice with its `finish_reason`, with
        `stream_options.include_usage` a chunk with the usage, then `data: [DONE]`. `rows`: each
        choice's prompt ids, max_tokens, stop ids and number among its prompt's `n`;
        `chunk(n, piece, drawn, start, finish)` is choice n's body for a chunk (None: none to send
        yet, as for a tool call's text): `drawn`, the (token, log-probability, alternatives) of the
        tokens whose log-probabilities it carries (None when `top_logprobs` is None: none were
        asked for), `start` where the first one's text begins among the new text, `finish` the
        finish_reason with the choice's last piece. A token's log-probabilities come with the
        first chunk sent once its text is out (or with the choice's last), so that the chunks'
        add up to those the request gets without streaming. `firsts[n]`, if given, opens choice
        n. An error after the first chunk comes as an `error` event: the status line was sent
        already. `arrived`: when the request came (monotonic), for the metrics; `grammar`: its
        structured output, if any."""
        loop = asyncio.get_running_loop()
        arrivals: asyncio.Queue = asyncio.Queue()  # (choice, token index, drawn token) or (choice, None, finished job)
        stops, skip = body.stop_strings(), body.skip_special_tokens
        decode = functools.partial(self.decode, skip_special=skip)
        texts = [TextStream(decode, stops, body.include_stop_str_in_output) for _ in rows]
        drawn: list[list[tuple[int, float | None, list]]] = [[] for _ in rows]  # each choice's tokens so far
        ends: list[list[int]] = [[] for _ in rows]  # where each one's text ends, as `cut` counts
        given = [0] * len(rows)  # of each choice's tokens, how many went out with their log-probabilities

        def body_of(n: int, piece: str, upto: int, finish: str | None = None) -> dict | None:
            """Choice n's chunk: `piece`, and the tokens given[n]:upto (those of a chunk not sent go with the next)."""
            start = ends[n][given[n] - 1] if given[n] else 0
            choice = chunk(n, piece, None if top_logprobs is None else drawn[n][given[n]:upto], start, finish)
            if choice is not None:
                given[n] = max(given[n], upto)
            return choice
        head = {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(12)}", "object": kind,
                "created": int(time.time()), "model": self.name}
        usage = body.stream_options is not None and body.stream_options.include_usage

        def event(choices: list[dict]) -> str:
            return f"data: {json.dumps({**head, 'choices': choices, **({'usage': None} if usage else {})})}\n\n"

        def deliver(item: tuple) -> None:  # from the scheduler's thread
            if not loop.is_closed():  # closed: the server is gone, and nobody reads the stream
                loop.call_soon_threadsafe(arrivals.put_nowait, item)

        futures = []
        for n, (ids, max_tokens, stop_ids, j) in enumerate(rows):
            row = self.row(body, ids, max_tokens, stop_ids, j, lambda i, *token, n=n: deliver((n, i, token)))
            futures.append(self.scheduler.submit(Job(row, top_logprobs=top_logprobs, grammar=grammar)))
            futures[-1].add_done_callback(lambda done, n=n: deliver((n, None, done)))
        used, cached, pending, first_sent = 0, 0, set(range(len(rows))), False
        try:
            for n, first in enumerate(firsts or []):
                yield event([{"index": n, **first}])
            while pending:
                n, i, item = await arrivals.get()
                if i is not None:
                    if i == len(drawn[n]):  # else a failed batch's row, run again, sends its tokens again
                        drawn[n].append(item)
                        ends[n].append((ends[n][-1] if ends[n] else 0) + len(self.piece(item[0], skip)))
                    piece = texts[n].push(i, item[0])
                    if piece:  # with the tokens whose whole text is out now
                        if not first_sent:
                            self.metrics.first_token.observe(time.monotonic() - arrived)
                            first_sent = True
                        choice = body_of(n, piece, bisect.bisect_right(ends[n], len(texts[n].sent)))
                        if choice is not None:
                            yield event([{"index": n, **choice}])
                    continue
                result = item.result()  # the finished job: the tokens were all sent before it
                sampled = result.sampled
                cached += result.cached_tokens if rows[n][3] == 0 else 0  # each prompt once, as usage counts it
                new, text, finish = self.cut(sampled, body)
                used += spent(new, sampled)
                pending.discard(n)
                drawn[n] = list(zip(new, sampled.logprobs, sampled.top))
                yield event([{"index": n, **body_of(n, texts[n].rest(text), len(new), finish)}])
        except Exception as e:  # noqa: BLE001 - the client gets it as the stream's last event
            status, message = (e.status, e.message) if isinstance(e, ApiError) else (
                500, f"the model failed on this request: {type(e).__name__}: {e}")
            yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'code': status}})}\n\n"
        else:
            self.metrics.answered("/v1/completions" if kind == "text_completion" else "/v1/chat/completions",
                                  prompt_tokens, used, time.monotonic() - arrived)
            if usage:
                totals = self.usage(prompt_tokens, used, cached)
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': totals})}\n\n"
        finally:  # a client that went away (the stream closed early) frees its choices' slots
            for future in futures:
                future.cancel()
        yield "data: [DONE]\n\n"

    def chat_logprob(self, token: int, lp: float, top: list[tuple[int, float]], skip_special: bool,
                     as_ids: bool = False) -> dict:
        def entry(t: int, value: float) -> dict:
            piece = self.label(t, skip_special, as_ids)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

        return {**entry(token, lp), "top_logprobs": [entry(t, v) for t, v in top]}

    # --- the rest ---------------------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "kiln",
                "max_model_len": self.model.cfg.seq_len}

    def tokenizer_info(self) -> dict:
        tok = self.model.tokenizer
        bos = None if self.model.bos_id is None else tok.id_to_token(self.model.bos_id)
        return {"tokenizer_class": "kiln", "eos_token": tok.id_to_token(self.model.eos_id), "bos_token": bos,
                "pad_token": None, "model_max_length": self.model.cfg.seq_len,
                "chat_template": None if self.template is None else self.template.source}


def chat_message(text: str, finish: str, tools: ToolChoice | None, opened: bool | None) -> tuple[dict, str]:
    """A chat answer's message and finish_reason: its thought apart as `reasoning` (`opened`: whether
    the thought is open from its start; None: no thought to part), the tool calls `tools` ask for read
    from what follows (evaluation/reasoning.py, evaluation/tools.py)."""
    reasoning = None
    if opened is not None:
        reasoning, text = split(text, opened)
    message, finish = tools.message(text, finish) if tools is not None else (
        {"role": "assistant", "content": text}, finish)
    if reasoning is not None:  # it thought: what it did not write is null, as vLLM has it
        message = {**message, "content": message["content"] or None, "reasoning": reasoning or None}
    return message, finish


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request's `n`: the request's own for the first (so n=1 and
    the first of n=8 give the same answer), and one fixed by (seed, choice) for each other."""
    if choice == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{choice}".encode()).digest()[:8], "big")


def spent(kept: list[int], sampled: Sampled) -> int:
    """Completion tokens: those kept, and the stop token that ended them (when no stop string did)."""
    return len(kept) + int(sampled.stopped and len(kept) == len(sampled.ids))


# --- the app -----------------------------------------------------------------------------------------


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """One line per problem pydantic found, each naming the field and what it got."""
    lines, param = [], None
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        if err["type"] == "json_invalid":
            return (f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')}): "
                    "send a JSON object with Content-Type: application/json"), None
        if not loc and err["type"] in ("model_attributes_type", "model_type", "dict_type"):
            got = err.get("input")  # bytes when the content type was not JSON, else the parsed value
            return (f"the request body must be a JSON object (got {got!r:.80}): send one with "
                    "Content-Type: application/json"), None
        if err["type"] == "extra_forbidden":
            lines.append(f"{field}: not a field kiln serve-model takes (docs/serving.md lists them)")
        elif err["type"] == "missing":
            lines.append(f"{field}: required")
        else:
            got = err.get("input")
            lines.append(f"{field}: {err['msg'].removeprefix('Value error, ')} (got {got!r:.80})")
    return "; ".join(lines), param


class RequireKey:
    """ASGI middleware: with an API key set, every /v1 request must carry `Authorization: Bearer
    <key>` (what OpenAI's clients send as their api_key), else a 401 (vLLM's --api-key rule: the
    health, metrics and tokenizer endpoints stay open)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(sent, self.expected):
                reason = ("no Authorization header" if not sent else
                          "the Authorization header's key is not this server's")
                response = error_body(401, f"{reason}: this server takes requests with `Authorization: Bearer "
                                      "<key>` (the key `kiln serve-model --api-key` was given; an OpenAI client's "
                                      "api_key)", code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(service: Service, api_key: str | None = None) -> FastAPI:
    """The HTTP app over `service`; with `api_key`, /v1 requests need it (RequireKey)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(service.scheduler.close)

    app = FastAPI(title="kiln serve-model", lifespan=lifespan)
    app.state.service = service
    if api_key:
        app.add_middleware(RequireKey, key=api_key)
    app.add_middleware(CountRequests, metrics=service.metrics)  # added last, so outermost: 401s count too

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, e: ApiError):
        return error_body(e.status, e.message, e.param, e.kind, "model_not_found" if e.status == 404 else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, e: RequestValidationError):
        message, param = _validation_message(e)
        return error_body(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(request: HttpRequest, e: HTTPException):
        hint = " (this server has GET /v1/models, POST /v1/completions, POST /v1/chat/completions)"
        return error_body(e.status_code, f"{request.method} {request.url.path}: {e.detail}{hint}",
                          kind="invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _failed(request: HttpRequest, e: Exception):
        return error_body(500, f"the model failed on this request: {type(e).__name__}: {e}", kind="server_error")

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        service.check_model(name)
        return service.model_card()

    async def answer(request: HttpRequest, work: Awaitable[dict | AsyncIterator[str]]) -> Response | dict:
        """`work`'s answer (a stream's events as they come); if the client disconnects before it,
        `work` is cancelled, which takes its jobs out of the scheduler's slots (a client that gave
        up, as one that times out and retries, leaves nothing decoding for nobody), and the
        answer is a 499 that nobody reads (nginx's "client closed request", for the metrics)."""
        task = asyncio.ensure_future(work)
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        result = task.result()
        return result if isinstance(result, dict) else StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HttpRequest):
        return await answer(request, service.completions(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: HttpRequest):
        return await answer(request, service.chat(body))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text, content_type = service.metrics.exposition()
        return Response(text, media_type=content_type)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return service.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        if body.messages is not None:
            ids = service.chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message,
                                      template_tools(body.tools), body.chat_template_kwargs)
        else:
            ids = service.tok.encode(body.prompt, add_special_tokens=False).ids
        return {"tokens": ids, "count": len(ids), "max_model_len": service.model.cfg.seq_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        return {"prompt": service.decode(body.tokens)}

    return app


def default_name(path: Path) -> str:
    """`<stage>/<version>` of a store folder (train/3f9c0a1b2c4d), else the folder's name."""
    path = Path(path).resolve()
    return f"{path.parent.name}/{path.name}" if (path / "lineage.json").is_file() else path.name


def weights_bytes(model: Model) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(model.params))


def serve_model(path: Path, host: str = "127.0.0.1", port: int = 8000, tokenizer_dir: Path | None = None,
                name: str | None = None, max_batch: int = 8, api_key: str | None = None, dtype: str | None = None,
                max_model_len: int | None = None, prefix_tokens: int | None = None) -> None:
    """Load the model at `path` (computing in `dtype`, its context capped at `max_model_len`:
    `evaluation.generate.load`) and serve it until SIGTERM or SIGINT: then stop taking connections,
    answer the requests in flight, and return. With `api_key`, /v1 requests must carry it. The
    prefix cache keeps `prefix_tokens` prompt tokens (None: `default_prefix_tokens`; 0: none)."""
    import uvicorn

    from evaluation.generate import load
    from evaluation.slots import free_bytes, state_bytes
    from training.capacity import gib

    if max_batch < 1:
        raise ValueError(f"--max-batch {max_batch}: give at least 1")
    if prefix_tokens is not None and prefix_tokens < 0:
        raise ValueError(f"--prefix-cache-tokens {prefix_tokens}: give 0 (no prefix cache) or more")
    model = load(Path(path), tokenizer_dir, dtype, max_model_len)
    prefix_tokens = default_prefix_tokens(model.cfg, max_batch) if prefix_tokens is None else prefix_tokens
    kept = pool_bytes(model.cfg, prefix_tokens)
    needed, free, weights = state_bytes(model.cfg, max_batch), free_bytes(), weights_bytes(model)
    if free is not None and needed + kept > free:  # say so now, not as an out-of-memory error at the first request
        raise ValueError(f"{max_batch} slots of {model.cfg.seq_len} tokens need {gib(needed)} of key/value cache and "
                         f"the prefix cache of {prefix_tokens} tokens {gib(kept)}, and {gib(free)} is free beside the "
                         f"weights ({gib(weights)}): give a smaller --max-model-len, --max-batch or "
                         "--prefix-cache-tokens")
    service = Service(model, name or default_name(path), max_batch, prefix_tokens)
    url = f"http://{host}:{port}/v1"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"kiln serve-model: {service.name} at {url} (context {model.cfg.seq_len} tokens, "
                      f"up to {max_batch} prompts decoding at once; {model.cfg.compute_dtype}, weights "
                      f"{gib(weights)}, slots {gib(needed)}, prefix cache {gib(kept)}; "
                      f"{'an API key' if api_key else 'no API key'} required); SIGTERM or Ctrl-C stops it", flush=True)

    config = uvicorn.Config(create_app(service, api_key), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=30)
    # uvicorn handles SIGTERM/SIGINT (stop accepting, finish requests in flight), then raises the
    # signal again for the handler it found: a no-op one, so a clean stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    Server(config).run()

