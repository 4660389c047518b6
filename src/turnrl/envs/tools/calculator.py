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


def tools_task(options: dict) -> synthetic.SyntheticTask:
    """The warm start's task for these (validated) `tools` options: `demonstration`, the hook
    beside the functions, demonstrating the configured tools (on data.train_set's rows, or the
    synthetic products); else the calculator's demonstrations where the calculator is one of the
    tools; else none, with the one line that says what to set (every replayed call would name a
    tool the policy does not have)."""
    hook = options.get("demonstration") or ""
    if hook:
        from turnrl.plugins import load_object
        return synthetic.SyntheticTask("tools", TASK.rows, TASK.key, load_object(hook, "env.options.demonstration"),
                                       any_row=True)
    functions = list(options.get("functions") or [])
    if any(_is_calculator(path) for path in functions) or any(h.get("name") == "calculator"
                                                               for h in options.get("http") or []):
        return TASK
    tools = functions + [h.get("name", "?") for h in options.get("http") or []] + \
        [f"mcp {m.get('url') or ' '.join(m.get('command') or [])}" for m in options.get("mcp") or []]
    return synthetic.SyntheticTask("tools", TASK.rows, TASK.key, None, no_demonstration=(
        f"the tools environment's warm start demonstrates calls to the built-in calculator, which the configured "
        f"tools ({', '.join(tools)}) do not include; set env.options.demonstration to module:function "
        f"((row, rng, good) -> the turns calling your tools, then the answer), add turnrl.envs.tools:calculator "
        f"to env.options.functions, or set model.path to a checkpoint"))


def _is_calculator(path: str) -> bool:
    """A function the calculator's demonstrations can call: named calculator, taking `expression`
    (the built-in, or a copy of one's own such as examples/tools/calc.py)."""
    import inspect

    from turnrl.plugins import PluginError, load_object
    try:
        fn = load_object(path, "env.options.functions")
        return getattr(fn, "__name__", "") == "calculator" and "expression" in inspect.signature(fn).parameters
    except (PluginError, TypeError, ValueError):
        return False
