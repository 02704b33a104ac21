"""Chat formats for agent episodes: conversations rendered as model text, and tool calls parsed
out of sampled assistant turns.

An episode's tokens are written once and never re-rendered (`ledger`): the first prompt is
`render(messages, add_generation_prompt=True)`, the model samples an assistant turn and closes it
with the format's end-of-turn token, and the tool results or the next user turn are appended as
`continuation(new_messages)`, which ends by opening the next assistant turn. A format must make
the two ways of writing a conversation agree:

    render(h + [assistant] + new, add_generation_prompt=True)
        == render(h + [assistant])[: through the assistant's end-of-turn token]
           + continuation(new)

`continuation` holds by construction: it renders a fixed conversation that ends in an assistant
turn, with and without the new messages, and keeps what follows that turn's end token (Qwen's
"\\n" after `<|im_end|>` included).

The formats (`chat_format(name)`):

- `streamrl`, for the project's character-level model, where every character is a token:
  `<|user|>12*34=<|end|><|assistant|><call>calculate("12*34")</call><|end|><|tool|>408<|end|>`.
  Tools are not described in the prompt (the model learns them); a call is Python call syntax
  with literal arguments, read with `ast` and never evaluated.
- `hermes`, the Qwen2.5 layout: `<|im_start|>role\\n...<|im_end|>\\n`, tool signatures in the
  system message, calls as JSON objects in `<tool_call>` blocks, consecutive tool results grouped
  into one user turn of `<tool_response>` blocks. Rendered by the project's Jinja template
  `HERMES_TEMPLATE`, which also works with `tokenizer.apply_chat_template(chat_template=...)`.
- `qwen3`, Hermes without a default system message; with thinking disabled the generation prompt
  carries an empty `<think>` block, and a sampled turn's `<think>` reasoning is split off when
  parsing (kept verbatim when rendering earlier turns).

Parsing never raises on model output: each malformed call is one message in `ParsedTurn.errors`
(a workflow can feed it back as a tool error) and the turn's other calls still parse.
"""

from __future__ import annotations

import abc
import ast
import json
import keyword
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from streamrl.models.tokenizer import ASSISTANT, END

Message = Mapping[str, Any]
Tools = Sequence[Mapping[str, Any]] | None

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call of an assistant turn."""

    name: str
    arguments: dict[str, Any]
    id: str  # "call_<n>": the n-th well-formed call of its turn, from 0


@dataclass(frozen=True)
class ParsedTurn:
    """A sampled assistant turn, split into its text and its tool calls."""

    content: str  # the text outside the tool-call blocks (and reasoning), stripped
    tool_calls: list[ToolCall]  # the well-formed calls, in order
    errors: list[str]  # one message per malformed call, in order
    reasoning: str = ""  # qwen3: the turn's <think> text; empty for the other formats


class ChatFormat(Protocol):
    """How conversations become model text and sampled text becomes tool calls."""

    name: str
    end_of_turn: str  # the token text that closes every turn, sampled ones included

    def render(
        self, messages: Sequence[Message], tools: Tools = None, *, add_generation_prompt: bool
    ) -> str:
        """The whole conversation as text; called once per episode for its first prompt."""
        ...

    def continuation(self, new_messages: Sequence[Message], tools: Tools = None) -> str:
        """The text after a sampled assistant turn (which ended with `end_of_turn`) for the
        non-assistant `new_messages`, ending with the next assistant turn's generation prompt.
        The caller tokenizes it and appends it to the episode as context."""
        ...

    def parse(self, text: str, tools: Tools = None) -> ParsedTurn:
        """Split a decoded assistant turn (special tokens kept, the end token possibly last)
        into content and tool calls; `tools` gives parameter order where the syntax needs it."""
        ...

    def assistant_message(self, text: str, tools: Tools = None) -> dict[str, Any]:
        """A sampled turn as an OpenAI assistant message, for clients that keep the history."""
        ...

    def tool_message(self, call: ToolCall, result: str) -> dict[str, Any]:
        """The OpenAI tool message that answers `call`."""
        ...

    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end an assistant turn before its end token (none in these formats)."""
        ...


class _Malformed(Exception):
    """A tool-call block that does not parse; its message goes to `ParsedTurn.errors`."""


# The conversation `continuation` renders ahead of the new messages: any one that ends in an
# assistant turn gives the same suffix, because a turn's text depends on its neighbours' roles only.
_PREFIX: tuple[Message, ...] = (
    {"role": "user", "content": "?"},
    {"role": "assistant", "content": "!"},
)


