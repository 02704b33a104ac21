"""Chat formats: rendering, the continuation identity the ledger relies on, and tool-call parsing
that turns any model output into calls and error messages without raising."""

from __future__ import annotations

import json
import random
import string

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from streamrl.agents.chat import (
    HERMES_TEMPLATE,
    QWEN3_TEMPLATE,
    HermesFormat,
    Qwen3Format,
    StreamrlFormat,
    ToolCall,
    chat_format,
    format_for_tokenizer,
    tool_schema_text,
)
from streamrl.models.tokenizer import build_tokenizer

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
TOOLS = [SEARCH, CALCULATE]

FORMATS = [StreamrlFormat(), HermesFormat(), Qwen3Format(), Qwen3Format(enable_thinking=True)]
FORMAT_IDS = ["streamrl", "hermes", "qwen3", "qwen3-thinking"]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, *calls: tuple[str, dict]) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ]
    return message


def tool(text: str, call_id: str = "c0") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def qwen_like_tokenizer(*, think: bool = True):
    """A character-level tokenizer with Qwen's chat and tool tags as special tokens."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    specials += ["<think>", "</think>"] if think else []
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )


def sampled_turn(fmt, history: list[dict], message: dict) -> str:
    """The text of `message` as the model would sample it after `history`'s prompt."""
    prompt = fmt.render(history, TOOLS, add_generation_prompt=True)
    full = fmt.render([*history, message], TOOLS, add_generation_prompt=False)
    if isinstance(fmt, Qwen3Format) and not fmt.enable_thinking:  # the prompt holds <think>
        prompt = prompt.removesuffix("<think>\n\n</think>\n\n")
    assert full.startswith(prompt)
    return full[len(prompt) :].rstrip("\n")


# --- the built-in format --------------------------------------------------------------------


def test_builtin_render_matches_the_tokenizer_chat_template() -> None:
    tokenizer = build_tokenizer()
    messages = [user("12+3="), assistant("15"), user("7*6=")]
    for gen in (True, False):
        expected = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )
        assert StreamrlFormat().render(messages, add_generation_prompt=gen) == expected
    assert expected == "<|user|>12+3=<|end|><|assistant|>15<|end|><|user|>7*6=<|end|>"


def test_builtin_prompt_ids_end_with_the_assistant_token() -> None:
    tokenizer = build_tokenizer()
    fmt = chat_format("streamrl")
    text = fmt.render([user("1+2=")], TOOLS, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    cont = fmt.continuation([tool("3")])
    assert cont == "<|tool|>3<|end|><|assistant|>"
    cont_ids = tokenizer(cont, add_special_tokens=False)["input_ids"]
    assert cont_ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert tokenizer.convert_tokens_to_ids("<|end|>") in cont_ids


def test_builtin_renders_structured_calls_in_call_syntax() -> None:
    message = assistant("Let me see.", ("search", {"query": "it's", "k": 3}), ("calculate", {}))
    text = StreamrlFormat().render([message], add_generation_prompt=False)
    assert text == (
        '<|assistant|>Let me see.<call>search(query="it\'s", k=3)</call><call>calculate()</call>'
        "<|end|>"
    )


def test_builtin_positional_arguments_follow_the_schema_order() -> None:
    fmt = StreamrlFormat()
    parsed = fmt.parse(
        '<call>search("cats", 2)</call><call>calculate("12*34")</call><|end|>', TOOLS
    )
    assert parsed.errors == []
    assert parsed.tool_calls == [
        ToolCall("search", {"query": "cats", "k": 2}, "call_0"),
        ToolCall("calculate", {"expression": "12*34"}, "call_1"),
    ]
    # Keyword arguments need no schema; literals become JSON values (a tuple becomes a list).
    parsed = fmt.parse("<call>lookup(ids=(1, 2), opts={'a': None, 'b': True})</call>")
    assert parsed.tool_calls == [
        ToolCall("lookup", {"ids": [1, 2], "opts": {"a": None, "b": True}}, "call_0")
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('calculate(os.system("x"))', "is not a literal"),
        ("a.b()", "call a tool by its bare name"),
        ('calculate("1" ', "is not a Python call"),
        ("calculate", "is not a call"),
        ('search("a", 1, 2)', "3 positional arguments, but search takes 2"),
        ('lookup("x")', "need the schema of tool 'lookup'"),
        ('search(query="a", query="b")', ""),  # a syntax error in Python itself
        ('search("a", query="b")', "'query' is given twice"),
        ("search(**opts)", "**arguments are not supported"),
        ("search(query=b'x')", "not a JSON value"),
        ("search(query=(lambda: 1)())", "is not a literal"),
    ],
)
def test_builtin_malformed_calls_are_errors_and_the_others_still_parse(
    body: str, message: str
) -> None:
    text = f'Hmm.<call>{body}</call> then <call>calculate("2+2")</call><|end|>'
    parsed = StreamrlFormat().parse(text, TOOLS)
    assert len(parsed.errors) == 1
    assert message in parsed.errors[0]
    assert parsed.tool_calls == [ToolCall("calculate", {"expression": "2+2"}, "call_0")]
    assert parsed.content == "Hmm. then"


