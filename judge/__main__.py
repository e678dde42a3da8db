"""`python -m judge`: the judge loop as a process of its own (judge: trajectories to scored samples)."""

from bus.process import loop_main

if __name__ == "__main__":
    raise SystemExit(loop_main("judge.loop:JudgeLoop", "python -m judge", "judge: trajectories to scored samples"))
