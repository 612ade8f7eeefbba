"""A thinking model's reasoning apart from its answer, for `kiln serve-model`'s chat completions:
the text a model writes inside `<think>...</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills,
SmolLM3) goes to the message's `reasoning`, the text after it to `content` (where tool calls are
then read), as vLLM's reasoning parsers give them (vLLM's field, once called `reasoning_content`).

A template that writes `</think>` is a thinking one. The thought is open from the answer's start
where the prompt left a `<think>` open (a template that opens it in the generation prompt), or
where the answer starts with `<think>`; an answer cut before `</think>` is all reasoning. Spacing
around the thought is dropped, and at the start of the content after it.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinks(template_source: str | None) -> bool:
    """Whether a chat template's answers think in tags (it writes `</think>`)."""
    return bool(template_source) and THINK_CLOSE in template_source


def left_open(prompt_text: str) -> bool:
    """Whether a prompt ends inside a thought (its last `<think>` not closed)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def split(text: str, opened: bool) -> tuple[str | None, str]:
    """(the reasoning, None for an answer that did not think; the text after it)."""
    if not opened:
        start = text.lstrip()
        if not start.startswith(THINK_OPEN):
            return None, text
        text = start[len(THINK_OPEN):]
    at = text.find(THINK_CLOSE)
    if at < 0:
        return text.strip(), ""
    return text[:at].strip(), text[at + len(THINK_CLOSE):].lstrip()


def _undecided(text: str) -> int:
    """How many characters at the end of `text` could begin a tag, so wait for the next piece."""
    return max(next((k for k in range(len(tag) - 1, 0, -1) if text.endswith(tag[:k])), 0)
               for tag in (THINK_OPEN, THINK_CLOSE))


@dataclass
class StreamedThought:
    """One streamed answer split as `split` splits the whole: each piece of text in, the new
    reasoning and content out, holding back what the text to come could still change (a tail
    that may begin a tag, spacing that may end the thought), so the pieces add up to `split`'s."""

    opened: bool
    text: str = ""
    reasoning: str = ""  # sent so far
    content: str = ""

    def push(self, piece: str, last: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) after `piece`; `last`: the answer ends with it."""
        self.text += piece
        settled = self.text if last else self.text[:len(self.text) - _undecided(self.text)]
        if not (last or self.opened) and THINK_OPEN.startswith(settled.lstrip()):
            return "", ""  # it may yet open a thought
        reasoning, content = split(settled, self.opened)  # stripped: spacing waits for what follows it
        reasoning = reasoning or ""
        new = reasoning[len(self.reasoning):], content[len(self.content):]
        self.reasoning, self.content = reasoning, content
        return new
