"""The canary's sequential test, its error rates by simulation (0/1 rewards): how often a canary
is promoted, and how many canary sessions it takes to decide, at true differences from better
to twice the margin worse (`flywheel/promote/sequential.py`; docs/promotion.md cites them).

    .venv/bin/python bench/canary_error_rates.py [--delta 0.1] [--alpha 0.05] [--beta 0.1] [--runs 2000]
"""

from __future__ import annotations

import argparse

from flywheel.promote.sequential import SequentialTest, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description="The canary test's error rates by simulation (0/1 rewards).")
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--min-sessions", type=int, default=8)
    parser.add_argument("--max-sessions", type=int, default=400)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    test = SequentialTest(args.delta, args.alpha, args.beta, args.min_sessions, args.max_sessions)
    print("| true Δ | promoted | canary sessions to decide |\n|---|---|---|")
    for true_delta in (0.1, 0.0, -args.delta / 2, -args.delta, -2 * args.delta):
        result = simulate(test, true_delta, args.share, args.runs)
        print(f"| {true_delta:+.2f} | {result['promoted']:.3f} | {result['canary_sessions_mean']:.1f} |")


if __name__ == "__main__":
    main()