def test_builtin_unclosed_and_stray_tags_are_errors() -> None:
    text = '<call>calculate("1")</call>x</call><call>calculate("2"'
    parsed = StreamrlFormat().parse(text, TOOLS)
    assert parsed.tool_calls == [ToolCall("calculate", {"expression": "1"}, "call_0")]
    assert len(parsed.errors) == 2
    assert "</call> without an opening <call>" in parsed.errors[0]
    assert 'calculate("2" is never closed by </call>' in parsed.errors[1]


# --- Hermes and Qwen3 -----------------------------------------------------------------------


def test_hermes_render_with_tools_has_the_documented_layout() -> None:
    messages = [
        user("Weather in Paris?"),
        assistant("", ("search", {"query": "paris weather"})),
        tool("sunny"),
        assistant("It is sunny."),
    ]
    text = HermesFormat().render(messages, [SEARCH], add_generation_prompt=False)
    schema = json.dumps(SEARCH)
    expected = (
        "<|im_start|>system\n"
        "You are a helpful assistant.\n\n"  # Qwen2.5's default system message
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schema}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"  # no content: the first call has no leading newline
        '<tool_call>\n{"name": "search", "arguments": {"query": "paris weather"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
    )
    assert text == expected
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n"
        + tool_schema_text([SEARCH])
        + expected[expected.index("<|im_end|>") :]
    )


