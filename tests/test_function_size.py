"""The package's functions stay short enough to read on one screen.

Why a test: the round loop, the launch sequence and the server's setup each grew past a screen once, one feature at a
time, and were split in review afterwards. With the bound here, a function that outgrows a screen is split in the
change that grows it. The figures are the package's own when the bound was set (2,102 functions, median 7 lines,
longest 64), not a goal picked from elsewhere.
"""
from __future__ import annotations

import ast
import functools
import statistics
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpifl"
LONGEST = 64  # lines, decorators excluded, docstring included: one screen
TYPICAL = 8  # the median's bound: most functions do one thing in a few lines


@functools.cache
def function_lengths() -> dict[str, int]:
    """Every function and method of the package by ``path:line name``, with its length in lines."""
    lengths = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
                lengths[where] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    return lengths


def test_no_function_of_the_package_is_longer_than_a_screen():
    longer = {where: n for where, n in function_lengths().items() if n > LONGEST}
    assert not longer, f"functions longer than {LONGEST} lines (split them where they change): {longer}"


def test_half_the_functions_of_the_package_are_a_few_lines():
    assert statistics.median(function_lengths().values()) <= TYPICAL
