"""`python -m collect`: the collect loop as a process of its own (session tracker: turns to trajectories)."""

from bus.process import loop_main

if __name__ == "__main__":
    raise SystemExit(loop_main("collect.loop:CollectLoop", "python -m collect", "session tracker: turns to trajectories"))
