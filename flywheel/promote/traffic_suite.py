"""The gate's regression suite from recorded traffic (`promotion.gate.suites[].source: traffic`).

**Items.** Read from the TRAFFIC stream's newest `window` messages when an evaluation is about
to start (`Bus.recent`): each recorded session's newest main turn whose prompt has at most
`max_prompt_tokens` tokens (side turns, such as judges' requests, never), its exact prompt ids;
of those, the `items` newest distinct prompts, one per session. Nothing is kept between
evaluations: the stream is the durable record of the traffic (kept 7 days), so a promoter that
restarts draws from the same traffic, and memory is bounded by the window. With fewer than
`min_items` prompts the suite is not ready: the gate waits (the candidate stays a candidate) and
tries again as traffic comes.

**Scores.** Both versions answer each prompt on the evaluation server (the gate's temperature,
greedy by default). The pinned judge (`judge.llm.base_url`, else the judge's own server in
`run_dir/judge.url`; `deploy` starts it when a traffic suite is configured) is asked which reply
is better for that conversation, twice, once with each reply first, each request fenced with a
fresh nonce (`flywheel/judge_client/fence.py`) and greedy. An item's score is the mean of the two verdicts for
the candidate (+1 its reply better, −1 the serving version's, 0 a tie or an unreadable verdict),
so a judge that always prefers the first reply scores every item 0. Two identical replies are a
tie without asking. The suite passes when the lower confidence bound of the mean score is above
−`margin` and at most `max_invalid` of the verdicts were unreadable. A judge that cannot be
reached fails the evaluation, which is retried.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from flywheel.bus import TURN_SUBJECT, Bus, Turn, addresses
from flywheel.bus.addresses import read_address
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.config.promotion import SuiteConfig
from flywheel.judge_client.endpoint import JudgeEndpoint
from flywheel.judge_client.fence import Fence, clip
from flywheel.promote.suites import Answer, lower_bound

PAIRWISE_SYSTEM = (
    "You compare two replies an AI assistant could give at the same point of a conversation, and decide "
    "which one is better for the user there: correct, helpful, following the instructions and the "
    "conversation's format, honest and safe. A longer reply is not better for being longer, and the order "
    "the replies are shown in means nothing. If neither is better, it is a tie. Think briefly, then end "
    "with a line `Verdict: A`, `Verdict: B` or `Verdict: tie`."
)
PAIRWISE_USER = (
    "The conversation so far, as the assistant saw it:\n{conversation}\n\n"
    "Reply A:\n{reply_a}\n\nReply B:\n{reply_b}\n\n"
    "Which reply is better at this point of the conversation? End with `Verdict: A`, `Verdict: B` or `Verdict: tie`."
)
_VERDICT = re.compile(r"\bverdict\W*(a|b|tie)\b", re.IGNORECASE)
PREFERENCE = {"a": 1, "b": -1, "tie": 0, None: 0}
"""A verdict as a preference for reply A; an unreadable one (None) counts as a tie."""


def read_verdict(reply: str) -> str | None:
    """`a`, `b` or `tie`: the judge's last `Verdict:` line; None when it gave none."""
    found = _VERDICT.findall(reply or "")
    return found[-1].lower() if found else None


@dataclass
class Item:
    session_id: str
    seq: int
    """Its turn's sequence in the TRAFFIC stream."""
    prompt_ids: list[int]


async def recorded_items(bus: Bus, config: SuiteConfig) -> tuple[list[Item], int]:
    """The newest `config.items` distinct prompts of recorded sessions (newest first), and how
    many main turns were left out for prompts longer than `max_prompt_tokens`."""
    latest: dict[str, tuple[Item, bytes]] = {}
    too_long = 0
    async for seq, turn in bus.recent(TURN_SUBJECT, config.window):
        assert isinstance(turn, Turn)
        if turn.turn_type != "main" or not turn.prompt_ids:
            continue
        if len(turn.prompt_ids) > config.max_prompt_tokens:
            too_long += 1
            continue
        latest[turn.session_id] = Item(turn.session_id, seq, turn.prompt_ids.tolist()), turn.prompt_ids.tobytes()
    items: list[Item] = []
    seen: set[bytes] = set()
    for item, key in sorted(latest.values(), key=lambda pair: -pair[0].seq):
        if key not in seen and len(items) < config.items:
            seen.add(key)
            items.append(item)
    return items, too_long


