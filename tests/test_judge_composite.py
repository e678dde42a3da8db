"""The composite judge (weighted components, optional ones, normalisation per task and step),
the running normaliser, and the `model` judge (a local reward model with a scalar head) against
a direct forward pass."""

import statistics

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from flywheel.config import load_config
from flywheel.config.judge import RewardModelJudgeConfig
from flywheel.judge.base import Judge, Unscorable, Verdict
from flywheel.judge.build import build_judge
from flywheel.judge.composite import Component, CompositeJudge
from flywheel.judge.normalize import Normalizer
from flywheel.judge.reward_model import RewardModelJudge
from flywheel.running_stats import RunningStats

from factories import conversation, fb


class Fixed(Judge):
    """A judge with a set verdict, or `Unscorable` when given none."""

    def __init__(self, name: str, verdict: Verdict | None):
        self.name = name
        self.verdict = verdict

    async def score(self, trajectory):
        if self.verdict is None:
            raise Unscorable("no reward", f"{self.name} has nothing")
        return self.verdict


async def test_components_combine_as_a_weighted_sum_of_outcomes_and_of_turn_rewards():
    judge = CompositeJudge([
        Component(Fixed("a", Verdict(1.0, [1.0, 0.0], {"x": 1})), weight=2.0),
        Component(Fixed("b", Verdict(0.5, [0.2, 0.8])), weight=-0.5),
    ])
    verdict = await judge.score(conversation("c", ["p", "q"]))
    assert verdict.reward == pytest.approx(2.0 - 0.25)
    assert verdict.turn_rewards == [pytest.approx(2.0 - 0.1), pytest.approx(0.0 - 0.4)]
    assert verdict.details["components"]["0:a"]["details"] == {"x": 1} and verdict.details["skipped"] == {}
    assert verdict.details["components"]["1:b"]["weight"] == -0.5


async def test_an_optional_component_that_cannot_score_is_left_out_and_a_required_one_is_fatal():
    optional = CompositeJudge([Component(Fixed("rule", None), 1.0, required=False), Component(Fixed("llm", Verdict(0.4, [0.4])), 1.0)])
    verdict = await optional.score(conversation("c", ["p"]))
    assert verdict.reward == pytest.approx(0.4) and verdict.details["skipped"] == {"0:rule": "no reward: rule has nothing"}
    required = CompositeJudge([Component(Fixed("rule", None), 1.0), Component(Fixed("llm", Verdict(0.4, [0.4])), 1.0)])
    with pytest.raises(Unscorable) as caught:
        await required.score(conversation("c", ["p"]))
    assert caught.value.category == "no reward" and caught.value.detail == "component 0:rule: rule has nothing"
    nobody = CompositeJudge([Component(Fixed("rule", None), 1.0, required=False)])
    with pytest.raises(Unscorable, match="no component scored"):
        await nobody.score(conversation("c", ["p"]))


def test_running_stats_match_the_textbook_mean_and_standard_deviation():
    values = [3.0, -1.0, 4.5, 10.0, 2.25, 7.0]
    stats = RunningStats()
    for v in values:
        stats.add(v)
    assert stats.n == 6 and stats.mean == pytest.approx(statistics.fmean(values))
    assert stats.std == pytest.approx(statistics.stdev(values))