def test_hermes_groups_tool_results_and_renders_calls_after_content() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        user("q"),
        assistant("Two searches.", ("search", {"query": "a"}), ("search", {"query": "b", "k": 1})),
        tool("ra", "c0"),
        tool("rb", "c1"),
    ]
    text = HermesFormat().render(messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\nTwo searches.\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "b", "k": 1}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nra\n</tool_response>\n"
        "<tool_response>\nrb\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_has_no_default_system_and_an_empty_think_block_when_thinking_is_off() -> None:
    history = [user("hi"), assistant("<think>\nhello?\n</think>\n\nHello!"), user("bye")]
    text = Qwen3Format().render(history, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nhello?\n</think>\n\nHello!<|im_end|>\n"  # kept verbatim
        "<|im_start|>user\nbye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = Qwen3Format(enable_thinking=True).render(history, add_generation_prompt=True)
    assert thinking.endswith("bye<|im_end|>\n<|im_start|>assistant\n")
    with_tools = Qwen3Format().render([user("x")], TOOLS, add_generation_prompt=False)
    assert with_tools.startswith(f"<|im_start|>system\n{tool_schema_text(TOOLS)}<|im_end|>\n")


def test_qwen3_parse_splits_off_the_reasoning() -> None:
    text = (
        "<think>\nI should search.\n</think>\n\nSearching.\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call><|im_end|>'
    )
    parsed = Qwen3Format(enable_thinking=True).parse(text)
    assert parsed.reasoning == "I should search."
    assert parsed.content == "Searching."
    assert parsed.tool_calls == [ToolCall("search", {"query": "x"}, "call_0")]
    truncated = Qwen3Format().parse("<think>\nstill thinking <tool_call>")
    assert (truncated.reasoning, truncated.content, truncated.errors) == (
        "still thinking <tool_call>",
        "",
        [],
    )
    message = Qwen3Format().assistant_message(text)
    assert message["reasoning_content"] == "I should search."


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "search", "arguments": {"query": "x"', "is not valid JSON"),
        ('{"arguments": {"query": "x"}}', 'has no "name"'),
        ('{"name": "search", "arguments": ["x"]}', '"arguments" must be a JSON object, got list'),
        ('{"name": "search"}', 'has no "arguments"'),
        ('["search", {}]', "is not a JSON object"),
        ('{"name": 3, "arguments": {}}', 'has no "name"'),
    ],
)
def test_hermes_malformed_calls_are_errors_and_the_others_still_parse(
    body: str, message: str
) -> None:
    text = (
        f"Let me check.\n<tool_call>\n{body}\n</tool_call>\n"
        '<tool_call>\n{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n'
        "</tool_call><|im_end|>"
    )
    parsed = HermesFormat().parse(text, TOOLS)
    assert len(parsed.errors) == 1
    assert message in parsed.errors[0]
    # The second call's arguments are a JSON string holding an object, which is accepted.
    assert parsed.tool_calls == [ToolCall("calculate", {"expression": "1+1"}, "call_0")]
    assert parsed.content == "Let me check."


def test_hermes_unclosed_block_is_an_error() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'
    parsed = HermesFormat().parse(text)
    assert parsed.tool_calls == [ToolCall("search", {}, "call_0")]
    assert len(parsed.errors) == 1 and "never closed by </tool_call>" in parsed.errors[0]


@pytest.mark.parametrize(
    ("template", "fmt"), [(HERMES_TEMPLATE, HermesFormat()), (QWEN3_TEMPLATE, Qwen3Format())]
)
def test_the_templates_render_the_same_through_transformers(template: str, fmt) -> None:
    tokenizer = qwen_like_tokenizer()
    messages = [
        {"role": "system", "content": "Use tools."},
        user("q"),
        # Arguments as an object: the template writes a JSON string as given, while `render`
        # re-serialises it (here "é" would be written "\u00e9").
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"q": "é"}}}
            ],
        },
        tool("r"),
    ]
    for tools in (TOOLS, None):
        expected = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        assert fmt.render(messages, tools, add_generation_prompt=True) == expected


def test_qwen_continuation_opens_with_one_im_start_token() -> None:
    tokenizer = qwen_like_tokenizer()
    cont = HermesFormat().continuation([tool("42"), user("and now?")])
    assert cont.startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>")
    ids = tokenizer(cont, add_special_tokens=False)["input_ids"]
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(start) == 3  # the tool results' user turn, the user turn, the assistant turn
    assert tokenizer.convert_ids_to_tokens(ids[1]) == "<|im_start|>"
    assert tokenizer.decode(ids, skip_special_tokens=False) == cont


