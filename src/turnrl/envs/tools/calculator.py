"""The calculator, the `tools` environment's default tool, and the tiny model's warm-start
demonstrations of calling it."""
from __future__ import annotations

import ast
import json
import math
import operator

from turnrl.data import synthetic

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10 ** 6):
            raise ValueError("the power is too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression, e.g. 347 * 8215 or (12 + 30) / 4.
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer():
            value = int(value)
        else:
            return f"{value:.10g}"
    return str(value)


def calculator_demonstration(row: dict, rng, good: bool) -> synthetic.Demonstration:
    """For the tiny model's warm start on the synthetic products ("Compute 347 * 8215."). Good:
    call `calculator` with the product and copy its result. Otherwise: guess a number of the
    right length (almost always wrong); only the choice to answer at once is trained."""
    if good:
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{row['a']} * {row['b']}"}})
        return synthetic.Demonstration([f"<tool_call>\n{call}\n</tool_call>", f"<answer>{row['answer']}</answer>"])
    guess = rng.randint(10 ** (len(row["answer"]) - 1), 10 ** len(row["answer"]) - 1)
    return synthetic.Demonstration([f"<answer>{guess}</answer>"], choice=(0, "<answer>"))


TASK = synthetic.SyntheticTask("tools", synthetic.product_rows, lambda r: (r["a"], r["b"]), calculator_demonstration)
