"""A user's function as a tool for `env.name: tools` (GSM8K with a calculator):

    dvc exp run -S env.name=tools -S data.train_set=gsm8k_train -S data.heldout_set=gsm8k_test \
                -S '++env.options.functions=[examples.tools.calc:calculator]'

The schema the model sees comes from the type hints and the docstring (its one-line description
and the Args: section). An exception is an error observation for the policy, not a crash.
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (decimals, + - * / and parentheses).

    Args:
        expression: The expression to evaluate, e.g. 48 / 2 + 48 or (12.5 - 3) * 4.
    """
    allowed = set("0123456789.+-*/() ")
    if not expression or set(expression) - allowed or len(expression) > 200:
        raise ValueError("only numbers, + - * / and parentheses, at most 200 characters")
    tokens = expression.replace("(", " ( ").replace(")", " ) ")
    for op in "+-*/":
        tokens = tokens.replace(op, f" {op} ")
    try:   # exact decimal arithmetic: 0.1 + 0.2 is 0.3
        value = eval(" ".join(f"Decimal('{t}')" if t[0].isdigit() or t[0] == "." else t for t in tokens.split()),
                     {"__builtins__": {}, "Decimal": Decimal})
    except (SyntaxError, InvalidOperation, ZeroDivisionError) as exc:
        raise ValueError(f"cannot evaluate {expression!r}: {type(exc).__name__}") from None
    return format(value.normalize(), "f")
