"""`python -m train`: the train loop as a process of its own (trainer: samples to new policy versions)."""

from bus.process import loop_main

if __name__ == "__main__":
    raise SystemExit(loop_main("train.loop:TrainLoop", "python -m train", "trainer: samples to new policy versions"))