class _Format(abc.ABC):
    """What the formats share: continuation, parsing, OpenAI messages. Subclasses render and
    read one call body."""

    name: str
    end_of_turn: str
    call_open: str  # the tags around one tool call in an assistant turn
    call_close: str

    @abc.abstractmethod
    def render(
        self, messages: Sequence[Message], tools: Tools = None, *, add_generation_prompt: bool
    ) -> str:
        """The whole conversation as text (`ChatFormat.render`)."""

    def continuation(self, new_messages: Sequence[Message], tools: Tools = None) -> str:
        new = _check_messages(new_messages)
        for message in new:
            if message["role"] == "assistant":
                raise ValueError(
                    "continuation() renders the messages between sampled assistant turns; got "
                    "an assistant message. Sample assistant turns with the model instead."
                )
        head = self.render(_PREFIX, tools, add_generation_prompt=False)
        cut = head.rindex(self.end_of_turn) + len(self.end_of_turn)
        full = self.render([*_PREFIX, *new], tools, add_generation_prompt=True)
        assert full[:cut] == head[:cut], f"{self.name}: earlier turns render differently"
        return full[cut:]

    def parse(self, text: str, tools: Tools = None) -> ParsedTurn:
        text = text.rstrip()
        if text.endswith(self.end_of_turn):
            text = text[: -len(self.end_of_turn)]
        reasoning, text = self._split_reasoning(text)
        prose: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        for kind, piece in _blocks(text, self.call_open, self.call_close):
            if kind == "text":
                prose.append(piece)
            elif kind == "error":
                errors.append(piece)
            else:
                try:
                    name, arguments = self._parse_call(piece, tools)
                except _Malformed as error:
                    errors.append(str(error))
                    continue
                calls.append(ToolCall(name, arguments, f"call_{len(calls)}"))
        return ParsedTurn("".join(prose).strip(), calls, errors, reasoning)

    def assistant_message(self, text: str, tools: Tools = None) -> dict[str, Any]:
        parsed = self.parse(text, tools)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content or (None if parsed.tool_calls else ""),
        }
        if parsed.tool_calls:
            message["tool_calls"] = [_openai_call(call) for call in parsed.tool_calls]
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        return message

    def tool_message(self, call: ToolCall, result: str) -> dict[str, Any]:
        if not isinstance(result, str):
            raise TypeError(f"a tool result must be a str, got {type(result).__name__}")
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result}

    def stop_strings(self) -> tuple[str, ...]:
        # The end of turn is a token the engine stops on; a stop string would be cut from the
        # output, and the ledger needs the end token to continue the conversation after it.
        return ()

    def _split_reasoning(self, text: str) -> tuple[str, str]:
        return "", text

    @abc.abstractmethod
    def _parse_call(self, body: str, tools: Tools) -> tuple[str, dict[str, Any]]:
        """(name, arguments) of one call's body; raises `_Malformed` saying what is wrong."""


# --- the built-in format --------------------------------------------------------------------


@dataclass(frozen=True)
class StreamrlFormat(_Format):
    """`<|role|>content<|end|>` per message, `<call>name(args)</call>` tool calls."""

    name = "streamrl"
    end_of_turn = END
    call_open = "<call>"
    call_close = "</call>"

    def render(
        self, messages: Sequence[Message], tools: Tools = None, *, add_generation_prompt: bool
    ) -> str:
        _check_tools(tools)  # accepted for parsing; the tiny model is not told its tools
        parts = []
        for message in _check_messages(messages):
            content = message["content"]
            for call in message.get("tool_calls", ()):
                content += f"{self.call_open}{_python_call(call)}{self.call_close}"
            parts.append(f"<|{message['role']}|>{content}{END}")
        if add_generation_prompt:
            parts.append(ASSISTANT)
        return "".join(parts)

    def _parse_call(self, body: str, tools: Tools) -> tuple[str, dict[str, Any]]:
        source = body.strip()
        shown = f"<call>{_clip(body)}</call>"
        try:
            node = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise _Malformed(
                f"{shown} is not a Python call; write <call>name(value, key=value)</call>"
            ) from None
        if not isinstance(node, ast.Call):
            raise _Malformed(f"{shown} is not a call; write <call>name(value, key=value)</call>")
        if not isinstance(node.func, ast.Name):
            called = _clip(ast.get_source_segment(source, node.func) or "")
            raise _Malformed(f"{shown} calls `{called}`; call a tool by its bare name")
        name = node.func.id
        positional = [_literal(arg, source, shown) for arg in node.args]
        arguments: dict[str, Any] = {}
        if positional:
            params = _parameter_names(tools, name)
            if params is None:
                raise _Malformed(
                    f"{shown}: positional arguments need the schema of tool {name!r}, which is "
                    "not given; pass them by keyword"
                )
            if len(positional) > len(params):
                raise _Malformed(
                    f"{shown}: {len(positional)} positional arguments, but {name} takes "
                    f"{len(params)} ({', '.join(params) or 'none'})"
                )
            arguments.update(zip(params, positional, strict=False))
        for kw in node.keywords:
            if kw.arg is None:
                raise _Malformed(f"{shown}: **arguments are not supported; name each argument")
            if kw.arg in arguments:
                raise _Malformed(f"{shown}: argument {kw.arg!r} is given twice")
            arguments[kw.arg] = _literal(kw.value, source, shown)
        return name, arguments


