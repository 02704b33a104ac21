"""A calculator agent written against the OpenAI API and nothing else.

streamrl runs it once per episode (`agent.workflow: program`, examples/agent_calculator_openai.yaml)
with OPENAI_BASE_URL and OPENAI_API_KEY set to the rollout's endpoint and the problem in
STREAMRL_PROMPT; every chat request it makes is one turn of the episode being trained. Pointed at
any OpenAI-compatible server it runs the same way:

    OPENAI_BASE_URL=... OPENAI_API_KEY=... STREAMRL_PROMPT='123*45=' python examples/agent_openai.py

The model may call `calculate`; the script evaluates the expression itself and sends the result
back, until the model answers without a call. It prints the final answer.
"""

from __future__ import annotations

import ast
import json
import operator
import os

import openai

MAX_TURNS = 3

CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression and return the result.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": 'e.g. "123*45" or "(2+3)*7"'}
            },
            "required": ["expression"],
        },
    },
}

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def evaluate(node: ast.AST) -> float:
    """Numbers, + - * / and parentheses; anything else is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculate(expression: str) -> str:
    try:
        value = evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as error:
        return f"error: {error}"
    return str(int(value)) if float(value).is_integer() else str(value)


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    if name != "calculate" or not isinstance(args, dict) or "expression" not in args:
        return f"error: no tool {name} taking these arguments (tools: calculate(expression))"
    return calculate(str(args["expression"]))


def main() -> None:
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "user", "content": os.environ["STREAMRL_PROMPT"]}]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATE])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(answer)


if __name__ == "__main__":
    main()
