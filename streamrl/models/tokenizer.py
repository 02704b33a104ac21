"""The project's own character-level tokenizer, built with the `tokenizers` library.

The embedded default must run with no network, so streamrl builds its tokenizer itself instead of
downloading one. Every printable ASCII character is one token, and three special tokens carry the
chat structure (`<|user|>`, `<|assistant|>`, `<|end|>`). The result is wrapped in
`PreTrainedTokenizerFast` and saved with a chat template, so the model directory loads in
transformers, vLLM and any other library that reads a standard Hugging Face tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD = "<|pad|>"
UNK = "<|unk|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
SPECIAL_TOKENS = [PAD, UNK, USER, ASSISTANT, END]

# One turn per message; `add_generation_prompt` opens the assistant turn the model completes.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """Return a character-level fast tokenizer with the chat template set."""
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"[\s\S]"), behavior="isolated"
    )  # any char, newline too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=END,
        bos_token=None,
        additional_special_tokens=[USER, ASSISTANT],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def save_tokenizer(out_dir: Path) -> None:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json, ...) into `out_dir`."""
    build_tokenizer().save_pretrained(str(out_dir))