def test_normaliser_centres_during_warm_up_then_standardises_per_key():
    """Against the scores before it, never its own (issue 23: counted in its own baseline, a
    score was pulled toward 0 by an amount that depended on the order of arrival)."""
    normalise = Normalizer(warmup=3)
    assert normalise("k", 5.0) == 0.0  # the first score of a key: nothing to compare with
    assert normalise("k", 7.0) == pytest.approx(7.0 - 5.0)  # warm-up: centred only
    assert normalise("other", 100.0) == 0.0  # keys are separate
    assert normalise("k", 9.0) == pytest.approx(9.0 - 6.0)
    fourth = normalise("k", 11.0)
    assert fourth == pytest.approx((11.0 - 7.0) / statistics.stdev([5.0, 7.0, 9.0]))
    flat = Normalizer(warmup=2)
    assert [flat("f", 1.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # no variation: zeros, not infinities


async def test_composite_from_config_normalises_per_task_and_turn_index(tmp_path):
    config = load_config(None, [
        f"run_dir={tmp_path}", "judge.kind=composite", "judge.composite.normalize=true", "judge.composite.normalize_warmup=2",
        "judge.composite.components=[{kind: rule, weight: 2.0}]",
    ])
    judge = build_judge(config)
    await judge.start()
    rewards = []
    for i, reward in enumerate([0.0, 1.0, 0.5]):
        feedback = [fb(reward, turn_index=0), fb(1.0 - reward, turn_index=1)]
        rewards.append(await judge.score(conversation(f"n{i}", ["p", "q"], task_id="T", feedback=feedback)))
    other_task = await judge.score(conversation("o", ["p", "q"], task_id="U", feedback=[fb(0.9, turn_index=0)]))
    await judge.close()
    assert rewards[0].turn_rewards == [0.0, 0.0]
    assert rewards[1].turn_rewards == [pytest.approx(2 * (1.0 - 0.0)), pytest.approx(2 * (0.0 - 1.0))]  # warm-up
    assert rewards[2].turn_rewards == [pytest.approx(2 * (0.5 - 0.5) / statistics.stdev([0, 1])), pytest.approx(0.0)]
    assert other_task.turn_rewards == [0.0, 0.0] and other_task.reward == 0.0  # a new task starts its own statistics
    assert rewards[1].details["components"]["0:rule"]["turn_rewards"] == [1.0, 0.0]


@pytest.fixture(scope="module")
def reward_models(tiny_path, tmp_path_factory):
    """Two small random reward models on tiny's tokenizer: with its chat template and without."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config).eval()
    paths = {}
    for name, template in (("templated", tokenizer.chat_template), ("plain", None)):
        path = tmp_path_factory.mktemp(name)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(path)
        model.save_pretrained(path)
        paths[name] = path
    return paths


def direct_scores(path, texts: list[str], add_special_tokens: bool) -> list[float]:
    """One unpadded forward pass per text, read at its last token."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = None  # batch of one: the last token, whatever it is
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt", add_special_tokens=add_special_tokens)).logits[0, 0].item() for t in texts]


@pytest.mark.parametrize("kind", ["templated", "plain"])
async def test_reward_model_scores_equal_a_direct_forward_pass(reward_models, kind):
    path = reward_models[kind]
    judge = RewardModelJudge(RewardModelJudgeConfig(path=str(path), batch_size=2, outcome="last"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    await judge.start()
    assert torch.get_num_threads() == 1  # judge.model.torch_threads, set when the judge starts
    torch.set_num_threads(threads)
    # replies of different lengths (padding in a batch); one ends with the pad token itself
    trajectory = conversation("rm", ["4", "The answer is 42, because 6 * 7 = 42.", "done<|endoftext|>"])
    texts = [judge.render(trajectory, i) for i in range(3)]
    verdict = await judge.score(trajectory)
    await judge.close()
    if kind == "templated":
        assert texts[0].startswith("<|im_start|>system\nBe exact.<|im_end|>") and texts[0].endswith("<|im_start|>assistant\n4<|im_end|>\n")
    else:
        assert texts[1] == ("system: Be exact.\n\nuser: task rm\n\nassistant: 4\n\nuser: user reply 0\n\n"
                            "assistant: The answer is 42, because 6 * 7 = 42.")
    expected = direct_scores(path, texts, add_special_tokens=kind == "plain")
    assert verdict.turn_rewards == pytest.approx(expected, abs=1e-5)
    assert len(set(verdict.turn_rewards)) == 3 and verdict.reward == verdict.turn_rewards[-1]
    assert verdict.details == {"model": str(path)}


def test_a_model_judge_needs_a_path():
    with pytest.raises(Exception, match="judge.model.path: required when judge.kind is model"):
        load_config(None, ["judge.kind=model"])
