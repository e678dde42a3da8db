"""The canary's sequential test: its error rates by simulation (0/1 rewards, a 10 % canary
share, the configured δ = 0.1, α = 0.05, β = 0.1), and its decisions on known evidence."""

import pytest

from flywheel.promote.sequential import SequentialTest, simulate
from flywheel.running_stats import RunningStats

TEST = SequentialTest(delta=0.1, alpha=0.05, beta=0.1, min_sessions=8, max_sessions=400)
RUNS = 300


def arm(rewards: list[float]) -> RunningStats:
    stats = RunningStats()
    for reward in rewards:
        stats.add(reward)
    return stats


def test_a_canary_worse_by_delta_is_promoted_at_most_alpha_of_the_time():
    # α = 0.05; 3 standard errors of a 300-run estimate above it
    assert simulate(TEST, true_delta=-0.1, share=0.1, runs=RUNS, seed=1)["promoted"] <= 0.05 + 3 * (0.05 * 0.95 / RUNS) ** 0.5


def test_a_much_worse_canary_is_rolled_back_quickly():
    result = simulate(TEST, true_delta=-0.3, share=0.1, runs=RUNS, seed=2)
    assert result["promoted"] <= 0.01 and result["canary_sessions_mean"] < 40


def test_a_canary_no_worse_is_rolled_back_at_most_beta_of_the_time():
    assert simulate(TEST, true_delta=0.0, share=0.1, runs=RUNS, seed=3)["promoted"] >= 0.9 - 3 * (0.1 * 0.9 / RUNS) ** 0.5


def test_a_better_canary_is_promoted():
    assert simulate(TEST, true_delta=0.1, share=0.1, runs=RUNS, seed=4)["promoted"] >= 0.97


def test_it_waits_for_min_sessions_on_both_arms():
    assert TEST.decide(arm([0.0] * 7), arm([1.0] * 100)).verdict is None  # 7 < 8 canary sessions
    assert TEST.decide(arm([0.0] * 8), arm([1.0] * 100)).verdict == "rollback"
    assert TEST.decide(arm([1.0] * 8), arm([1.0] * 100)).verdict == "promote"


def test_undecided_at_max_sessions_it_decides_by_the_nearer_hypothesis():
    wide = SequentialTest(delta=0.1, alpha=0.05, beta=0.1, min_sessions=8, max_sessions=20, variance_floor=1.0)
    assert wide.decide(arm([1.0] * 8), arm([1.0] * 100)).verdict is None  # identical rewards claim no certainty past the floor
    assert wide.decide(arm([0.5] * 19), arm([0.5] * 19)).verdict is None
    decided = wide.decide(arm([0.5] * 20), arm([0.5] * 20))
    assert decided.verdict == "promote" and "undecided at 20" in decided.reason
    assert wide.decide(arm([0.4] * 20), arm([0.5] * 20)).verdict == "rollback"  # nearer harm (Δ̂ = −δ) than no harm


@pytest.mark.parametrize("rewards", [[0.0, 1.0, 1.0, 0.5], [3.0, -1.0, 2.5, 0.0, 0.25]])
def test_arm_statistics_survive_a_round_trip_and_match_the_batch_formulas(rewards):
    stats = arm(rewards)
    mean = sum(rewards) / len(rewards)
    assert stats.mean == pytest.approx(mean)
    assert stats.m2 == pytest.approx(sum((r - mean) ** 2 for r in rewards))
    assert RunningStats.from_dict(stats.as_dict()) == stats


def test_operations_roll_back_a_canary_whose_turns_fail_or_crawl():
    from flywheel.bus import Timings
    from flywheel.config.promotion import CanaryConfig
    from flywheel.promote.evidence import (
        add_turn,
        new_operations,
        operations_verdict,
        turn_version,
    )

    from factories import make_turn

    def turns(n: int, failed: int, tpot: float) -> dict:
        ops = new_operations()
        for i in range(n):
            add_turn(ops, make_turn(output_ids=[1] * 11, output_logprobs=[0.0] * 11, output_versions=[2] * 11,
                                    finish_reason="abort" if i < failed else "stop",
                                    timings=Timings(first_token_s=0.1, total_s=0.1 + 10 * tpot)))
        return ops

    assert turn_version(make_turn(output_versions=[2, 2])) == 2 and turn_version(make_turn(output_versions=[2, 3])) is None
    config = CanaryConfig(min_sessions=8, max_latency_ratio=2.0)
    assert operations_verdict(turns(7, 7, 0.01), turns(50, 0, 0.01), config) is None  # too few turns to say
    assert "30% of its turns failed" in operations_verdict(turns(10, 3, 0.01), turns(50, 1, 0.01), config)
    assert operations_verdict(turns(10, 1, 0.01), turns(50, 1, 0.01), config) is None
    assert "3.0x" in operations_verdict(turns(10, 0, 0.03), turns(50, 0, 0.01), config)
    assert operations_verdict(turns(10, 0, 0.03), turns(50, 0, 0.01), CanaryConfig(min_sessions=8)) is None  # off by default
    client_gone = new_operations()
    add_turn(client_gone, make_turn(finish_reason="abort", client_disconnected=True))
    assert client_gone["failed"] == 0  # the client went away: not the version's failure
