"""Chat prompts for `kiln serve-model`'s /v1/chat/completions and `kiln generate --chat`.

A post-trained kiln model (SFT, DPO, or its export) is prompted with post-training's own template
(training/posttrain.py: the same ids it learned from, special-token strings in a message kept as
text). A Hugging Face checkpoint, and a kiln model trained from one whose tokenizer carries its
template (post-trained in it, or trained on), is prompted with that Jinja `chat_template`
(tokenizer_config.json, or chat_template.jinja beside it) rendered as transformers'
`apply_chat_template` renders it (training/chat_jinja.py), so a Qwen2 or Llama 3 Instruct
checkpoint gets the prompt it was tuned on."""

from __future__ import annotations

from training.chat_jinja import CheckpointTemplate
from training.chat_template import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE, ChatTemplate


class KilnChat:
    """Post-training's template (training.chat_template.ChatTemplate) for a model with its chat tokens."""

    def __init__(self, model):
        self.template = ChatTemplate(model.tokenizer)
        self.start_id = model.start_id
        self.source = self.template.source
        self.stop_ids = (self.template.end_id,)  # the end of the assistant's turn

    def prompt(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               variables: dict | None = None) -> list[int]:
        """The prompt's ids; `tools` are left out: post-training's template has no place for them,
        nor for an earlier answer's tool calls or template variables, which are refused rather
        than dropped."""
        if variables:
            raise ValueError(f"post-training's chat template reads no variables: leave chat_template_kwargs "
                             f"({sorted(variables)}) out")
        if any(m.get("tool_calls") for m in messages):
            raise ValueError("post-training's chat template has no place for an assistant message's tool_calls: this "
                             "model cannot be shown the calls it made (a checkpoint whose own template renders them "
                             "can)")
        ids, _ = self.template.encode(messages, add_generation_prompt=add_generation_prompt)
        if continue_final_message:
            ids = ids[:-1]  # the last message without its end-of-turn token: the answer goes on from its text
        return [self.start_id, *ids]  # before every document in training, so before a conversation


def chat_for(model) -> KilnChat | CheckpointTemplate:
    """The chat prompt of `model` (evaluation.generate.Model), or ValueError saying why it has none."""
    if model.chat_template is not None and model.chat_template != CHAT_TEMPLATE:
        return CheckpointTemplate(model.chat_template, model.tokenizer, model.template_tokens)
    missing = [t for t in CHAT_SPECIAL_TOKENS if model.tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"its tokenizer lacks the chat tokens {missing} and it has no chat template of its own: chat "
                         "needs a post-trained model (an SFT or DPO output, or its export) or a Hugging Face "
                         "checkpoint with a chat_template")
    return KilnChat(model)
