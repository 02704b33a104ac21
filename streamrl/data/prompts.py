"""Turning prompt text into the token ids an engine receives (through the chat template)."""

from __future__ import annotations

NO_CHAT_TEMPLATE = (
    "the model's tokenizer has no chat template: set data.chat_template=false to feed each "
    "prompt as plain text (base models; write any format into the prompts), or add a "
    "template to the model directory (chat_template.jinja, or `chat_template` in "
    "tokenizer_config.json)"
)


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def encode_prompt(tokenizer, text: str, *, chat_template: bool = True) -> list[int]:
    """Token ids of a one-turn user message followed by the opening of the assistant turn, or
    with `chat_template=False` of the text as it is (with the tokenizer's own special tokens,
    such as a BOS): for base models, and prompts that carry their own format."""
    if not chat_template:
        return list(tokenizer(text)["input_ids"])
    if not has_chat_template(tokenizer):
        raise ValueError(NO_CHAT_TEMPLATE)
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return list(ids)


def encode_response(tokenizer, text: str) -> list[int]:
    """Token ids of an assistant answer, closed by the end-of-turn token."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


# How many more tokens a chat-templated prompt may have than its text alone plus the template's
# own tokens (merges across the boundary): prompts this close to a limit are encoded exactly.
TEMPLATE_SLACK = 8


def prompt_lengths_over(
    tokenizer, texts: list[str], limit: int, *, chat_template: bool = True
) -> dict[int, int]:
    """`{index: length}` of the `texts` whose encoded prompt is longer than `limit` tokens.

    One batched tokenization of the raw texts gives every length up to the template's own
    tokens; only the prompts near `limit` go through the chat template one by one, so a file of
    100,000 prompts takes seconds, not minutes."""
    if not texts:
        return {}
    raw = tokenizer(texts, add_special_tokens=False)["input_ids"]
    overhead = len(encode_prompt(tokenizer, "", chat_template=chat_template))
    over = {}
    for i, ids in enumerate(raw):
        if len(ids) + overhead + TEMPLATE_SLACK > limit:
            length = len(encode_prompt(tokenizer, texts[i], chat_template=chat_template))
            if length > limit:
                over[i] = length
    return over