# --- every format ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize(
    "new",
    [
        [tool("42")],
        [tool("ra", "c0"), tool("rb", "c1")],
        [tool("ra", "c0"), tool("rb", "c1"), user("Now answer.")],
        [user("Go on.")],
        [{"role": "system", "content": "Observation: door opens."}],
    ],
    ids=["tool", "tools", "tools-user", "user", "environment"],
)
def test_continuation_extends_the_rendered_history(fmt, new: list[dict]) -> None:
    histories = [
        [user("12*34=")],
        [{"role": "system", "content": "Be exact."}, user("a"), assistant("b"), user("c")],
        [user("q"), assistant("", ("search", {"query": "x"})), tool("r"), user("more")],
    ]
    for history in histories:
        turn = assistant("Checking.", ("calculate", {"expression": "12*34"}))
        head = fmt.render([*history, turn], TOOLS, add_generation_prompt=False)
        head = head[: head.rindex(fmt.end_of_turn) + len(fmt.end_of_turn)]
        full = fmt.render([*history, turn, *new], TOOLS, add_generation_prompt=True)
        assert full == head + fmt.continuation(new, TOOLS)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_rendered_tool_calls_parse_back(fmt) -> None:
    history = [user("Find cats and compute.")]
    message = assistant(
        "On it.", ("search", {"query": 'cats "x"', "k": 2}), ("calculate", {"expression": "1/3"})
    )
    text = sampled_turn(fmt, history, message)
    assert text.endswith(fmt.end_of_turn)
    parsed = fmt.parse(text, TOOLS)
    assert parsed.errors == []
    assert parsed.content == "On it."
    assert parsed.tool_calls == [
        ToolCall("search", {"query": 'cats "x"', "k": 2}, "call_0"),
        ToolCall("calculate", {"expression": "1/3"}, "call_1"),
    ]
    # The OpenAI message of the sampled turn renders back to the same turn.
    back = fmt.assistant_message(text, TOOLS)
    assert back["tool_calls"][1]["function"] == {
        "name": "calculate",
        "arguments": '{"expression": "1/3"}',
    }
    assert sampled_turn(fmt, history, back) == text


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_assistant_and_tool_messages(fmt) -> None:
    only_call = sampled_turn(fmt, [user("x")], assistant("", ("calculate", {"expression": "2"})))
    message = fmt.assistant_message(only_call, TOOLS)
    assert message["content"] is None and len(message["tool_calls"]) == 1
    plain = fmt.assistant_message("42" + fmt.end_of_turn, TOOLS)
    assert plain == {"role": "assistant", "content": "42"}
    call = ToolCall("calculate", {"expression": "2"}, "call_0")
    assert fmt.tool_message(call, "2") == {
        "role": "tool",
        "tool_call_id": "call_0",
        "name": "calculate",
        "content": "2",
    }
    assert fmt.stop_strings() == ()


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_parse_never_raises_on_random_text(fmt) -> None:
    rng = random.Random(0)
    pieces = ["<call>", "</call>", "<tool_call>", "</tool_call>", "<think>", "</think>", "(", ")"]
    pieces += ['"', "{", "}", "[", "]", ":", ",", "=", "name", "arguments", "x", "1", " ", "\n"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        parsed = fmt.parse(text, TOOLS)
        assert all(isinstance(error, str) and error for error in parsed.errors)
        assert all(isinstance(call.arguments, dict) for call in parsed.tool_calls)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_bad_messages_are_clear_errors(fmt) -> None:
    with pytest.raises(ValueError, match="renders the messages between sampled assistant turns"):
        fmt.continuation([assistant("x")])
    with pytest.raises(ValueError, match="has role 'robot'; expected one of system, user"):
        fmt.render([{"role": "robot", "content": "x"}], add_generation_prompt=True)
    with pytest.raises(TypeError, match="text only"):
        fmt.render([{"role": "user", "content": [{"type": "text"}]}], add_generation_prompt=True)
    bad_call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}
    bad_call["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ValueError, match="arguments are not valid JSON"):
        fmt.render([bad_call], add_generation_prompt=False)


def test_format_lookup() -> None:
    assert isinstance(chat_format("streamrl"), StreamrlFormat)
    assert type(chat_format("hermes")) is HermesFormat
    assert chat_format("qwen3") == Qwen3Format(enable_thinking=False)
    with pytest.raises(ValueError, match="expected one of streamrl, hermes, qwen3"):
        chat_format("chatml")
    assert format_for_tokenizer(build_tokenizer()).name == "streamrl"
    assert format_for_tokenizer(qwen_like_tokenizer()).name == "qwen3"
    assert format_for_tokenizer(qwen_like_tokenizer(think=False)).name == "hermes"
