"""The `next_state` judge's classifier of tool output: what a tool or test run returned after an
assistant reply, as one call (`flywheel/judge/next_state_classes.py`).

Tool output (`classify_tool_output`) is read for structure, never for words: a test runner's
summary (pytest, unittest, jest, mocha, cargo, go: "0 failed" passes, "2 xfailed" is no failure,
"no tests ran" is unclear), an explicit exit code, an HTTP status, a JSON result with an error,
a traceback, a diagnostic line (`error:`, `file:3:5: error`, `npm ERR!`, `fatal:`). "error" inside
ordinary output (a grep hit, a file, a commit message) is not an error; empty output is clean.
"""

from __future__ import annotations

import json
import re

from flywheel.judge.next_state_classes import Call

_COUNT = re.compile(r"\b(\d+)\s+(xfailed|xpassed|passed|passing|failed|failing|failures|errors|error)\b", re.I)
_TESTS_FAILED = re.compile(
    r"^(?:FAILED\b|--- FAIL\b|FAIL\b|FAIL:|ERROR:\s+test)|test result: FAILED|::\S+ FAILED\b|\.\.\. FAILED$", re.M)
_TESTS_OK = re.compile(r"^ok\s+\S+\s+[\d.]+s|test result: ok\b|Ran \d+ tests? in \S+\s+OK\b|::\S+ PASSED\b", re.M)
_NO_TESTS = re.compile(r"\bno tests ran\b|\bcollected 0 items\b|\bno tests? (?:found|to run)\b", re.I)
_TEST_TOTAL = re.compile(r"\b[1-9]\d* tests?\b", re.I)
_EXIT = re.compile(r"\b(?:exit(?:ed)?(?: with)?(?: code| status)?|exit_code|return ?code)\b\W{0,3}(-?\d+)\b", re.I)
_HTTP = re.compile(r"^HTTP/\d(?:\.\d)?\s+(\d{3})\b", re.M)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s+at \S+ \(\S+:\d+:\d+\)$", re.M)
_DIAGNOSTIC = re.compile(
    r"^\s*[\w.]*(?:Error|Exception)(?::|$)|^npm ERR!|^[\w./-]+: error:|\berror TS\d+|\bERROR:|core dumped|"
    r"^\S+:\d+:\d+: (?!warning|note)|^\S+:\d+: error:|(?i:^\s*(?:error|fatal|panic)(?:\[\w+\])?[:\s]|"
    r"\bsegmentation fault\b|\bcommand not found\b|\bno such file or directory\b|\bpermission denied\b|"
    r"\bconnection refused\b|\bcannot find module\b|\btimed out\b)", re.M)
_PENDING = re.compile(r"\b(?:started in (?:the )?background|still running|in progress|queued|pending)\b", re.I)


def runner_verdict(text: str) -> Call | None:
    """A test runner's verdict, if the text holds one."""
    counts: dict[str, int] = {}
    for n, word in _COUNT.findall(text):
        counts[word.lower()] = counts.get(word.lower(), 0) + int(n)
    failed = sum(counts.get(w, 0) for w in ("failed", "failing", "failures"))
    passed = counts.get("passed", 0) + counts.get("passing", 0)
    summary = any(w in counts for w in ("passed", "passing", "failed", "failing"))
    errors = counts.get("error", 0) + counts.get("errors", 0) if summary else 0
    if failed or errors or (line := _TESTS_FAILED.search(text)):
        counted = f"{failed} failed, {errors} errors" if failed or errors else repr(line[0].strip())
        return Call("tests_failing", f"test run: {counted}")
    if _NO_TESTS.search(text) and not passed:
        return Call("unclear", "test run: no tests ran")
    if passed or _TESTS_OK.search(text) or (summary and _TEST_TOTAL.search(text)):
        return Call("tests_passing", f"test run: {passed} passed, 0 failed" if passed else "test run: ok")
    return None


def _json_error(text: str) -> str | None:
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    if value.get("error") or value.get("ok") is False or value.get("success") is False:
        return f"json result: {str(value.get('error') or value)[:80]!r}"
    if str(value.get("status", "")).lower() in ("error", "failed", "failure"):
        return f"json result: status {value['status']!r}"
    return None


def classify_tool_output(text: str) -> Call:
    """One tool result's class: tests_failing, tests_passing, error, clean_tool_result or unclear."""
    text = text.strip()
    if not text:
        return Call("clean_tool_result", "tool: empty output")
    if tests := runner_verdict(text):
        return tests
    if exit_code := _EXIT.search(text):
        code = int(exit_code[1])
        return Call("error" if code else "clean_tool_result", f"tool: exit code {code}")
    if problem := _json_error(text):
        return Call("error", f"tool: {problem}")
    if status := _HTTP.search(text):
        return Call("error" if int(status[1]) >= 400 else "clean_tool_result", f"tool: HTTP {status[1]}")
    if _TRACEBACK.search(text):
        return Call("error", "tool: traceback")
    if line := _DIAGNOSTIC.search(text):
        start = text.rfind("\n", 0, line.start()) + 1
        end = text.find("\n", line.end())
        return Call("error", f"tool: diagnostic {text[start:end if end >= 0 else None].strip()[:80]!r}")
    if _PENDING.search(text):
        return Call("unclear", "tool: still pending")
    return Call("clean_tool_result", "tool: no sign of failure")
