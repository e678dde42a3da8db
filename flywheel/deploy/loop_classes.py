"""Where each loop's class lives, by name: what a Ray actor (`flywheel/deploy/actors.py`) or a process of
its own (`flywheel serve`, `flywheel loop NAME`) builds. Named as `"module:Class"` and imported
only when built, so a process loads just the loop it runs (collect and judge never import torch).
"""

LOOPS = {
    "serve": "flywheel.serve.loop:ServeLoop",
    "collect": "flywheel.collect.loop:CollectLoop",
    "rollout": "flywheel.rollout.driver:RolloutDriver",
    "judge": "flywheel.judge.loop:JudgeLoop",
    "judge_serve": "flywheel.serve.loop:ServeLoop",
    "eval_serve": "flywheel.serve.loop:ServeLoop",
    "train": "flywheel.train.loop:TrainLoop",
    "promote": "flywheel.promote.loop:PromoteLoop",
}
