"""Turning a prompt into the token ids an engine receives (through the chat template).

A prompt is a text, sent as one user turn, or a conversation: a list of chat messages
(`{"role": "system" | "user" | "assistant", "content": str}`) ending with a user turn, the
conversational format of TRL's and veRL's datasets (a system prompt, few-shot turns).
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, Any]]

NO_CHAT_TEMPLATE = (
    "the model's tokenizer has no chat template: set data.chat_template=false to feed each "
    "prompt as plain text (base models; write any format into the prompts), or add a "
    "template to the model directory (chat_template.jinja, or `chat_template` in "
    "tokenizer_config.json)"
)


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


CONVERSATION_NEEDS_TEMPLATE = (
    "a conversation prompt (a list of chat messages) goes through the model's chat template: "
    "it cannot be used with data.chat_template=false"
)


def encode_prompt(tokenizer, prompt: Prompt, *, chat_template: bool = True) -> list[int]:
    """Token ids of the conversation (a text: one user turn) followed by the opening of the
    assistant turn, or with `chat_template=False` of the text as it is (with the tokenizer's
    own special tokens, such as a BOS): for base models, and prompts that carry their own
    format."""
    conversation = isinstance(prompt, list)
    if not chat_template:
        if conversation:
            raise ValueError(CONVERSATION_NEEDS_TEMPLATE)
        return list(tokenizer(prompt)["input_ids"])
    if not has_chat_template(tokenizer):
        raise ValueError(NO_CHAT_TEMPLATE)
    messages = prompt if conversation else [{"role": "user", "content": prompt}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return list(ids)


def text_of(content: str | list[dict[str, Any]]) -> str:
    """A message's text: its content, or the text parts of a multimodal content."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def encode_response(tokenizer, text: str) -> list[int]:
    """Token ids of an assistant answer, closed by the end-of-turn token."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


# How many more tokens a chat-templated prompt may have than its text alone plus the template's
# own tokens (merges across the boundary): prompts this close to a limit are encoded exactly.
TEMPLATE_SLACK = 8


def text_lengths(tokenizer, texts: list[str], chunk: int = 4096) -> list[int]:
    """Tokens of each text without special tokens, a chunk at a time: a fast tokenizer's own
    batch encoder when there is one (a third of the time of the transformers call, which also
    keeps every chunk's full encodings: about 1 GiB for 300,000 short prompts)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    lengths: list[int] = []
    for start in range(0, len(texts), chunk):
        part = texts[start : start + chunk]
        if backend is not None:
            lengths += [len(e) for e in backend.encode_batch(part, add_special_tokens=False)]
        else:
            lengths += map(len, tokenizer(part, add_special_tokens=False)["input_ids"])
    return lengths


def prompt_lengths_over(
    tokenizer, prompts: list[Prompt], limit: int, *, chat_template: bool = True
) -> dict[int, int]:
    """`{index: length}` of the `prompts` whose encoding is longer than `limit` tokens.

    One batched tokenization of the raw texts (every message's, for a conversation) gives every
    length up to the template's own tokens, which a turn adds at most `overhead +
    TEMPLATE_SLACK` of; only the prompts near `limit` go through the chat template one by one,
    so a file of 100,000 prompts takes seconds, not minutes."""
    if not prompts:
        return {}
    texts, owner = [], []  # every text to measure, and the index of the prompt it belongs to
    for i, prompt in enumerate(prompts):
        parts = [text_of(m["content"]) for m in prompt] if isinstance(prompt, list) else [prompt]
        texts += parts
        owner += [i] * len(parts)
    overhead = len(encode_prompt(tokenizer, "", chat_template=chat_template)) + TEMPLATE_SLACK
    bound = [0] * len(prompts)
    for i, length in zip(owner, text_lengths(tokenizer, texts), strict=True):
        bound[i] += length + overhead
    over = {}
    for i, most in enumerate(bound):
        if most > limit:
            length = len(encode_prompt(tokenizer, prompts[i], chat_template=chat_template))
            if length > limit:
                over[i] = length
    return over
