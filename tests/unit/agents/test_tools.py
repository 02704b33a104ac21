"""Tools from typed functions, and calls within an episode's limits: deadlines, output caps,
call limits, error results the model reads, infrastructure errors retried then raised, and the
built-in calculator (`streamrl.agents.tools`)."""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
from pathlib import Path
from typing import Literal, Optional

import pytest

from streamrl.agents.tools import (
    Tool,
    ToolBox,
    ToolError,
    ToolInfraError,
    ToolLimits,
    ToolResult,
    ToolTimeout,
    calculate,
    load_tools,
    tool,
    truncate,
)


def call(box: ToolBox, name: str, arguments, session=None):
    return asyncio.run((session or box.episode()).call(name, arguments))


# -- schemas from typed functions --------------------------------------------------------------


def search(
    query: str,
    limit: int,
    threshold: float,
    exact: bool,
    tags: list[str],
    matrix: list[list[int]],
    filters: dict,
    order: Literal["asc", "desc"],
    page: Optional[int],  # noqa: UP045 (the spelling under test)
    cursor: str | None,
    lang: str = "en",
) -> str:
    """Search the index for documents.

    Returns the best matches first.

    Args:
        query: What to look for.
        limit (int): How many results, at most;
            more are dropped.
        threshold: Lowest score kept.

    Returns:
        The matches, one a line.
    """
    return query


def test_typed_arguments_become_the_json_schema() -> None:
    made = tool(search)
    assert (made.name, made.description) == ("search", "Search the index for documents.")
    params = made.parameters
    assert params["type"] == "object"
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "What to look for."}
    assert props["limit"] == {
        "type": "integer",
        "description": "How many results, at most; more are dropped.",
    }
    assert props["threshold"] == {"type": "number", "description": "Lowest score kept."}
    assert props["exact"] == {"type": "boolean"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["matrix"] == {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer"}},
    }
    assert props["filters"] == {"type": "object"}
    assert props["order"] == {"type": "string", "enum": ["asc", "desc"]}
    assert props["page"] == {"type": "integer"}
    assert props["cursor"] == {"type": "string"}
    assert props["lang"] == {"type": "string"}
    # Optional, `X | None` and defaults are not required; nothing from "Returns:" leaks in.
    assert params["required"] == ["query", "limit", "threshold", "exact", "tags", "matrix"] + [
        "filters",
        "order",
    ]
    assert made.schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index for documents.",
            "parameters": params,
        },
    }


def test_the_decorator_takes_a_name_description_and_deadline() -> None:
    @tool(name="add", description="Add two numbers.", timeout_s=2.0)
    async def add_numbers(a: int, b: int = 1) -> int:
        return a + b

    assert isinstance(add_numbers, Tool)
    assert (add_numbers.name, add_numbers.description, add_numbers.timeout_s) == (
        "add",
        "Add two numbers.",
        2.0,
    )
    assert add_numbers.parameters["required"] == ["a"]


def untyped(x, y: int) -> int:
    return y


def unsupported(values: set[int]) -> int:
    return len(values)


def mixed_literal(mode: Literal["a", 1]) -> str:
    return str(mode)


def star(*values: int) -> int:
    return sum(values)


def union(value: int | str) -> str:
    return str(value)


@pytest.mark.parametrize(
    "fn, message",
    [
        (untyped, r"tool function untyped: argument 'x' has no type annotation"),
        (unsupported, r"unsupported, argument 'values': type set\[int\] is not supported"),
        (mixed_literal, r"mixed_literal, argument 'mode': Literal values must all be"),
        (star, r"star: \*values cannot be described"),
        (union, r"union, argument 'value': type int \| str is not supported"),
    ],
)
def test_an_argument_json_cannot_carry_is_a_type_error(fn, message) -> None:
    with pytest.raises(TypeError, match=message):
        tool(fn)


def test_a_bad_tool_name_is_refused() -> None:
    with pytest.raises(ValueError, match="letters, digits"):
        tool(search, name="web search")


# -- loading tools from paths ------------------------------------------------------------------

TOOLS_MODULE = '''
from streamrl.agents.tools import Tool, tool


def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


@tool(name="whisper")
def lower(text: str) -> str:
    """Lower-case the text."""
    return text.lower()


def make_tool() -> Tool:
    return tool(shout, name="made")


NOT_A_TOOL = 3
'''


@pytest.fixture
def tools_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "streamrl_test_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "streamrl_test_tools"
    sys.modules.pop("streamrl_test_tools", None)


def test_load_tools_makes_functions_tools_and_takes_tools_as_they_are(tools_module) -> None:
    paths = ["shout", "lower", "make_tool"]
    shout, whisper, made, calc = load_tools(
        [*(f"{tools_module}:{p}" for p in paths), "streamrl.agents.tools:calculate"]
    )
    assert made.name == "made"  # a function returning a Tool is called, not made a tool
    assert (shout.name, shout.description) == ("shout", "Upper-case the text.")
    assert whisper.name == "whisper"
    assert calc.name == "calculate" and calc.parameters["required"] == ["expression"]