def _literal(node: ast.expr, source: str, shown: str) -> Any:
    """The JSON value of a literal argument node; never evaluates code."""
    text = _clip(ast.get_source_segment(source, node) or "")
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Malformed(
            f"{shown}: argument `{text}` is not a literal (a string, number, bool, None, "
            "or a list or dict of them)"
        ) from None
    try:
        return _json_value(value)
    except TypeError as error:
        raise _Malformed(f"{shown}: argument `{text}` {error}") from None


def _json_value(value: Any) -> Any:
    """`value` with tuples made lists; TypeError if it holds something JSON cannot."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(item) for key, item in value.items()}
    raise TypeError(f"holds a {type(value).__name__}, which is not a JSON value")


def _python_call(call: Mapping[str, Any]) -> str:
    """`name(key=value, ...)` for an OpenAI tool call, values as Python literals."""
    name, arguments = _call_parts(call)
    for word in (name, *arguments):
        if not word.isidentifier() or keyword.iskeyword(word):
            raise ValueError(
                f"tool call {name}: {word!r} is not a Python identifier, which the streamrl "
                "format needs for tool and argument names"
            )
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"


def _parameter_names(tools: Tools, name: str) -> list[str] | None:
    """The parameter names of tool `name` in schema order, or None without its schema."""
    for tool in _check_tools(tools) or ():
        spec = tool.get("function", tool)
        if spec.get("name") == name:
            return list(spec.get("parameters", {}).get("properties", {}))
    return None


# --- Hermes (Qwen2.5) and Qwen3 -------------------------------------------------------------

# Jinja with transformers' settings (trim_blocks, lstrip_blocks, a `tojson` without HTML escapes
# or sorted keys), so that `apply_chat_template(chat_template=...)` renders the same text.
# `default_system` and `qwen3` are set by the header that makes the two templates.
_HERMES_BODY = r"""
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content or '' %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = default_system %}
    {%- set rest = messages %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system %}
        {{- system + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif system %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in rest %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- if call.function is defined %}
                {%- set call = call.function %}
            {%- endif %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if qwen3 and enable_thinking is defined and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

HERMES_TEMPLATE = (
    "{%- set default_system = 'You are a helpful assistant.' %}{%- set qwen3 = false %}"
    + _HERMES_BODY.strip()
)
"""Qwen2.5: a default system message; tools in the system message; no thinking."""

QWEN3_TEMPLATE = "{%- set default_system = '' %}{%- set qwen3 = true %}" + _HERMES_BODY.strip()
"""Qwen3: no default system message; `enable_thinking=False` opens the reply with an empty
`<think>` block (undefined means thinking on, as in Qwen3's own template)."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


@cache
def _compiled(source: str) -> Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


@dataclass(frozen=True)
class HermesFormat(_Format):
    """Qwen2.5's chat layout with Hermes-style `<tool_call>` JSON calls."""

    name = "hermes"
    end_of_turn = "<|im_end|>"
    call_open = "<tool_call>"
    call_close = "</tool_call>"
    template = HERMES_TEMPLATE

    def render(
        self, messages: Sequence[Message], tools: Tools = None, *, add_generation_prompt: bool
    ) -> str:
        return _compiled(self.template).render(
            messages=_check_messages(messages),
            tools=_check_tools(tools),
            add_generation_prompt=add_generation_prompt,
            **self._template_options(),
        )

    def _template_options(self) -> dict[str, Any]:
        return {}

    def _parse_call(self, body: str, tools: Tools) -> tuple[str, dict[str, Any]]:
        shown = f"<tool_call>{_clip(body)}</tool_call>"
        try:
            call = json.loads(body)
        except (ValueError, RecursionError) as error:
            raise _Malformed(f"{shown} is not valid JSON ({error})") from None
        if not isinstance(call, dict):
            raise _Malformed(f'{shown} is not a JSON object {{"name": ..., "arguments": {{...}}}}')
        name = call.get("name")
        if not isinstance(name, str) or not name:
            raise _Malformed(f'{shown} has no "name" string')
        if "arguments" not in call:
            raise _Malformed(f'{shown} has no "arguments" object')
        arguments = call["arguments"]
        if isinstance(arguments, str):  # the arguments as a JSON string, as in the OpenAI API
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                pass  # reported as not an object just below
        if not isinstance(arguments, dict):
            raise _Malformed(
                f'{shown}: "arguments" must be a JSON object, got {type(arguments).__name__}'
            )
        return name, arguments


@dataclass(frozen=True)
class Qwen3Format(HermesFormat):
    """Hermes for Qwen3: no default system message, `<think>` reasoning."""

    name = "qwen3"
    template = QWEN3_TEMPLATE
    enable_thinking: bool = False  # False: the generation prompt closes an empty <think> block

    def _template_options(self) -> dict[str, Any]:
        return {"enable_thinking": self.enable_thinking}

    def _split_reasoning(self, text: str) -> tuple[str, str]:
        if "</think>" in text:
            head, _, tail = text.partition("</think>")
            return head.strip().removeprefix("<think>").strip(), tail
        if text.lstrip().startswith("<think>"):  # the turn ended inside its reasoning
            return text.lstrip().removeprefix("<think>").strip(), ""
        return "", text


# --- choosing a format ----------------------------------------------------------------------

_FORMATS: dict[str, type[_Format]] = {
    "streamrl": StreamrlFormat,
    "hermes": HermesFormat,
    "qwen3": Qwen3Format,
}


def chat_format(name: str) -> ChatFormat:
    """The format called `name`: "streamrl", "hermes" (Qwen2.5) or "qwen3"."""
    if name not in _FORMATS:
        raise ValueError(f"unknown chat format {name!r}; expected one of {', '.join(_FORMATS)}")
    return _FORMATS[name]()


def format_for_tokenizer(tokenizer: Any) -> ChatFormat:
    """The format a tokenizer's vocabulary implies: Qwen's (`<|im_start|>`; qwen3 if it also has
    `<think>`), else the built-in one."""
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" in vocab:
        return chat_format("qwen3" if "<think>" in vocab else "hermes")
    return chat_format("streamrl")


def tool_schema_text(tools: Tools) -> str:
    """The tools section Hermes appends to the system message (empty without tools)."""
    tools = _check_tools(tools)
    if not tools:
        return ""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


# --- shared helpers -------------------------------------------------------------------------


def _blocks(text: str, open_tag: str, close_tag: str) -> Iterator[tuple[str, str]]:
    """`text` in order as ("text", prose), ("call", body) and ("error", message) pieces."""
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        prose = text[pos:] if start < 0 else text[pos:start]
        if close_tag in prose:
            yield "error", f"{close_tag} without an opening {open_tag}"
        yield "text", prose
        if start < 0:
            return
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        if end < 0:
            yield "error", f"{open_tag}{_clip(text[body_start:])} is never closed by {close_tag}"
            return
        yield "call", text[body_start:end]
        pos = end + len(close_tag)


def _check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Copies of `messages` with str content and tool-call arguments as dicts; ValueError or
    TypeError naming the first message that is not an OpenAI chat message."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise TypeError(
                f"message {i} ({role}) has {type(content).__name__} content; these chat formats "
                "take text only, as a str"
            )
        copy = {**message, "content": content or ""}
        if message.get("tool_calls"):
            if role != "assistant":
                raise ValueError(f"message {i} ({role}) has tool_calls; only assistants call")
            copy["tool_calls"] = [_normal_call(call, i) for call in message["tool_calls"]]
        out.append(copy)
    return out


def _normal_call(call: Mapping[str, Any], index: int) -> dict[str, Any]:
    try:
        name, arguments = _call_parts(call)
    except (ValueError, TypeError) as error:
        raise ValueError(f"message {index}: {error}") from None
    function = {"name": name, "arguments": arguments}
    return {"id": call.get("id", ""), "type": "function", "function": function}


def _call_parts(call: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, arguments dict) of an OpenAI tool call, whose arguments may be a JSON string."""
    function = call.get("function", call)
    name, arguments = function.get("name"), function.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call {dict(call)!r} has no function name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise ValueError(f"tool call {name}: arguments are not valid JSON ({error})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {name}: arguments must be a JSON object")
    return name, arguments


def _check_tools(tools: Tools) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of tool schemas, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tool {i} must be a schema dict, got {type(tool).__name__}")
    return [dict(tool) for tool in tools]


def _openai_call(call: ToolCall) -> dict[str, Any]:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
