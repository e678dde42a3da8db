"""Issue 45: does the teacher *recognise* what a person wants, even where it does not write it?

The hint teacher (the base model told a person's correction) writes what that person wants no
more often than the base does (`bench/personal_agent.py --probe-hints`). Practice, learning from
several replies to a corrected prompt judged against the hint, needs less: that among replies the
policy writes, the teacher finds the ones that meet the preference likelier. This measures that.

For each person: `--questions` training questions x `--samples` replies sampled from the base
(the app's system message, temperature and max_tokens, seeded; with `--mixed`, half of them
told the drill's own correction of that preference, so that replies which meet a preference the
base rarely meets are there to be ranked: pairs are compared only between replies of the same
writer, so a teacher that merely prefers one writer's style scores nothing for it), each
labelled by the person's own rule (meets the preference and answers the question); each reply scored by the teacher told
one of the person's corrections against the base untold: the summed log-ratio over the reply's
tokens, log p(reply | request + hint) - log p(reply | request), the signal distillation adds to
the advantage (unclipped), and that sum over the reply's length (`mean`: a short reply's sum is
small whatever the teacher thinks of it). Reported per person (means over the corrections told):

- `pairs`: of the (meets, misses) pairs of replies to the same question (by the same writer), the share where the
  reply that meets it scores higher (ties count half; 0.5 is chance): what a practice group's
  advantage would get right; by the sum and by the mean;
- `auc`: the same over all replies of a writer pooled, by the sum;
- `rate` and `meets`: the share and number of the replies ranked that meet the preference.

People: the drill's own (each preference's first specific correction) and, with `--people`, a
helper's file of people nobody here wrote (their words are used, never shown).

    .venv/bin/python bench/hint_ranking.py --people bench/data/people_heldout.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.personal_eval import sample, told  # noqa: E402
from flywheel.drills.personal_agent import prompt_ids  # noqa: E402
from flywheel.drills.simulated_people import NAMES, PREFERENCES, TRAIN_QUESTIONS, User, people_from  # noqa: E402

HEADERS = ["person", "hints", "rate", "meets", "pairs (sum)", "pairs (mean)", "auc (sum)"]
COLUMNS = ["person", "hints", "rate", "meets", "pairs", "pairs_mean", "auc"]


def reply_logprobs(model, prompts: list[list[int]], replies: list[list[int]], batch: int = 16) -> list[float]:
    """log p(reply | prompt) summed over each reply's tokens."""
    import torch

    sums = []
    for start in range(0, len(prompts), batch):
        rows = [p + r for p, r in zip(prompts[start:start + batch], replies[start:start + batch])]
        width = max(map(len, rows))
        ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        with torch.no_grad():
            logprobs = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        for i, (prompt, reply) in enumerate(zip(prompts[start:start + batch], replies[start:start + batch])):
            at = torch.arange(len(prompt) - 1, len(prompt) + len(reply) - 1)
            sums.append(logprobs[i, at, torch.tensor(reply)].sum().item())
    return sums


def ranking(scores: list[float], meets: list[bool], groups: list[tuple], writers: list[int]) -> tuple[float | None, float | None]:
    """(pair accuracy within each group, pooled AUC within each writer); None where no pair exists."""
    def accuracy(within: list) -> float | None:
        pairs = [(a, b) for key in set(within) for a, m, k in zip(scores, meets, within) if k == key and m
                 for b, n, j in zip(scores, meets, within) if j == key and not n]
        return fmean(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) if pairs else None

    return accuracy(groups), accuracy(writers)


def people(args) -> list[tuple[str, User, list[str]]]:
    """(who, the person, the corrections the teacher is told in turn)."""
    found = []
    for pref in args.prefs:
        user = User(NAMES[0], PREFERENCES[pref], seed=0)
        found.append((f"{pref} (drill)", user, [PREFERENCES[pref].specific[0].format(name=user.name)]))
    if args.people:
        for key, (name, preference, voice) in people_from(args.people).items():
            if preference.kind in args.prefs:
                user = User(name, preference, seed=0, voice=voice)
                found.append((key, user, user.rng.sample(voice.corrections, min(args.corrections, len(voice.corrections)))))
    return found


def measure(model, tokenizer, who: str, user: User, hints: list[str], args) -> dict:
    questions = [q for q in TRAIN_QUESTIONS[:args.questions] for _ in range(args.samples)]
    chats = [[{"role": "system", "content": user.system}, {"role": "user", "content": q}] for q in questions]
    drill = user.preference.specific[0].format(name=user.name)
    writers = [int(args.mixed and i % 2 == 1) for i in range(len(chats))]  # 1: told the drill's correction
    replies = asyncio.run(sample(model, tokenizer, [told(c, drill, args) if w else c for c, w in zip(chats, writers)], args))
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in replies]
    meets = [user.satisfied(t, q) for t, q in zip(texts, questions)]
    base = reply_logprobs(model, [prompt_ids(tokenizer, c) for c in chats], replies)
    found: dict[str, list[float]] = {"pairs": [], "pairs_mean": [], "auc": []}
    for hint in hints:
        teacher = reply_logprobs(model, [prompt_ids(tokenizer, told(c, hint, args)) for c in chats], replies)
        ratios = [t - b for t, b in zip(teacher, base)]
        groups = list(zip(questions, writers))
        (same, pooled), (same_mean, _) = (ranking(ratios, meets, groups, writers),
                                          ranking([r / max(len(y), 1) for r, y in zip(ratios, replies)], meets, groups, writers))
        for key, value in (("pairs", same), ("pairs_mean", same_mean), ("auc", pooled)):
            if value is not None:
                found[key].append(value)
    row = {"person": who, "hints": len(hints), "rate": fmean(meets), "meets": sum(meets), "replies": len(meets),
           **{key: fmean(values) if values else None for key, values in found.items()}}
    print(table(HEADERS, [[row[k] for k in COLUMNS]]).splitlines()[-1], flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", help="a helper's file of people (bench/data/people_heldout.json)")
    parser.add_argument("--prefs", nargs="+", default=["brief", "bullets", "name", "formal"])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="replies sampled per question")
    parser.add_argument("--mixed", action="store_true", help="half the replies written told the drill's correction")
    parser.add_argument("--corrections", type=int, default=3, help="with --people: corrections told per person")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="hint_ranking")
    parser.add_argument("overrides", nargs="*", help="config overrides (the teacher's hint template)")
    args = parser.parse_args()
    quiet_logs()
    from flywheel.models import load_model

    model, tokenizer = load_model(args.model)
    model.eval()
    rows = [measure(model, tokenizer, who, user, hints, args) for who, user, hints in people(args)]
    path = write_result(args.name, {"args": vars(args), "machine": machine(None), "rows": rows})
    print(table(HEADERS, [[r[k] for k in COLUMNS] for r in rows]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
