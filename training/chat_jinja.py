"""A Hugging Face checkpoint's own Jinja chat template, for prompting it and for post-training it.

Rendered as transformers' `apply_chat_template` renders it: a sandboxed Jinja environment with the
same options and helpers, the tokenizer's special tokens' text as variables, and the text tokenized
without added tokens (special-token strings become their tokens, as there). So a Qwen2 or Llama 3
Instruct checkpoint gets the prompt it was tuned on, and SFT and DPO of it learn that format.

A Jinja template does not say which of its tokens are the assistant's, so `encode` finds them the
way a chat request sees them: for each assistant message, the conversation before it rendered with
the generation prompt is where the answer starts, and the conversation up to it ends it (its
trailing spacing left out: the reply stops at its end-of-turn token). The pieces are tokenized one
by one, so the ids before an answer are exactly the prompt a server sends for it. A template for
which the earlier turns are not a prefix of the later ones (one that rewrites history, as
reasoning templates drop past thoughts) is refused, saying so.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

# the variables transformers gives a template besides the messages: the special tokens' text
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# marks where a continued final message's text ends; its trailing space shows whether the template
# trimmed the message's end (then the text is cut before any spacing, as transformers cuts it)
_CONTINUE_MARK = "<kiln-continue> "
_PROBE = [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "kiln-probe-answer"}]


class CheckpointTemplate:
    """A checkpoint's Jinja chat template with its tokenizer. For serving, its turn ends at a token
    the checkpoint lists as EOS (evaluation.generate.Model.stop_ids), so it adds no stop of its own."""

    name = "the checkpoint's chat template"
    stop_ids: tuple[int, ...] = ()

    def __init__(self, source: str, tokenizer: Tokenizer, special_tokens: dict[str, str]):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _generation_block()])
        # transformers' helpers: tojson without HTML escaping, the date for templates that print it
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.source, self.template = source, env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"its chat template does not parse as Jinja (line {e.lineno}: {e.message})") from None
        self.tok = Tokenizer.from_str(tokenizer.to_str())
        self.tok.encode_special_tokens = False  # the template's special-token strings become their tokens
        self.special_tokens = special_tokens

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               variables: dict | None = None) -> str:
        """The prompt's text. Continuing the final message renders it with a mark after its text and
        cuts there, so the answer goes on from it; where the template trims the message's end, the
        spacing before the mark goes too. `tools`: OpenAI's tool definitions, which the template
        reads as `tools` (None when there are none, as transformers passes it). `variables`: more
        of them (Qwen3's `enable_thinking`), which may set the special tokens' but not these."""
        import jinja2

        taken = sorted(set(variables or {}) & {"messages", "add_generation_prompt", "tools"})
        if taken:
            raise ValueError(f"the chat template's variables {taken} are the request's own fields: set them there, "
                             "not in chat_template_kwargs")
        messages = [dict(m) for m in messages]
        if continue_final_message:
            messages[-1]["content"] += _CONTINUE_MARK
        try:
            text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **{**self.special_tokens, **(variables or {})})
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the checkpoint's chat template refused the messages: {e}") from None
        if continue_final_message:
            mark = _CONTINUE_MARK.strip()
            if mark not in text:
                raise ValueError("the checkpoint's chat template leaves out the final message's text, so it cannot "
                                 "be continued: send it with continue_final_message false")
            at = text.rindex(mark)
            text = text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
        return text

    def prompt(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               variables: dict | None = None) -> list[int]:
        return self._ids(self.render(messages, add_generation_prompt, continue_final_message, tools, variables))

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    # --- post-training ------------------------------------------------------------------------

    def answer_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and, per assistant message, the characters of its answer: from
        where the generation prompt before it ends to its end-of-turn text (trailing spacing out)."""
        text = self.render(messages, add_generation_prompt=False)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1], add_generation_prompt=False).rstrip()
            done = spans[-1][1] if spans else 0
            if not (text.startswith(before) and text.startswith(upto) and done <= len(before) < len(upto)):
                raise ValueError(f"the checkpoint's chat template does not render the conversation before assistant "
                                 f"message {i} (with its generation prompt) as the start of the whole one, so kiln "
                                 "cannot tell which tokens are the answer: post-train it with a template that keeps "
                                 "earlier turns as they are")
            spans.append((len(before), len(upto)))
        return text, spans

    def encode(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """(ids, loss mask): the mask is 1 on each assistant answer and its end-of-turn token. The
        text between answers and the answers are tokenized apart, as a server prompts and a model
        answers."""
        from training.chat_template import check_messages

        text, spans = self.answer_spans(check_messages(messages))
        if add_generation_prompt:
            prompt = self.render(messages, add_generation_prompt=True)
            if not prompt.startswith(text):
                raise ValueError("the checkpoint's chat template renders the generation prompt by changing the "
                                 "conversation before it: kiln cannot encode it for post-training")
            text = prompt
        ids: list[int] = []
        mask: list[int] = []
        at = 0
        for start, end in [*spans, (len(text), len(text))]:
            for piece, learn in ((text[at:start], 0), (text[start:end], 1)):
                piece_ids = self._ids(piece) if piece else []
                ids += piece_ids
                mask += [learn] * len(piece_ids)
            at = end
        return ids, mask

    def answer_text(self, prompt: list[dict], answer: str) -> str:
        """`answer` as the template renders it after `prompt`'s generation prompt, to its end of turn:
        what a model should generate (chat evaluation's choices and targets)."""
        text, spans = self.answer_spans([*prompt, {"role": "assistant", "content": answer}])
        start, end = spans[-1]
        return text[start:end]

    @functools.cached_property
    def end_text(self) -> str:
        """The text that ends an assistant turn (`<|im_end|>`, `<|eot_id|>`), found by rendering a
        short conversation: what follows the answer's own text."""
        answer = _PROBE[1]["content"]
        rendered = self.answer_text(_PROBE[:1], answer)
        end = rendered.partition(answer)[2].strip()
        if answer not in rendered or not end:
            raise ValueError(f"the checkpoint's chat template renders an answer as {rendered!r}: nothing after the "
                             "answer's text ends the turn, so a reply could not stop")
        return end

    @functools.cached_property
    def end_id(self) -> int:
        """The token that ends an assistant turn, where replies stop."""
        ids = self._ids(self.end_text)
        if len(ids) != 1:
            raise ValueError(f"the checkpoint's chat template ends a turn with {self.end_text!r}, {len(ids)} tokens: "
                             "kiln stops a reply at one token (a special token of the tokenizer)")
        return ids[0]


def _generation_block():
    """`{% generation %}...{% endgeneration %}`, which transformers' templates may use to mark the
    assistant's text for its assistant-token mask: rendered as its body (kiln finds the answers by
    rendering, `answer_spans`), so such templates parse and render as there."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


def checkpoint_template(folder: Path) -> tuple[str | None, dict[str, str]]:
    """A Hugging Face folder's chat template (chat_template.jinja, else tokenizer_config.json's
    `chat_template`: a string, or named templates of which `default`) and its special tokens' text."""
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken, as HF writes some
        if isinstance(value, str):
            special[key] = value
    jinja = Path(folder) / "chat_template.jinja"
    source = jinja.read_text() if jinja.is_file() else config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source}
        source = named.get("default")
    return source, special
