"""The supervised warm start for SWE agents: gold demonstrations are real, resolving episodes in
the agent's format, and `flywheel.train.sft` learns from their assistant tokens only."""

import json

import pytest
import torch

from flywheel.cli.main import main
from flywheel.envs.swe.agent import parse_action
from flywheel.envs.swe.demos import demonstration, split
from flywheel.envs.swe.env import SweEnv
from flywheel.envs.swe.statement import enclosing_function
from flywheel.models import load_model
from flywheel.train.sft import encode, fine_tune


def test_the_easy_statement_names_the_function_that_holds_the_bug():
    source = "def outer():\n    def inner():\n        return 1\n    return inner\n\nX = 2\n"
    assert enclosing_function(source, 3) == "inner" and enclosing_function(source, 4) == "outer"
    assert enclosing_function(source, 6) is None
    env = SweEnv(difficulty=["easy"])
    assert all("The bug is in `" in t.problem_statement and "` in `" in t.problem_statement for t in env.tasks.values())


@pytest.fixture(scope="module")
def demos():
    env = SweEnv(difficulty=["easy"], slot_base=820)
    return {task.instance_id: demonstration(env, task) for task in env.tasks.values()}


def test_demonstrations_are_resolving_episodes_in_the_agents_format(demos):
    kept = {iid: messages for iid, messages in demos.items() if messages is not None}
    assert len(kept) >= 3  # addict__mut-0002's fix is not the first match on its line: no demonstration
    for messages in kept.values():
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        commands = [parse_action(reply).command for reply in replies]
        assert commands[0].startswith("grep -n -A") and commands[1].startswith("sed -i") and "SUBMIT" in commands[2]
        assert [m["role"] for m in messages[:3]] == ["system", "user", "assistant"]
        assert "<returncode>0</returncode>" in messages[3]["content"]
    train, held_out = split(list(SweEnv(difficulty=["easy"]).tasks.values()), 0.4, seed=0)
    assert len(held_out) == 2 and not {t.instance_id for t in train} & {t.instance_id for t in held_out}


def test_sft_trains_on_assistant_tokens_only_and_saves_a_servable_model(demos, tmp_path):
    model, tokenizer = load_model("tiny")
    conversations = [m for m in demos.values() if m is not None]
    ids, labels = encode(tokenizer, conversations[0])
    assistant = "".join(tokenizer.decode([t]) for t, label in zip(ids, labels) if label != -100)
    assert "sed -i" in assistant and "You are a software engineer" not in assistant and "<returncode>" not in assistant
    before = [p.detach().clone() for p in model.parameters()]
    losses = fine_tune(model, [encode(tokenizer, m) for m in conversations], epochs=4, lr=3e-3, batch=1, log=lambda _: None)
    assert losses[-1] < losses[0] * 0.8
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    assert main(["sft", "--data", str(data), "--model", "tiny", "--out", str(tmp_path / "warm"), "--batch", "2"]) == 0
    warm, _ = load_model(str(tmp_path / "warm"))
    assert sum(p.numel() for p in warm.parameters()) == sum(p.numel() for p in model.parameters())
