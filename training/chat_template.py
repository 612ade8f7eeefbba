"""kiln's chat template: conversations to token ids and loss masks.

Conversations are lists of messages `{"role": "system" | "user" | "assistant", "content": str}`.
The template puts a role token before each message and an end-of-turn token after it:

    <|user|>Continue this passage: ...<|end|><|assistant|>And God said ...<|end|>

The role and end tokens are special tokens of the tokenizer (added after GPT-2's 50256 through
`TokenizerConfig.special_tokens`), so text can never produce them. Message text is encoded as
ordinary text, the way the tokenize step encodes documents. `CHAT_TEMPLATE` is the same template
in Jinja, the form Hugging Face keeps in tokenizer_config.json, and it gives the same ids.

Its own module, apart from training.posttrain's objectives, because the data steps (the
tokenizer, chat data) read it: what they import is the code `kiln plan` compares for them, and
JAX's model and loop are not theirs.
"""

from __future__ import annotations

from tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}
END_OF_TURN = "<|end|>"
CHAT_SPECIAL_TOKENS = (*ROLE_TOKENS.values(), END_OF_TURN)  # add these to TokenizerConfig.special_tokens
TEMPLATE_FILE = "chat_template.jinja"  # beside a post-trained model's weights: what marks it as one
# The same template for Hugging Face's `apply_chat_template` (tokenizer_config.json `chat_template`).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


class ChatTemplate:
    """Conversations to token ids and loss masks, with a tokenizer that has the chat tokens. (A
    Hugging Face checkpoint's own template, training.chat_jinja.CheckpointTemplate, does the same
    for a model that keeps its checkpoint's format: tasks.tokenizer.chat_template picks.)"""

    name = "kiln's chat template"
    source = CHAT_TEMPLATE  # written beside a post-trained model's weights
    end_text = END_OF_TURN

    def __init__(self, tokenizer: Tokenizer):
        missing = [t for t in CHAT_SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"the tokenizer has no {missing}: add {list(CHAT_SPECIAL_TOKENS)} to the tokenizer "
                             "config's special_tokens (and retrain from a model with that vocabulary), or start "
                             "from a Hugging Face checkpoint whose tokenizer folder has a chat template "
                             "(tokenizer kind hf)")
        self.tok = Tokenizer.from_str(tokenizer.to_str())  # a copy: special strings in text stay text
        self.tok.encode_special_tokens = True
        self.role_ids = {role: tokenizer.token_to_id(t) for role, t in ROLE_TOKENS.items()}
        self.end_id = tokenizer.token_to_id(END_OF_TURN)

    def encode(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """(ids, loss mask): the mask is 1 on each assistant message's content and end token."""
        ids: list[int] = []
        mask: list[int] = []
        for m in check_messages(messages):
            content = self.tok.encode(m["content"], add_special_tokens=False).ids
            learn = int(m["role"] == "assistant")
            ids += [self.role_ids[m["role"]], *content, self.end_id]
            mask += [0] + [learn] * (len(content) + 1)
        if add_generation_prompt:
            ids.append(self.role_ids["assistant"])
            mask.append(0)
        return ids, mask

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               continue_final_message: bool = False) -> str:
        """The template as text (what CHAT_TEMPLATE renders), for prompts given to lm-eval;
        continuing the final message leaves its end-of-turn token out."""
        text = "".join(f"{ROLE_TOKENS[m['role']]}{m['content']}{END_OF_TURN}" for m in check_messages(messages))
        if continue_final_message:
            return text.removesuffix(END_OF_TURN)
        return text + (ROLE_TOKENS["assistant"] if add_generation_prompt else "")

    def answer_text(self, prompt: list[dict], answer: str) -> str:
        """`answer` as it follows `prompt`'s generation prompt, to its end of turn."""
        return answer + END_OF_TURN


def check_messages(messages: list[dict]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a conversation is a non-empty list of messages, got {messages!r:.200}")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"a message is {{'role': one of {list(ROLES)}, 'content': str}}, got {m!r:.200}")
    return messages
