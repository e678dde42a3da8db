"""Issue 45, the update alone: how far corrections move a person's adapter toward their wish, with
the platform's trainer and nothing else (no loops, no engine, no judge, no pacing).

What runs
    SmolLM2-135M, the trainer's own LoRA adapter (flywheel/train/adapters.py) on the frozen base,
    and a simulated person (flywheel/drills/simulated_people.py) with a wish the base meets when
    told it (`nickname`, `steps`). Each correction, as in a live session: the adapter writes the
    first reply to the person's next question (sampled at 0.7, up to 64 tokens); the person reacts
    in their words; a reply that misses is judged -1 and the reaction is its hint; the teacher,
    the base with the adapter off, gets the request with the hint appended to the last user
    message (`judge.teacher.hint_template`) and gives its 20 likeliest tokens at every position
    of the reply (`judge.teacher.top_k`); the sample is one `Trainer.step`, with the actor settings
    of configs/personal_agent.yaml plus adapters (bench/two_people.py's) and the overrides given.
    `--replies K` makes each correction K replies to the same question, one step: practice on the
    corrected question.

Measured after every correction, on `--questions` held-out questions (never trained)
    the adapter's next-token probability (temperature 1) at the reply's start of the wish's first
    token ("Captain", "Step"; the teacher's is 0.07-0.09 and 0.35-0.37), its mean over the
    questions; and at the
    start and the end, sampled replies that meet the wish and that answer the question.

How to run (about 2-4 min a variant on 2 cores)
    .venv/bin/python bench/hint_update.py --wish steps --corrections 12 [--replies 1] [key=value ...]

Writes bench/results/hint_update_<wish>.json, one entry per run appended (the variant's overrides).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from statistics import fmean
from string import Template

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, START_COMMIT  # noqa: E402
from flywheel.bus import Sample, Trajectory, Turn  # noqa: E402
from flywheel.bus.arrays import Float64s, Int32s  # noqa: E402
from flywheel.bus.stitch import stitch  # noqa: E402
from flywheel.config import load_config  # noqa: E402
from flywheel.drills.personal_agent import CONFIG  # noqa: E402
from flywheel.drills.simulated_people import (  # noqa: E402
    HELD_OUT_QUESTIONS,
    PREFERENCES,
    User,
    answers,
)
from flywheel.models import load_model  # noqa: E402
from flywheel.train.advantages import RunningBaseline  # noqa: E402
from flywheel.train.grouping import Group, Member  # noqa: E402
from flywheel.train.step_batch import StepBatch  # noqa: E402
from flywheel.train.trainer import Trainer  # noqa: E402

FIRST_TOKEN = {"nickname": "Captain", "steps": "Step"}
"""The first token of a reply that meets the wish the way the teacher writes it."""
LORA = ["adapters.kind=lora", "actor.optimizer.lr=0.0005"]
ADAPTER = "open.u-probe"
TEMPERATURE = 0.7
TOP_K = 20


class Probe:
    def __init__(self, wish: str, overrides: list[str], seed: int):
        self.config = load_config(CONFIG, [*LORA, *overrides])
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_model(self.config.model)
        self.trainer = Trainer(self.model, self.config.actor, self.config.train, self.config.adapters)
        self.trainer.adapters.ensure(ADAPTER)
        self.user = User("Maya", PREFERENCES[wish], seed=seed)
        self.wish_id = self.tokenizer.encode(FIRST_TOKEN[wish], add_special_tokens=False)[0]
        self.baseline = RunningBaseline()
        self.version = 0
        self.template = Template(self.config.judge.teacher.hint_template)

    def ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def messages(self, question: str) -> list[dict]:
        return [{"role": "system", "content": self.user.system}, {"role": "user", "content": question}]

    @torch.no_grad()
    def reply(self, prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
        """The adapter's sampled reply: its ids, and their log-probabilities at the sampling temperature."""
        self.trainer.adapters.activate(ADAPTER)
        torch.manual_seed(seed)
        out = self.model.generate(torch.tensor([prompt]), do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                  max_new_tokens=64, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=self.tokenizer.eos_token_id)
        ids = out.sequences[0, len(prompt):].tolist()
        logps = [float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, ids)]
        return ids, logps

    @torch.no_grad()
    def teacher(self, messages: list[dict], hint: str, reply: list[int]) -> tuple[list[float], list[int], list[float]]:
        """The base told `hint`, on `reply`: its log-probability of each token, and its top k at each position."""
        told = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + self.template.substitute(hint=hint)}]
        prompt = self.ids(told)
        with self.trainer.adapters.disabled() as base:
            logits = base(input_ids=torch.tensor([prompt + reply]), use_cache=False).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
        top = logp.topk(TOP_K, dim=-1)
        return logp.gather(1, torch.tensor(reply).unsqueeze(1)).squeeze(1).tolist(), top.indices.flatten().tolist(), top.values.flatten().tolist()

    def sample(self, i: int, question: str, reply: list[int], logps: list[float], hint: str | None, reward: float) -> Sample:
        messages = self.messages(question)
        prompt = self.ids(messages)
        turn = Turn(id=f"t{i}", session_id=f"s{i}", turn_index=0, model=self.config.model, consent=True, messages=messages,
                    response={"role": "assistant", "content": self.tokenizer.decode(reply)}, prompt_ids=prompt,
                    output_ids=reply, output_logprobs=logps, output_versions=[self.version] * len(reply),
                    finish_reason="length", sampling={"temperature": TEMPERATURE, "max_new_tokens": 64}, adapter=ADAPTER)
        trajectory = Trajectory(id=turn.session_id, session_id=turn.session_id, segments=stitch([turn]), turns=[turn],
                                close_reason="feedback", consent=True, adapter=ADAPTER)
        sample = Sample(id=turn.session_id, trajectory=trajectory, reward=reward, turn_rewards=[reward], judge="probe",
                        consent=True)
        if hint is not None:
            n_prompt = len(prompt)
            scored, top_ids, top_logps = self.teacher(messages, hint, reply)
            sample.teacher_logprobs = [Float64s.coerce([math.nan] * n_prompt + scored)]
            sample.teacher_top_k = TOP_K
            sample.teacher_top_ids = [Int32s.coerce([-1] * (n_prompt * TOP_K) + top_ids)]
            sample.teacher_top_logprobs = [Float64s.coerce([math.nan] * (n_prompt * TOP_K) + top_logps)]
        return sample

    def correct(self, i: int, replies: int) -> dict:
        """Correction `i`: `replies` first replies to the person's question `i`, their reactions, one step."""
        question = self.user.question(i)
        prompt = self.ids(self.messages(question))
        samples, met = [], []
        for j in range(replies):
            ids, logps = self.reply(prompt, seed=1000 * i + j)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            ok = self.user.satisfied(text, question)
            said, _ = self.user.react(text, i)
            met.append(ok)
            samples.append(self.sample(100 * i + j, question, ids, logps, None if ok else said, 1.0 if ok else -1.0))
        group = Group(f"q{i}", len(samples), 0.0, 0.0, {s.id: Member(s, []) for s in samples})
        batch = StepBatch([group], self.config, self.baseline, pad_id=self.tokenizer.pad_token_id or 0)
        metrics = self.trainer.step(batch.minibatches, version={ADAPTER: self.version})
        self.version += 1
        return {"met": met, "kl_to_teacher": metrics.get("opd_topk_kl"), "grad_norm": metrics.get("grad_norm")}

    @torch.no_grad()
    def first_token(self, questions: list[str]) -> float:
        """Mean over `questions` of the adapter's probability (at temperature 1) of starting with the wish's token."""
        self.trainer.adapters.activate(ADAPTER)
        values = []
        for question in questions:
            logits = self.model(input_ids=torch.tensor([self.ids(self.messages(question))]), use_cache=False).logits[0, -1]
            values.append(float(torch.softmax(logits.float(), -1)[self.wish_id]))
        return fmean(values)

    def replies_meet(self, questions: list[str], per: int) -> dict:
        met, answered = [], []
        for q, question in enumerate(questions):
            for j in range(per):
                ids, _ = self.reply(self.ids(self.messages(question)), seed=7_000_000 + 10 * q + j)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                met.append(self.user.preference.rule(text, self.user.name))
                answered.append(answers(question, text))
        return {"wish": fmean(met), "answers": fmean(answered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wish", choices=sorted(FIRST_TOKEN), default="steps")
    parser.add_argument("--corrections", type=int, default=12)
    parser.add_argument("--replies", type=int, default=1, help="first replies to each corrected question, one step")
    parser.add_argument("--questions", type=int, default=8, help="held-out questions measured")
    parser.add_argument("--per-question", type=int, default=2, help="sampled replies per held-out question, start and end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    probe = Probe(args.wish, args.overrides, args.seed)
    held_out = list(HELD_OUT_QUESTIONS[:args.questions])
    started = time.monotonic()
    curve = [probe.first_token(held_out)]
    before = probe.replies_meet(held_out, args.per_question)
    steps = []
    for i in range(args.corrections):
        steps.append(probe.correct(i, args.replies))
        curve.append(probe.first_token(held_out))
        print(f"correction {i + 1}: met {sum(steps[-1]['met'])}/{args.replies}, P(first token {FIRST_TOKEN[args.wish]!r}) "
              f"{curve[-1]:.4f} ({time.monotonic() - started:.0f} s)", flush=True)
    after = probe.replies_meet(held_out, args.per_question)
    print(f"held-out replies meeting the wish {before['wish']:.2f} -> {after['wish']:.2f}, "
          f"answering {before['answers']:.2f} -> {after['answers']:.2f}")
    path = RESULTS / f"hint_update_{args.wish}.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs.append({"commit": START_COMMIT, "args": vars(args), "first_token": curve, "before": before, "after": after,
                 "steps": steps, "seconds": round(time.monotonic() - started)})
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bench": "bench/hint_update.py", "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
