"""A synthesized task's difficulty tier and its problem statement, written from the failing tests.

The statement is what a user would report after running the suite: failing test ids and the
crash message pytest printed (an assertion, an exception). It never quotes the bug patch.
How much it gives away depends on the tier, set by how many tests the bug breaks:

    easy    1-5 failing tests: all of them with their messages, and the function and file that
            hold the bug
    medium  6-30 failing tests: up to five of them with their messages, no file
    hard    more than 30: one failing test with its message and the count of the others, no file

Fewer failing tests means a bug whose effect is narrow, and the function named in an easy
statement makes finding it a read of one function (what a user who stepped through the failure
would report); a hard statement points at one symptom of a broad bug.
"""

from __future__ import annotations

import ast

MESSAGE_CHARS = 300


def difficulty(n_fail: int) -> str:
    return "easy" if n_fail <= 5 else "medium" if n_fail <= 30 else "hard"


def _message(text: str) -> str:
    text = text.strip() or "(no message)"
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + " ..."
    return "\n".join("    " + line for line in text.splitlines())


def enclosing_function(source: str, line: int) -> str | None:
    """The name of the innermost function (or method) whose body holds `line`, None at module
    or class level."""
    best: tuple[int, str] | None = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno > best[0]:
                best = (node.lineno, node.name)
    return best[1] if best else None


def problem_statement(failures: dict[str, str], test_cmd: str, tier: str, bug_file: str,
                      bug_function: str | None = None) -> str:
    """`failures`: failing test id -> its crash message, in a stable order."""
    ids = list(failures)
    shown = {"easy": ids, "medium": ids[:5], "hard": ids[:1]}[tier]
    others = len(ids) - len(shown)
    first = f"`{shown[0]}` fails" + (f" (and {len(ids) - 1} other tests)" if len(ids) > 1 else "")
    lines = [f"Running the test suite (`{test_cmd}`), {first}:", "", _message(failures[shown[0]])]
    for previous, test in zip(shown, shown[1:]):
        if failures[test] == failures[previous]:
            lines += ["", f"`{test}` fails too, with the same message."]
        else:
            lines += ["", f"`{test}` fails too:", "", _message(failures[test])]
    if others and tier != "hard":
        lines += ["", f"{others} more tests fail."]
    if tier == "easy":
        where = f"`{bug_function}` in `{bug_file}`" if bug_function else f"`{bug_file}`"
        lines += ["", f"The bug is in {where}."]
    lines += ["", "The test expectations are correct: fix the library code, not the tests."]
    return "\n".join(lines) + "\n"