@pytest.mark.parametrize(
    "path, message",
    [
        ("streamrl_test_tools.shout", "expected 'package.module:function'"),
        ("streamrl_no_such_module:fn", "no module named 'streamrl_no_such_module'"),
        ("streamrl_test_tools:missing", "'streamrl_test_tools' has no 'missing'"),
        ("streamrl_test_tools:NOT_A_TOOL", "names a int, not a function or a Tool"),
    ],
)
def test_load_tools_says_what_is_wrong_with_a_path(tools_module, path, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_tools([path])


def test_two_tools_of_one_name_are_refused(tools_module) -> None:
    with pytest.raises(ValueError, match="more than one tool named 'shout'"):
        load_tools([f"{tools_module}:shout", f"{tools_module}:shout"])


# -- calls -------------------------------------------------------------------------------------


def echo(text: str, times: int = 1) -> str:
    """Repeat the text."""
    return text * times


async def pair(a: int, b: float) -> dict:
    """Both numbers."""
    await asyncio.sleep(0)
    return {"a": a, "b": b}


def test_sync_and_async_tools_return_their_output() -> None:
    box = ToolBox([tool(echo), tool(pair)])
    session = box.episode()
    result = call(box, "echo", {"text": "ab", "times": 3}, session)
    assert (result.text, result.status, result.reason, result.truncated) == (
        "ababab",
        "ok",
        "",
        False,
    )
    result = call(box, "pair", {"a": 1, "b": 2.5}, session)
    assert (result.text, result.status) == ('{"a": 1, "b": 2.5}', "ok")  # non-str: JSON
    assert session.calls == 2 and not session.errors
    assert session.schemas == box.schemas == [tool(echo).schema, tool(pair).schema]


def test_a_slow_tool_gets_an_error_result_at_its_deadline() -> None:
    release = threading.Event()

    def slow_sync(x: int) -> str:
        release.wait(10)
        return "late"

    async def slow_async(x: int) -> str:
        await asyncio.sleep(10)
        return "late"

    async def timed(name: str) -> tuple[ToolResult, float]:
        start = time.monotonic()
        result = await box.episode().call(name, {"x": 1})
        elapsed = time.monotonic() - start
        release.set()  # the sync tool's thread runs on past its deadline; let it end
        return result, elapsed

    box = ToolBox([tool(slow_sync, timeout_s=0.3), tool(slow_async, timeout_s=5.0)])
    for name, limits in (("slow_sync", ToolLimits()), ("slow_async", ToolLimits(timeout_s=0.3))):
        box.limits = limits
        result, elapsed = asyncio.run(timed(name))
        assert (result.status, result.reason) == ("error", "timeout"), name
        assert result.text == f"error: tool '{name}' took longer than 0.3 s"
        assert 0.25 <= elapsed < 1.0, elapsed


def test_a_tool_that_stops_itself_at_its_deadline_is_a_timeout() -> None:
    def runs_out(x: int) -> str:
        raise ToolTimeout("ran past 1 s and was stopped")

    result = call(ToolBox([tool(runs_out)]), "runs_out", {"x": 1})
    assert (result.status, result.reason) == ("error", "timeout")
    assert result.text == "error: ran past 1 s and was stopped"


def test_long_output_is_cut_to_the_cap_with_a_marker() -> None:
    box = ToolBox([tool(echo)], ToolLimits(max_output_chars=100))
    result = call(box, "echo", {"text": "x", "times": 5000})
    assert (result.status, result.truncated) == ("ok", True)
    assert len(result.text) <= 100
    cut = 5000 - result.text.count("x")
    assert result.text.endswith(f"\n[... {cut} more characters cut]")
    short = call(box, "echo", {"text": "x", "times": 100})
    assert (short.text, short.truncated) == ("x" * 100, False)
    assert truncate("abcdef", 3) == ("abc", True)  # no room for a marker: a plain cut


def test_calls_past_the_limit_get_an_error_result() -> None:
    box = ToolBox([tool(echo)], ToolLimits(max_calls=2))
    session = box.episode()
    results = [call(box, "echo", {"text": "a"}, session) for _ in range(3)]
    assert [r.status for r in results] == ["ok", "ok", "error"]
    assert results[2].reason == "call_limit"
    assert results[2].text == "error: the limit of 2 tool calls is used up"
    assert session.calls == 3 and session.errors == {"call_limit": 1}
    assert call(box, "echo", {"text": "a"}).status == "ok"  # the limit is per episode


@pytest.mark.parametrize(
    "name, arguments, reason, text",
    [
        ("nope", {}, "unknown_tool", "error: no tool named 'nope' (tools: echo, pair)"),
        ("echo", {}, "bad_arguments", "error: bad arguments for 'echo': missing required argument(s) text"),
        ("echo", {"text": "a", "loud": True}, "bad_arguments", "unknown argument(s) loud (expected: text, times)"),
        ("echo", {"text": 3}, "bad_arguments", "text: expected string, got integer"),
        ("echo", {"text": "a", "times": True}, "bad_arguments", "times: expected integer, got boolean"),
        ("echo", {"text": "a", "times": 2.0}, "bad_arguments", "times: expected integer, got number"),
        ("pair", {"a": 1, "b": "2"}, "bad_arguments", "b: expected number, got string"),
        ("echo", ["a"], "bad_arguments", "expected a JSON object of arguments, got array"),
    ],
)  # fmt: skip
def test_unknown_tools_and_bad_arguments_are_error_results(name, arguments, reason, text) -> None:
    box = ToolBox([tool(echo), tool(pair)])
    session = box.episode()
    result = call(box, name, arguments, session)
    assert (result.status, result.reason) == ("error", reason)
    assert text in result.text and result.text.startswith("error: ")
    assert session.errors == {reason: 1}


def test_enum_and_array_items_are_checked() -> None:
    def pick(order: Literal["asc", "desc"], ids: list[int]) -> str:
        return order

    box = ToolBox([tool(pick)])
    assert call(box, "pick", {"order": "asc", "ids": [1, 2]}).status == "ok"
    assert (
        "expected one of ['asc', 'desc'], got 'up'"
        in call(box, "pick", {"order": "up", "ids": []}).text
    )
    assert (
        "ids: item 1: expected integer, got string"
        in call(box, "pick", {"order": "asc", "ids": [1, "2"]}).text
    )


def test_a_tools_own_errors_go_back_to_the_model() -> None:
    def divide(a: int, b: int) -> float:
        if b == 0:
            raise ToolError("b must not be 0")
        return a / b

    def buggy(a: int) -> int:
        return {}["missing"]

    box = ToolBox([tool(divide), tool(buggy)])
    session = box.episode()
    result = call(box, "divide", {"a": 1, "b": 0}, session)
    assert (result.text, result.status, result.reason) == (
        "error: b must not be 0",
        "error",
        "tool_error",
    )
    result = call(box, "buggy", {"a": 1}, session)
    assert (result.text, result.reason) == ("error: KeyError: 'missing'", "tool_error")
    assert session.errors == {"tool_error": 2}


def flaky_tool(failures: int):
    attempts: list[float] = []

    async def flaky(x: int) -> str:
        attempts.append(time.monotonic())
        if len(attempts) <= failures:
            raise ToolInfraError("connection refused")
        return "done"

    return tool(flaky), attempts


def test_infrastructure_errors_are_retried_with_backoff_then_raised() -> None:
    flaky, attempts = flaky_tool(failures=100)
    box = ToolBox([flaky], ToolLimits(retries=3, backoff_s=0.02))
    session = box.episode()
    with pytest.raises(
        ToolInfraError, match="'flaky' failed 4 time\\(s\\) on infrastructure: connection refused"
    ):
        call(box, "flaky", {"x": 1}, session)
    assert len(attempts) == 4  # the first try and three retries
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
    for gap, backoff in zip(gaps, (0.02, 0.04, 0.08), strict=True):
        assert gap >= backoff * 0.9, gaps
    assert session.errors == {"infra_error": 1}
    assert [ToolLimits().backoff(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_a_tool_that_fails_twice_then_succeeds_returns_ok() -> None:
    flaky, attempts = flaky_tool(failures=2)
    box = ToolBox([flaky], ToolLimits(retries=3, backoff_s=0.01))
    session = box.episode()
    result = call(box, "flaky", {"x": 1}, session)
    assert (result.text, result.status) == ("done", "ok")
    assert len(attempts) == 3
    assert session.calls == 1 and not session.errors


# -- the calculator ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("123*45", "5535"),
        (" 2 + 3 * (4 - 1) ", "11"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("10 / 4", "2.5"),
        ("10 / 2", "5"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("--3", "3"),
        ("1.5 * 2", "3"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("2 ** 100", str(2**100)),
    ],
)
def test_calculate_evaluates_arithmetic(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os')", "not function calls"),
        ("(1).real", "not attribute access"),
        ("x + 1", "not names"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("[1, 2]", "not List"),
        ("1 << 100", "not the operator LShift"),
        ("~1", "not the operator Invert"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than 1024"),
        ("(10 ** 1000) ** 1000", "more than 10000 bits"),
        ("10.0 ** 1000", "too large"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 1001, "longer than 1000 characters"),
        ("-" * 999 + "1", "nested more than 100 levels deep"),
    ],
)
def test_calculate_refuses_anything_else_with_a_clear_error(expression, message) -> None:
    start = time.monotonic()
    with pytest.raises(ToolError, match=message):
        calculate(expression)
    assert time.monotonic() - start < 1.0  # refused before any huge computation


def test_calculate_is_a_tool_whose_errors_the_model_reads() -> None:
    box = ToolBox(load_tools(["streamrl.agents.tools:calculate"]))
    assert call(box, "calculate", {"expression": "123*45"}).text == "5535"
    result = call(box, "calculate", {"expression": "__import__('os').system('true')"})
    assert (result.status, result.reason) == ("error", "tool_error")
    assert result.text.startswith("error: only numbers")
