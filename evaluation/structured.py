"""Structured outputs for `kiln serve-model`: an answer held to a JSON schema, a regex, a list of
choices or a Lark grammar, as OpenAI's `response_format` and vLLM's `structured_outputs` ask.

llguidance (the parser vLLM and SGLang use for this) reads the model's own `tokenizer.json` and
says, before each token, which tokens the grammar allows next; the others get a bias of -inf in
the row's logit bias (evaluation/slots.py applies it with the request's own `logit_bias`), so
whatever the sampling settings, every drawn token keeps the text inside the grammar. Once the
grammar is complete only a stop token is allowed, and the answer ends there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance
import numpy as np
from tokenizers import Tokenizer

# Compact JSON (`{"a":1}`): with whitespace allowed anywhere, a small model spends its tokens on it
JSON_OPTIONS = {"whitespace_flexible": False}


def vocabulary(tokenizer_json: str, vocab_size: int, stop_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a model's tokenizer: each of the model's `vocab_size` ids' bytes (ids
    past the tokenizer's are never allowed), and the stop ids that end a complete answer.

    llguidance takes every added token of a tokenizer.json for a special one, which no text of a
    grammar contains; but an added token the tokenizer does not mark special is plain text that
    answers write (Qwen2.5's `<tool_call>`), and llguidance 1.9 may even force one that it then
    refuses to consume. For such a tokenizer the view is built again from each token's bytes,
    with only the tokens marked special as special."""
    whole = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(stop_ids))
    added = json.loads(tokenizer_json).get("added_tokens") or []
    if all(token["special"] for token in added):
        return whole
    tokenizer = Tokenizer.from_str(tokenizer_json)
    size = tokenizer.get_vocab_size(with_added_tokens=True)

    class Plain:  # what llguidance.TokenizerWrapper reads; ids past the tokenizer's are special, never allowed
        eos_token_id, bos_token_id = stop_ids[0], None
        tokens = [whole.decode_bytes([i]) if i < size else f"<unused-{i}>".encode() for i in range(vocab_size)]
        special_token_ids = [*(token["id"] for token in added if token["special"]), *range(size, vocab_size)]

        def __call__(self, text: str) -> list[int]:  # str only: llguidance tries bytes first, and then sends str
            return tokenizer.encode(text, add_special_tokens=False).ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Plain()), n_vocab=vocab_size, eos_token=list(stop_ids))


def json_grammar(schema: dict) -> str:
    """The llguidance grammar of JSON that follows `schema` (compact: `JSON_OPTIONS`)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)


def after_thought(grammar: str, opened: bool) -> str:
    """`grammar` held after a thinking model's thought (evaluation/reasoning.py): a free thought
    ended by `</think>` (one the prompt `opened`, or one the answer may open with `<think>`), then
    spacing, then the answer under `grammar` (an llguidance grammar of one part, named "answer" and
    referred to from the thought's Lark grammar), as vLLM holds a reasoning model's answer."""
    parts = json.loads(grammar)["grammars"]
    if len(parts) != 1:
        raise ValueError(f"a grammar of {len(parts)} parts cannot follow a thought: send one")
    thought = 'thought[stop="</think>"]: /(.|\\n)*/\n'
    start = "start: thought /[ \\n]*/ @answer\n" if opened else 'start: ("<think>" thought /[ \\n]*/)? @answer\n'
    return json.dumps({"grammars": [{"lark_grammar": start + thought}, {**parts[0], "name": "answer"}]})


def grammar_of(response_format: dict | None, structured_outputs: dict | None) -> str | None:
    """The llguidance grammar a request asks for; None for free text. `response_format`: OpenAI's
    ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}});
    `structured_outputs`: vLLM's, exactly one of json (a schema), regex, choice (a list of
    strings) or grammar (Lark). ValueError names what is wrong."""
    if response_format is not None and structured_outputs is not None:
        raise ValueError("give response_format or structured_outputs, not both")
    if response_format is not None:
        kind = response_format["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return json_grammar({"type": "object"})
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValueError("type json_schema needs json_schema.schema, a JSON schema")
        return json_grammar(schema)
    if structured_outputs is None:
        return None
    given = {k: v for k, v in structured_outputs.items() if v is not None}
    if len(given) != 1:
        raise ValueError(f"structured_outputs takes exactly one of json, regex, choice or grammar (got "
                         f"{', '.join(sorted(given)) or 'none'})")
    (kind, value), = given.items()
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        return json_grammar(schema)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not value:
            raise ValueError("structured_outputs.choice needs at least one string")
        either = "|".join(re.escape(choice) for choice in value)
        return llguidance.LLMatcher.grammar_from_regex(f"({either})")
    return llguidance.LLMatcher.grammar_from_lark(value)


def compile_grammar(grammar: str, tokens: llguidance.LLTokenizer) -> "Grammar":
    """`grammar` built over the model's vocabulary (`vocabulary`), once per request (milliseconds
    for a schema of dozens of fields, done before the request reaches the engine); ValueError with
    llguidance's message where it cannot be (a bad regex, a schema type it does not know)."""
    start = llguidance.LLMatcher(tokens, grammar, log_level=0)
    if start.is_error():
        raise ValueError(start.get_error().strip())
    return Grammar(start)


@dataclass(frozen=True)
class Grammar:
    """A request's grammar, built: its matcher at the start, which each answer (each of `n`
    choices, each run again after a failed batch) copies to follow on its own (a copy takes
    about 0.1 ms)."""

    start: llguidance.LLMatcher

    def guide(self) -> "Guide":
        return Guide(self.start.deep_copy())


class Guide:
    """One answer's place in its grammar: the tokens it may draw next, as a logit bias."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def mask(self) -> np.ndarray:
        """float32 [vocab]: 0 where the grammar allows the token next, -inf elsewhere."""
        allowed = np.frombuffer(self.matcher.compute_logit_bias(), np.uint8)
        return np.where(allowed > 0, 0.0, -np.inf).astype(np.float32)

    def advance(self, token: int) -> None:
        """The grammar past `token`; a token it does not allow is a kiln bug (the mask forbade it)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} breaks the answer's grammar: {self.matcher.get_error()}")
