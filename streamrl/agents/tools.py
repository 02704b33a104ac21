"""Tools an agent episode may call: plain Python functions with a JSON schema, run under a
deadline and the episode's limits.

    tool(fn) ──► Tool(name, description, parameters, fn, timeout_s)
    ToolBox(tools, ToolLimits) ──.schemas──► the chat template (the tools offered the model)
                               ──.episode()──► ToolSession: await call(name, args) ──► ToolResult

`tool(fn)` reads the schema off the function: its typed arguments (str, int, float, bool,
list[X], dict, Literal[...], Optional), its docstring's first paragraph and Google-style
`Args:` section. `load_tools` imports the `package.module:function` paths of `agent.tools`
(functions, `Tool` objects, or factories of a Tool such as `code_tool:python_tool`).

A call never raises for what the model did or what the tool's code did: an unknown tool, bad
arguments, the episode's call limit, the deadline, a `ToolError` or any other exception from the
tool all come back as a `ToolResult` with status "error" and the reason, and the model reads
"error: <message>". Only `ToolInfraError` (a tool server down) escapes: it is retried with
exponential backoff, and past the retries raised to the workflow, which drops the episode as
infra_error instead of training on an outage.

A sync function runs in a worker thread (`asyncio.to_thread`), an async one on the event loop.
Python cannot stop a thread: a sync function past its deadline keeps running in its thread, its
result is thrown away, and `asyncio.run` waits for it before it returns. A tool that must really
stop (model-written code) runs in a process it kills itself (`streamrl.agents.code_tool`).

`calculate`, the built-in tool of the CPU agent demo, evaluates arithmetic through `ast`.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import math
import operator
import re
import time
import types
import typing
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_BACKOFF_S = 8.0
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style tool names allow
_SIMPLE_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}


class ToolError(Exception):
    """The tool's own error (bad arguments, a failed computation): its message goes back to the
    model as the tool result."""


class ToolTimeout(ToolError):
    """The tool ran out of its own time and stopped its work (killed its process): reported like
    the session's deadline, with reason "timeout"."""


class ToolInfraError(Exception):
    """Infrastructure failed (a tool server down, a connection refused): retried with
    exponential backoff; after the retries the episode fails with status infra_error."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call, and how it is described to the model."""

    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments: an object with `properties` and `required`."""
    fn: Callable
    """Called with the arguments as keywords; sync (run in a thread) or async."""
    timeout_s: float = 10.0
    """Deadline of one call, unless `ToolLimits.timeout_s` overrides it."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-' "
                "(what chat templates and OpenAI-style APIs accept)"
            )
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema object")
        if not self.timeout_s > 0:
            raise ValueError(
                f"tool {self.name!r}: timeout_s must be positive, got {self.timeout_s}"
            )

    @property
    def schema(self) -> dict:
        """The OpenAI function schema, as chat templates take it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


# -- a Tool from a typed function -------------------------------------------------------------


def tool(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 10.0,
) -> Any:
    """A `Tool` from a plain or async function; with no `fn`, a decorator that makes one.

    Each argument's annotation becomes its JSON schema type; an argument with a default or
    annotated `X | None` is optional. The description is the docstring's first paragraph (or
    `description`), an argument's description its line in the docstring's `Args:` section.
    Raises TypeError for an argument without a type, or with a type JSON cannot carry."""
    if fn is None:
        return lambda f: tool(f, name=name, description=description, timeout_s=timeout_s)
    summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    return Tool(
        name=name or fn.__name__,
        description=summary if description is None else description,
        parameters=parameters_schema(fn, arg_docs),
        fn=fn,
        timeout_s=timeout_s,
    )


def parameters_schema(fn: Callable, arg_docs: Mapping[str, str] | None = None) -> dict:
    """The JSON schema object of `fn`'s arguments (see `tool`)."""
    label = getattr(fn, "__qualname__", repr(fn))
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation naming something that does not exist
        raise TypeError(f"tool function {label}: cannot resolve its annotations: {e}") from e
    properties: dict[str, dict] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(
                f"tool function {label}: *{param.name} cannot be described to the model; "
                "list each argument by name"
            )
        if param.name not in hints:
            raise TypeError(
                f"tool function {label}: argument {param.name!r} has no type annotation; "
                "annotate it (str, int, float, bool, list[...], dict, Literal[...])"
            )
        annotation, optional = _strip_none(hints[param.name])
        where = f"tool function {label}, argument {param.name!r}"
        prop = json_schema_of(annotation, where)
        if arg_docs and param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty and not optional:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


