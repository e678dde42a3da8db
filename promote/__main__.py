"""`python -m promote`: the promotion loop as a process of its own (weight announcements to
promotions; needs `promotion.mode` on and `promotion.eval_url`, an evaluation server:
`python -m serve serve.role=eval`)."""

from bus.process import loop_main

if __name__ == "__main__":
    raise SystemExit(loop_main("promote.loop:PromoteLoop", "python -m promote", "promotion: weight announcements to promotions"))