def pinned_judge(config: FlywheelConfig) -> JudgeEndpoint:
    """The judge a traffic suite asks (greedy), and where it is; a config error when there is none."""
    llm = config.judge.llm
    base_url = llm.base_url
    if base_url is None:
        try:
            base_url = read_address(config.run_dir, addresses.JUDGE) + "/v1"
        except FileNotFoundError:
            raise ConfigError(
                "judge.llm.base_url: a traffic suite (promotion.gate.suites) needs the pinned judge: set judge.llm.base_url, "
                f"or run the judge's own server (serve.role: judge; deploy starts it) so that it writes {config.run_dir}/judge.url"
            ) from None
    return JudgeEndpoint(llm.model_copy(update={"temperature": 0.0}), base_url, llm.resolved_api_key(), llm.model or config.served_model)


class TrafficSuite:
    def __init__(self, config: SuiteConfig, tokenizer: Any, bus: Bus, judge: JudgeEndpoint, max_field_chars: int):
        self.config = config
        self.tokenizer = tokenizer
        self.bus = bus
        self.judge = judge
        self.max_field_chars = max_field_chars
        self.items: list[Item] = []
        self.prompts: list[list[int]] = []

    async def prepare(self) -> str | None:
        self.items, too_long = await recorded_items(self.bus, self.config)
        self.prompts = [item.prompt_ids for item in self.items]
        if len(self.items) >= self.config.min_items:
            return None
        left_out = f"; {too_long} longer than max_prompt_tokens left out" if too_long else ""
        return (f"{len(self.items)} of the {self.config.min_items} recorded prompts it needs in the newest "
                f"{self.config.window} messages of TRAFFIC{left_out}")

    async def _ask(self, item: Item, conversation: str, reply_a: str, reply_b: str) -> str | None:
        fence = Fence()
        texts = {"conversation": conversation, "reply_a": reply_a, "reply_b": reply_b}
        user = PAIRWISE_USER.format(**{name: fence.wrap(name, clip(text, self.max_field_chars)) for name, text in texts.items()})
        messages = [{"role": "system", "content": f"{PAIRWISE_SYSTEM}\n\n{fence.notice()}"}, {"role": "user", "content": user}]
        return read_verdict(await self.judge.complete(messages, session_id=f"gate/{self.config.name}/{item.session_id}"))

    async def _item(self, item: Item, candidate: Answer, serving: Answer) -> tuple[float, list[str | None]]:
        """The item's score for the candidate, and the verdicts it took (none for identical replies)."""
        if candidate.text == serving.text:
            return 0.0, []
        conversation = self.tokenizer.decode(item.prompt_ids)
        first, second = await asyncio.gather(self._ask(item, conversation, candidate.text, serving.text),
                                             self._ask(item, conversation, serving.text, candidate.text))
        return (PREFERENCE[first] - PREFERENCE[second]) / 2, [first, second]

    async def compare(self, candidate: list[Answer], serving: list[Answer],
                      confidence: float) -> tuple[dict[str, Any], str | None]:
        judged = await asyncio.gather(*(self._item(i, c, s) for i, c, s in zip(self.items, candidate, serving)))
        scores = [score for score, _ in judged]
        verdicts = [v for _, vs in judged for v in vs]
        wins, losses = sum(s > 0 for s in scores), sum(s < 0 for s in scores)
        invalid = verdicts.count(None)
        bound = lower_bound(scores, confidence)
        report = {"source": "traffic", "judge": f"{self.judge.model} at {self.judge.base_url}", "items": len(scores),
                  "identical": sum(not vs for _, vs in judged), "wins": wins, "losses": losses,
                  "ties": len(scores) - wins - losses, "judge_calls": len(verdicts), "invalid": invalid,
                  "score": fmean(scores),
                  "lower_bound": bound, "sessions": [item.session_id for item in self.items]}
        why = None
        if verdicts and invalid / len(verdicts) > self.config.max_invalid:
            why = (f"{invalid} of the judge's {len(verdicts)} verdicts unreadable (more than {self.config.max_invalid:.0%}): "
                   "no evidence either way")
        elif bound <= -self.config.margin:
            why = (f"the judge preferred the candidate's reply on {wins} of {len(scores)} recorded prompts and the serving "
                   f"version's on {losses}; lower bound of the mean preference {bound:+.3f} at {confidence:.0%} "
                   f"≤ −{self.config.margin}")
        report["passed"] = why is None
        return report, why