def json_schema_of(annotation: Any, where: str) -> dict:
    """The JSON schema of one Python type; TypeError (naming `where`) for one it cannot carry."""
    if annotation in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is list or origin is list:
        return {"type": "array"} | ({"items": json_schema_of(args[0], where)} if args else {})
    if origin is dict:
        return {"type": "object"}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) == 1 and next(iter(kinds)) in _SIMPLE_TYPES:
            return {"type": _SIMPLE_TYPES[next(iter(kinds))], "enum": list(args)}
        raise TypeError(f"{where}: Literal values must all be str, all int or all bool")
    raise TypeError(
        f"{where}: type {annotation!r} is not supported; use str, int, float, bool, list[...], "
        "dict, Literal[...] or X | None"
    )


def _strip_none(annotation: Any) -> tuple[Any, bool]:
    """(X, True) for `X | None` / `Optional[X]`, else (annotation, False)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph as one line, {argument: description} from a Google-style `Args:`
    section). `doc` is a cleaned docstring (`inspect.getdoc`)."""
    lines = doc.splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or line.strip() in ("Args:", "Arguments:"):
            break
        summary.append(line.strip())
    args: dict[str, str] = {}
    start = next((i for i, s in enumerate(lines) if s.strip() in ("Args:", "Arguments:")), None)
    if start is not None:
        header_indent = _indent(lines[start])
        item_indent, current = None, None
        for line in lines[start + 1 :]:
            if not line.strip():
                continue
            if _indent(line) <= header_indent:
                break  # the next section (Returns:, Raises:, ...)
            item_indent = item_indent or _indent(line)
            item = re.match(r"\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line.strip())
            if _indent(line) == item_indent and item:
                current = item.group(1)
                args[current] = item.group(2)
            elif current is not None:
                args[current] = f"{args[current]} {line.strip()}".strip()
    return " ".join(summary), args


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# -- loading the tools a config names ----------------------------------------------------------


def load_tools(paths: Sequence[str]) -> list[Tool]:
    """The tools at `package.module:attribute` paths: a `Tool` is taken as it is, a function
    returning a Tool that needs no arguments (`streamrl.agents.code_tool:python_tool`) is called,
    any other function is made a tool with `tool`. Raises ValueError for a malformed path, a
    missing module or attribute, or two tools of one name."""
    tools: list[Tool] = []
    for path in paths:
        module_name, _, attribute = path.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"tool path {path!r}: expected 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not (module_name + ".").startswith(e.name + "."):
                raise  # the module exists, but something it imports does not
            raise ValueError(f"tool path {path!r}: no module named {module_name!r}") from None
        found: Any = module
        for part in attribute.split("."):
            if not hasattr(found, part):
                raise ValueError(f"tool path {path!r}: {module_name!r} has no {attribute!r}")
            found = getattr(found, part)
        if isinstance(found, Tool):
            tools.append(found)
        elif _is_tool_factory(found):
            tools.append(found())
        elif callable(found):
            tools.append(tool(found))
        else:
            raise ValueError(
                f"tool path {path!r} names a {type(found).__name__}, not a function or a Tool"
            )
    _check_unique(tools)
    return tools


def _is_tool_factory(fn: Any) -> bool:
    """A function annotated to return a Tool and callable without arguments (`python_tool`)."""
    if not inspect.isfunction(fn):
        return False
    try:
        returns = typing.get_type_hints(fn).get("return")
    except Exception:  # unresolvable annotations: not a factory; `tool` says what is wrong
        return False
    params = inspect.signature(fn).parameters.values()
    return returns is Tool and all(p.default is not p.empty for p in params)


def _check_unique(tools: Sequence[Tool]) -> None:
    counts = Counter(t.name for t in tools)
    twice = sorted(name for name, n in counts.items() if n > 1)
    if twice:
        raise ValueError(
            f"more than one tool named {', '.join(map(repr, twice))}; give one of them another "
            "name (tool(fn, name=...))"
        )


# -- calling tools within an episode's limits --------------------------------------------------


@dataclass(frozen=True)
class ToolLimits:
    """What one episode's tool calls may use."""

    timeout_s: float | None = None
    """Deadline of each call; None: each tool's own `timeout_s`."""
    max_output_chars: int = 2000
    """A result longer than this is cut, ending with a marker saying how much was cut."""
    max_calls: int = 8
    """Calls an episode may make; each call past it gets an error result."""
    retries: int = 3
    """Retries of a call that raised `ToolInfraError`, before the error is raised."""
    backoff_s: float = 0.5
    """Wait before the first retry, doubled before each next one (at most `MAX_BACKOFF_S`)."""

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"ToolLimits.timeout_s must be positive or None, got {self.timeout_s}")
        if self.max_output_chars < 1 or self.max_calls < 0 or self.retries < 0:
            raise ValueError(f"ToolLimits: counts must be non-negative (got {self})")
        if self.backoff_s < 0:
            raise ValueError(f"ToolLimits.backoff_s must be non-negative, got {self.backoff_s}")

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first)."""
        return min(self.backoff_s * 2**retry, MAX_BACKOFF_S)


@dataclass
class ToolResult:
    """One call's outcome, as the workflow passes it on to the model and the metrics."""

    text: str
    """What the model sees: the tool's output, or "error: <message>"."""
    status: Literal["ok", "error"]
    reason: str = ""
    """Why a call failed: unknown_tool, bad_arguments, call_limit, timeout or tool_error."""
    truncated: bool = False
    """The text was cut to `ToolLimits.max_output_chars` (the status stays as it was)."""
    seconds: float = 0.0


