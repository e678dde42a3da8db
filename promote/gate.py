"""The gate: a candidate is compared with the serving version on the same items before it serves.

Both versions answer every suite's items on the evaluation server (`serve.role: eval`, beside
serving and training: loading a version there touches no gateway), greedily by default
(`promotion.gate.temperature`). One evaluation loads two versions: the candidate first (its suite
answers, and one sample per probe prompt at temperature 1 with its log-probabilities), then the
serving version (its suite answers, and the candidate's samples scored under it in one
prefill-only request each).

- **Suites.** An `env` suite's items are the environment's held-out tasks (`held_out(n)`; an
  environment without one: `n` tasks from a fixed seed, never the rollout's), each reply graded
  by the environment. The candidate passes a suite when the one-sided lower confidence bound of
  the mean paired difference (candidate − serving) at `gate.confidence` is above −`margin`.
- **Guards** on the probe prompts (the suites' first items): KL(candidate ‖ serving) per token on
  the candidate's own samples (the mean of log π_cand − log π_serv, an unbiased estimate); the
  mean reply length of one over the other's; the share of replies that began a tool call nobody
  can read (`models.tool_formats`), and of empty or length-cut replies, each over the serving
  version's share. Crossing any limit rejects.

The report (each suite's and guard's numbers, the verdict, the reasons) is kept in the registry.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev
from typing import Any

import httpx

from bus.versions import VersionEntry
from config import FlywheelConfig
from config.promotion import SuiteConfig
from envs import Env, Task, make_env
from models.tool_formats import detect

HELD_OUT_SEED = 7919
"""Where tasks are drawn for an environment without a held-out set (not the rollout's seed)."""


@dataclass
class Answer:
    text: str
    tokens: int
    cut: bool


@dataclass
class Suite:
    config: SuiteConfig
    env: Env
    tasks: list[Task]
    prompts: list[list[int]]


class EvalServer:
    """The evaluation server, over HTTP: load a version, generate, score."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def load(self, path: str, version: int) -> None:
        await self._post("/engine/update_weights_from_disk", {"model_path": path, "weight_version": version})

    async def generate(self, input_ids: list[int], max_new_tokens: int, temperature: float,
                       logprobs: bool = False) -> dict[str, Any]:
        return await self._post("/engine/generate", {
            "input_ids": input_ids, "return_logprob": logprobs,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
        })

    async def prefill_logprobs(self, prompt: list[int], output: list[int]) -> list[float]:
        scored = await self._post("/engine/generate", {
            "input_ids": prompt + output, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        })
        return [entry[0] for entry in scored["meta_info"]["input_token_logprobs"][1:]]

    async def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.http.post(route, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"the evaluation server answered {route} with {response.status_code}: {response.text[:300]}")
        return response.json()

    async def close(self) -> None:
        await self.http.aclose()


def lower_bound(differences: list[float], confidence: float) -> float:
    """One-sided lower confidence bound of the mean of paired differences (normal approximation)."""
    if len(differences) < 2:
        return -math.inf
    return fmean(differences) - NormalDist().inv_cdf(confidence) * stdev(differences) / math.sqrt(len(differences))


class Gate:
    def __init__(self, config: FlywheelConfig, tokenizer: Any, server: EvalServer):
        self.config = config
        self.gate = config.promotion.gate
        self.tokenizer = tokenizer
        self.server = server
        self.tool_format = detect(getattr(tokenizer, "chat_template", None))
        self.suites = [self._suite(s) for s in self.gate.suites]
        self.probes = [prompt for suite in self.suites for prompt in suite.prompts][: self.gate.guards.probe_prompts]

    def _suite(self, suite: SuiteConfig) -> Suite:
        env = make_env(suite.env, suite.env_args)
        held_out = getattr(env, "held_out", None)
        if held_out is not None:
            tasks = held_out(suite.items)
        else:
            rng = random.Random(HELD_OUT_SEED)
            tasks = [env.reset(rng) for _ in range(suite.items)]
        texts = [self.tokenizer.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=False) for t in tasks]
        return Suite(suite, env, tasks, [self.tokenizer.encode(text, add_special_tokens=False) for text in texts])

    async def _answers(self, suite: Suite) -> list[Answer]:
        limit = suite.config.max_new_tokens
        replies = await asyncio.gather(*(self.server.generate(p, limit, self.gate.temperature) for p in suite.prompts))
        return [Answer(r["text"], len(r["output_ids"]), (r["meta_info"].get("finish_reason") or {}).get("type") == "length")
                for r in replies]

    async def _grades(self, suite: Suite, answers: list[Answer]) -> list[float]:
        def grade(task: Task, reply: str) -> float:
            episode = suite.env.open(task)
            try:
                episode.step(reply)
                return episode.finish().reward
            finally:
                episode.close()

        return list(await asyncio.gather(*(asyncio.to_thread(grade, t, a.text) for t, a in zip(suite.tasks, answers))))

    async def _side(self, entry: VersionEntry) -> dict[str, Any]:
        """Load a version and answer every suite with it."""
        await self.server.load(entry.path or self.config.model, entry.version)
        answers = [await self._answers(suite) for suite in self.suites]
        grades = [await self._grades(suite, a) for suite, a in zip(self.suites, answers)]
        return {"answers": answers, "grades": grades}

    async def evaluate(self, candidate: VersionEntry, serving: VersionEntry) -> dict[str, Any]:
        """The report of `candidate` against `serving`; `report["passed"]` is the verdict."""
        limit = self.gate.guards.max_new_tokens
        cand = await self._side(candidate)
        samples = await asyncio.gather(*(self.server.generate(p, limit, 1.0, logprobs=True) for p in self.probes))
        serv = await self._side(serving)
        scored = await asyncio.gather(*(self.server.prefill_logprobs(p, s["output_ids"]) for p, s in zip(self.probes, samples)
                                        if s["output_ids"]))
        own = [[e[0] for e in s["meta_info"]["output_token_logprobs"]] for s in samples if s["output_ids"]]
        report: dict[str, Any] = {"candidate": candidate.version, "serving": serving.version, "suites": {}, "guards": {}}
        reasons = []
        for suite, cg, sg in zip(self.suites, cand["grades"], serv["grades"]):
            differences = [c - s for c, s in zip(cg, sg)]
            bound = lower_bound(differences, self.gate.confidence)
            passed = bound > -suite.config.margin
            report["suites"][suite.config.name] = {"items": len(differences), "candidate": fmean(cg), "serving": fmean(sg),
                                                   "difference": fmean(differences), "lower_bound": bound, "passed": passed}
            if not passed:
                reasons.append(f"{suite.config.name}: {fmean(cg):.3f} vs {fmean(sg):.3f}, lower bound of the difference "
                               f"{bound:+.3f} at {self.gate.confidence:.0%} ≤ −{suite.config.margin}")
        reasons += self._guards(report["guards"], cand["answers"], serv["answers"], own, scored)
        report["passed"] = not reasons
        report["reasons"] = reasons
        return report

    def _guards(self, out: dict[str, Any], cand: list[list[Answer]], serv: list[list[Answer]],
                own: list[list[float]], scored: list[list[float]]) -> list[str]:
        guards = self.gate.guards
        reasons = []
        pairs = [(lp, sp) for o, s in zip(own, scored) for lp, sp in zip(o, s)]
        out["kl"] = fmean(lp - sp for lp, sp in pairs) if pairs else 0.0
        if out["kl"] > guards.max_kl:
            reasons.append(f"KL(candidate ‖ serving) {out['kl']:.3f} nats per token > {guards.max_kl}")
        mine, theirs = [a for s in cand for a in s], [a for s in serv for a in s]
        lengths = fmean(a.tokens for a in mine) or 0.0, fmean(a.tokens for a in theirs) or 0.0
        out["length_ratio"] = max(lengths) / max(min(lengths), 1e-9) if max(lengths) else 1.0
        if out["length_ratio"] > guards.max_length_ratio:
            reasons.append(f"replies {lengths[0]:.1f} vs {lengths[1]:.1f} tokens: ratio {out['length_ratio']:.2f} > {guards.max_length_ratio}")
        for name, bad, limit in (("malformed_tool_calls", lambda a: self.tool_format.malformed(a.text), guards.max_malformed_tool_calls),
                                 ("empty_or_cut", lambda a: a.cut or not a.text.strip(), guards.max_empty_or_cut)):
            shares = fmean(map(bad, mine)), fmean(map(bad, theirs))
            out[name] = {"candidate": shares[0], "serving": shares[1]}
            if shares[0] - shares[1] > limit:
                reasons.append(f"{name.replace('_', ' ')}: {shares[0]:.0%} vs {shares[1]:.0%} (more than {limit:.0%} over)")
        return reasons
