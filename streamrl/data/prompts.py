"""Turning prompt text into the token ids an engine receives (through the chat template)."""

from __future__ import annotations


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn user message followed by the opening of the assistant turn."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return list(ids)


def encode_response(tokenizer, text: str) -> list[int]:
    """Token ids of an assistant answer, closed by the end-of-turn token."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