class ToolBox:
    """The tools of a run and their limits; `episode()` opens the per-episode session."""

    def __init__(self, tools: Sequence[Tool], limits: ToolLimits | None = None):
        _check_unique(tools)
        self.tools = {t.name: t for t in tools}
        self.limits = limits if limits is not None else ToolLimits()

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def episode(self) -> ToolSession:
        return ToolSession(self)


@dataclass
class ToolSession:
    """One episode's tool calls: counted against `max_calls`, errors counted by reason."""

    box: ToolBox
    calls: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def schemas(self) -> list[dict]:
        return self.box.schemas

    async def call(self, name: str, arguments: Any) -> ToolResult:
        """Run tool `name` with `arguments` (the model's JSON object). Never raises for the
        model's or the tool's mistakes (see the module docstring); raises `ToolInfraError` once
        a tool's infrastructure failed `retries + 1` times in a row."""
        started = time.perf_counter()
        limits = self.box.limits
        self.calls += 1
        found = self.box.tools.get(name)
        if self.calls > limits.max_calls:
            reason, message = "call_limit", f"the limit of {limits.max_calls} tool calls is used up"
        elif found is None:
            known = ", ".join(self.box.tools) or "none"
            reason, message = "unknown_tool", f"no tool named {name!r} (tools: {known})"
        elif (problem := check_arguments(found.parameters, arguments)) is not None:
            reason, message = "bad_arguments", f"bad arguments for {name!r}: {problem}"
        else:
            reason, message = await self._run(found, arguments)
        text = message if reason == "" else f"error: {message}"
        text, truncated = truncate(text, limits.max_output_chars)
        if reason:
            self.errors[reason] += 1
        return ToolResult(
            text,
            "error" if reason else "ok",
            reason,
            truncated,
            time.perf_counter() - started,
        )

    async def _run(self, found: Tool, arguments: dict) -> tuple[str, str]:
        """(reason, output or error message) of one call, with retries of infrastructure
        errors."""
        limits = self.box.limits
        timeout_s = limits.timeout_s or found.timeout_s
        for retry in range(limits.retries + 1):
            try:
                async with asyncio.timeout(timeout_s) as deadline:
                    return "", as_text(await invoke(found.fn, arguments))
            except ToolInfraError as error:
                if retry == limits.retries:
                    self.errors["infra_error"] += 1
                    raise ToolInfraError(
                        f"tool {found.name!r} failed {retry + 1} time(s) on infrastructure: {error}"
                    ) from error
                await asyncio.sleep(limits.backoff(retry))
            except TimeoutError as error:
                if not deadline.expired():  # the tool's own TimeoutError (a socket's, say)
                    return "tool_error", f"TimeoutError: {error}"
                return "timeout", f"tool {found.name!r} took longer than {timeout_s:g} s"
            except ToolTimeout as error:
                return "timeout", str(error)
            except ToolError as error:
                return "tool_error", str(error)
            except Exception as error:  # the tool's bug, reported to the model, not raised
                return "tool_error", f"{type(error).__name__}: {error}"
        raise AssertionError("the retry loop returns or raises")


