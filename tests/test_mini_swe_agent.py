"""mini-swe-agent (2.4.6) drives a Flywheel sandbox through its `Environment` protocol
(`flywheel/envs/swe/mini_swe_agent.py`), and, installed as a real client in its own venv
(`make msa-venv`), works a task through the endpoint on `tiny`: its session is one trajectory.

The adapter's contract is checked without mini-swe-agent (Flywheel's venv does not have it),
over a real bubblewrap sandbox (no fakes: bwrap missing is a failure here, as in
test_sandbox.py; `make install` installs it); the end-to-end run needs `.venv-msa` as well, and
is skipped without it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import uuid

import pytest

from flywheel.envs.sandbox import SandboxSpec, make_backend
from flywheel.envs.sandbox.bubblewrap import default_uid_base
from flywheel.envs.sandbox.workdirs import new_workdir
from flywheel.envs.swe.agent import SUBMIT_MARKER
from flywheel.envs.swe.mini_swe_agent import MiniSweAgentEnvironment, submitted_class

# Slots of their own (uid 10060, 10061): other tests sandbox 0, 1, 700+ and 800+, the benchmark 40.
SLOT = 60
OWN_SLOT = 61  # the environment that opens its own sandbox from its config


@pytest.fixture(scope="module")
def backend():
    return make_backend("bubblewrap")


def _workdir():
    """A fresh working directory under `work_root()` (never /tmp, which the sandbox replaces),
    holding hello.txt and an empty sub/."""
    workdir = new_workdir("test-msa-adapter")
    (workdir / "sub").mkdir(parents=True)
    (workdir / "hello.txt").write_text("old\n")
    return workdir


@pytest.fixture
def open_sandbox(backend):
    """open_sandbox(env=..., limits=...) -> a bubblewrap sandbox over a fresh workdir; closed
    (which removes the workdir) after the test."""
    opened = []

    def make(**spec):
        sandbox = backend.open(SandboxSpec(workdir=_workdir(), **spec), slot=SLOT)
        opened.append(sandbox)
        return sandbox

    yield make
    for sandbox in opened:
        sandbox.close()


def test_execute_runs_the_actions_command_in_the_sandbox_and_returns_the_result_shape(open_sandbox):
    sandbox = open_sandbox()
    env = MiniSweAgentEnvironment(sandbox)
    result = env.execute({"command": "id -u; cat hello.txt; echo oops >&2; exit 3", "tool_call_id": "c1"})
    assert result == {"output": f"{default_uid_base() + SLOT}\nold\noops\n", "returncode": 3, "exception_info": ""}
    assert env.execute("echo new > hello.txt")["returncode"] == 0  # a bare string is a command too
    assert (sandbox.workdir / "hello.txt").read_text() == "new\n"


def test_commands_start_in_the_configured_cwd_unless_the_call_names_one(open_sandbox):
    sandbox = open_sandbox()
    (sandbox.workdir / "other").mkdir()
    env = MiniSweAgentEnvironment(sandbox, cwd="sub")
    assert env.execute({"command": "pwd"})["output"] == f"{sandbox.workdir}/sub\n"
    assert env.execute({"command": "pwd"}, "other")["output"] == f"{sandbox.workdir}/other\n"
    assert MiniSweAgentEnvironment(sandbox).execute({"command": "pwd"})["output"] == f"{sandbox.workdir}\n"


def test_the_timeout_kills_a_command_with_rc_124(open_sandbox):
    sandbox = open_sandbox()
    result = MiniSweAgentEnvironment(sandbox, timeout=0.5).execute({"command": "sleep 30"})
    assert result["returncode"] == 124 and "timed out after 0.5 s" in result["exception_info"]
    result = MiniSweAgentEnvironment(sandbox, timeout=60).execute({"command": "sleep 30"}, timeout=0.5)  # the call's wins
    assert result["returncode"] == 124 and "timed out after 0.5 s" in result["exception_info"]


ODD = "a b'c \"d\" $HOME `x` \\n"  # spaces, both quotes, and what a shell would expand


def test_environment_variables_reach_commands_in_a_given_sandbox_quoted(open_sandbox):
    env = MiniSweAgentEnvironment(open_sandbox(), env={"PAGER": "cat", "ODD": ODD})
    result = env.execute({"command": 'printf "%s|%s|" "$PAGER" "$ODD"'})
    assert (result["output"], result["returncode"]) == (f"cat|{ODD}|", 0)


def test_an_environment_opens_its_own_sandbox_from_its_config_and_closes_it():
    workdir = _workdir()
    env = MiniSweAgentEnvironment(workdir=str(workdir), slot=OWN_SLOT, env={"ODD": ODD}, timeout=30)
    try:
        result = env.execute({"command": 'id -u; pwd; printf "%s" "$ODD"'})
        assert result["output"] == f"{default_uid_base() + OWN_SLOT}\n{workdir}\n{ODD}" and result["returncode"] == 0
        assert env.sandbox.spec.env == {"ODD": ODD}  # in the spec, not exported again by the adapter
    finally:
        env.close()
    assert not workdir.exists()  # closing the sandbox it opened removes the workdir


def test_opening_its_own_sandbox_needs_a_workdir():
    with pytest.raises(ValueError, match="workdir"):
        MiniSweAgentEnvironment()


def test_submit_marker_raises_submitted_with_the_rest_as_submission(open_sandbox):
    env = MiniSweAgentEnvironment(open_sandbox())
    setup = env.execute({"command": "git init -q && git add -A && "
                                    "git -c user.name=t -c user.email=t@example.com commit -qm init && "
                                    "echo new > hello.txt"})
    assert setup["returncode"] == 0, setup
    diff = env.execute({"command": "git diff"})["output"]
    assert "-old\n+new\n" in diff
    with pytest.raises(submitted_class()) as caught:
        env.execute({"command": f"echo; echo '  {SUBMIT_MARKER}' && git diff"})  # leading blank space is fine
    (message,) = caught.value.messages
    assert message == {"role": "exit", "content": diff, "extra": {"exit_status": "Submitted", "submission": diff}}
    with pytest.raises(submitted_class()) as caught:
        env.execute({"command": f"echo {SUBMIT_MARKER}; printf 'done\\nno patch'"})
    assert caught.value.messages[0]["extra"]["submission"] == "done\nno patch"


@pytest.mark.parametrize("command,returncode", [(f"echo {SUBMIT_MARKER}; exit 1", 1),
                                                (f"echo before; echo {SUBMIT_MARKER}", 0),
                                                (f"echo {SUBMIT_MARKER}X", 0)])
def test_no_submission_unless_first_line_is_the_marker_and_rc_0(open_sandbox, command, returncode):
    result = MiniSweAgentEnvironment(open_sandbox()).execute({"command": command})
    assert result["returncode"] == returncode and SUBMIT_MARKER in result["output"]


def test_a_failing_sandbox_is_reported_to_the_agent_not_raised(open_sandbox):
    sandbox = open_sandbox()
    env = MiniSweAgentEnvironment(sandbox)
    shutil.rmtree(sandbox.workdir)  # bwrap cannot bind the workdir: it fails, and says so in the output
    result = env.execute({"command": "ls"})
    assert result["returncode"] != 0 and "bwrap" in result["output"] and str(sandbox.workdir) in result["output"]
    sandbox.close()  # a closed sandbox raises on execute: the adapter turns that into a result
    result = env.execute({"command": "ls"})
    assert result["returncode"] == -1 and "this sandbox is closed" in result["exception_info"]
    assert result["extra"] == {"exception_type": "RuntimeError", "exception": "this sandbox is closed"}


def test_template_vars_and_serialize(open_sandbox, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_HOST_ONLY_PROBE", "secret")
    sandbox = open_sandbox(env={"GREETING": "hi"})
    env = MiniSweAgentEnvironment(sandbox, env={"PAGER": "cat"})
    variables = env.get_template_vars(task="fix it")
    # What mini.yaml renders: the kernel the sandbox's commands see (it shares the host's).
    uname = env.execute({"command": "uname -s; uname -r; uname -v; uname -m"})["output"].splitlines()
    assert [variables[k] for k in ("system", "release", "version", "machine")] == uname
    assert variables["task"] == "fix it" and variables["PAGER"] == "cat" and variables["GREETING"] == "hi"
    assert "FLYWHEEL_HOST_ONLY_PROBE" not in variables  # the host's environment stays out of prompts
    config = env.serialize()["info"]["config"]
    assert config["environment_type"] == "flywheel.envs.swe.mini_swe_agent.MiniSweAgentEnvironment"
    assert config["environment"]["env"] == {"PAGER": "cat"}
    assert config["environment"]["sandbox_workdir"] == str(sandbox.spec.workdir)
    assert config["environment"]["sandbox_type"] == "flywheel.envs.sandbox.bubblewrap.BubblewrapSandbox"


def test_a_sandbox_passed_in_is_not_closed_by_the_environment(open_sandbox):
    sandbox = open_sandbox()
    MiniSweAgentEnvironment(sandbox).close()  # the caller's to close
    assert sandbox.workdir.is_dir() and sandbox.execute("echo still here")["output"] == "still here\n"


def _skip_unless_client_and_sandbox() -> None:
    from flywheel.envs.sandbox import SandboxUnavailable, make_backend
    from flywheel.envs.swe.mini_swe_agent_venv import msa_available

    if why := msa_available():
        pytest.skip(f"mini-swe-agent is not installed ({why})")
    try:
        make_backend("bubblewrap")
    except SandboxUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("config", ["tool", "text"])
async def test_mini_swe_agent_session_becomes_one_trajectory(config):
    """The stock `mini` CLI, in its tool-calling and its text-based configuration, against the real
    endpoint on `tiny` (unscripted replies), commands in a bubblewrap sandbox; then (once)
    mini-swe-agent's own DefaultAgent submits through the adapter."""
    _skip_unless_client_and_sandbox()
    from flywheel.drills.mini_swe_agent import endpoint_run
    from flywheel.envs.sandbox.workdirs import work_root
    from flywheel.envs.swe.mini_swe_agent_protocol import protocol_run

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = work_root() / f"test-msa-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        result = await endpoint_run(argparse.Namespace(steps=2, max_tokens=12, timeout=120, grade=False, config=config, model="tiny"), work)
        assert result["mini_returncode"] == 0, result.get("mini_log_tail")
        assert result["checks"] == dict.fromkeys(result["checks"], True), result
        assert result["api_calls"] == 2 and result["trajectory"]["turns"] == 2
        if config == "tool":  # the adapter's protocol does not depend on the model's configuration
            protocol = await protocol_run(work, 120)
            assert protocol["ok"], protocol
    finally:
        shutil.rmtree(work, ignore_errors=True)
