"""A pytest plugin that writes every test's outcome to a JSON file, for grading SWE tasks.

Loaded by name (`-p swe_report`) from this folder, which the test runner puts on PYTHONPATH
inside the sandbox; it uses only the standard library and pytest. It is active only when
`SWE_REPORT` names the output file, so it is harmless elsewhere. The file holds
`{"tests": {nodeid: {"outcome", "message"}}, "exitstatus": int}`; a test's outcome is
"passed", "failed", "skipped" or "error" (its setup or teardown failed), and `message` is the
crash message (e.g. the assertion), cut to 500 characters.
"""

import json
import os

_results = {}


def pytest_runtest_logreport(report):
    outcome = report.outcome
    if report.when != "call" and outcome == "failed":
        outcome = "error"
    elif report.when != "call" and not (outcome == "skipped" and report.when == "setup"):
        return
    current = _results.get(report.nodeid)
    if current is not None and current["outcome"] in ("failed", "error"):
        return  # a failing test stays failed whatever its teardown does
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else (str(report.longrepr) if report.longrepr else "")
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if outcome == "skipped" else "xpassed"
    _results[report.nodeid] = {"outcome": outcome, "message": message[:500]}


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SWE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"tests": _results, "exitstatus": int(exitstatus)}, f)
