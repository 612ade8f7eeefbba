"""Chat prompts for `kiln serve-model`'s /v1/chat/completions and `kiln generate --chat`.

A post-trained kiln model (SFT, DPO, or its export) is prompted with post-training's own template
(training/posttrain.py: the same ids it learned from, special-token strings in a message kept as
text). A Hugging Face checkpoint is prompted with its own Jinja `chat_template`
(tokenizer_config.json, or chat_template.jinja beside it) rendered as transformers'
`apply_chat_template` renders it: a sandboxed Jinja environment with the same options and helpers,
the tokenizer's special tokens as variables, and the rendered text tokenized without added tokens
(special-token strings become their tokens, as there), so a Qwen2 or Llama 3 Instruct checkpoint
gets the prompt it was tuned on.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

from training.posttrain import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE, ChatTemplate

# the variables transformers gives a template besides the messages: the special tokens' text
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# marks where a continued final message's text ends; its trailing space shows whether the template
# trimmed the message's end (then the text is cut before any spacing, as transformers cuts it)
_CONTINUE_MARK = "<kiln-continue> "


class KilnChat:
    """Post-training's template (training.posttrain.ChatTemplate) for a model with its chat tokens."""

    def __init__(self, model):
        self.template = ChatTemplate(model.tokenizer)
        self.start_id = model.start_id
        self.source = CHAT_TEMPLATE
        self.stop_ids = (self.template.end_id,)  # the end of the assistant's turn

    def prompt(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> list[int]:
        ids, _ = self.template.encode(messages, add_generation_prompt=add_generation_prompt)
        if continue_final_message:
            ids = ids[:-1]  # the last message without its end-of-turn token: the answer goes on from its text
        return [self.start_id, *ids]  # before every document in training, so before a conversation


class CheckpointChat:
    """A Hugging Face checkpoint's own Jinja chat template. Its turn ends at a token the
    checkpoint lists as EOS (config.json, generation_config.json: Model.stop_ids), so it adds none."""

    stop_ids: tuple[int, ...] = ()

    def __init__(self, source: str, tokenizer: Tokenizer, special_tokens: dict[str, str]):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
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
               continue_final_message: bool = False) -> str:
        """The prompt's text. Continuing the final message renders it with a mark after its text and
        cuts there, so the answer goes on from it; where the template trims the message's end, the
        spacing before the mark goes too."""
        import jinja2

        messages = [dict(m) for m in messages]
        if continue_final_message:
            messages[-1]["content"] += _CONTINUE_MARK
        try:
            text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
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
               continue_final_message: bool = False) -> list[int]:
        text = self.render(messages, add_generation_prompt, continue_final_message)
        return self.tok.encode(text, add_special_tokens=False).ids


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


def chat_for(model) -> KilnChat | CheckpointChat:
    """The chat prompt of `model` (evaluation.generate.Model), or ValueError saying why it has none."""
    if model.chat_template is not None and model.chat_template != CHAT_TEMPLATE:
        return CheckpointChat(model.chat_template, model.tokenizer, model.template_tokens)
    missing = [t for t in CHAT_SPECIAL_TOKENS if model.tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"its tokenizer lacks the chat tokens {missing} and it has no chat template of its own: chat "
                         "needs a post-trained model (an SFT or DPO output, or its export) or a Hugging Face "
                         "checkpoint with a chat_template")
    return KilnChat(model)