async def invoke(fn: Callable, arguments: Mapping[str, Any]) -> Any:
    """Call `fn(**arguments)`: awaited when async, in a worker thread when sync."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(**arguments)  # an async function, or an object with an async __call__
    result = await asyncio.to_thread(fn, **arguments)
    return await result if inspect.isawaitable(result) else result


def as_text(value: Any) -> str:
    """A tool's return value as the model reads it: a str as it is, else JSON, else str()."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """(`text` cut to at most `max_chars` characters, whether it was cut); a cut text ends with
    a marker saying how many characters were cut."""
    if len(text) <= max_chars:
        return text, False
    room = max_chars - len(f"\n[... {len(text)} more characters cut]")
    if room <= 0:
        return text[:max_chars], True
    return f"{text[:room]}\n[... {len(text) - room} more characters cut]", True


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """What is wrong with `arguments` for a JSON schema object (required keys present, no
    unknown keys, each value of its type); None when nothing is."""
    if not isinstance(arguments, dict):
        return f"expected a JSON object of arguments, got {_json_kind(arguments)}"
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", ()) if k not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    unknown = [k for k in arguments if k not in properties]
    if unknown and schema.get("additionalProperties") is not True:
        expected = ", ".join(properties) or "none"
        return f"unknown argument(s) {', '.join(unknown)} (expected: {expected})"
    for key, value in arguments.items():
        if key in properties and (problem := _check_value(properties[key], value)) is not None:
            return f"{key}: {problem}"
    return None


_JSON_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _check_value(schema: Mapping[str, Any], value: Any) -> str | None:
    kind = schema.get("type")
    if kind in _JSON_CHECKS and not _JSON_CHECKS[kind](value):
        return f"expected {kind}, got {_json_kind(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"expected one of {schema['enum']}, got {value!r}"
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            if (problem := _check_value(schema["items"], item)) is not None:
                return f"item {i}: {problem}"
    return None


def _json_kind(value: Any) -> str:
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _JSON_CHECKS[kind](value):
            return kind
    return type(value).__name__


# -- the built-in calculator -------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1024
MAX_DEPTH = 100
MAX_INT_BITS = 10_000  # about 3,000 digits: printable (Python prints at most 4,300 by default)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "123*45" or "(2+3)**2".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, deep nesting
        raise ToolError(f"not an arithmetic expression: {e}") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("the result is too large") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
    return str(value)


def _evaluate(node: ast.AST, depth: int = 0) -> int | float:
    if depth > MAX_DEPTH:
        raise ToolError(f"the expression is nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        raise ToolError(f"only numbers are allowed, not {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):  # a negative number to a fractional power
            raise ToolError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise ToolError(f"the result has more than {MAX_INT_BITS} bits")
        return value
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    else:
        names = {ast.Call: "function calls", ast.Attribute: "attribute access", ast.Name: "names"}
        what = names.get(type(node), type(node).__name__)
    raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if base.bit_length() * exponent > MAX_INT_BITS:
            raise ToolError(f"the result has more than {MAX_INT_BITS} bits")
