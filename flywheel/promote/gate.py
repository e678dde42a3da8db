"""The gate: a candidate is compared with the serving version on the same items before it serves.

Both versions answer every suite's items on the evaluation server (`serve.role: eval`, beside
serving and training: loading a version there touches no gateway), greedily by default
(`promotion.gate.temperature`). Sampled, item i is drawn with seed i by both versions (common
random numbers): two versions that give an item the same distribution give it the same answer,
so an item's score measures the versions, not the draw. Before an evaluation the suites get their items ready
(`prepare`: a traffic suite reads recent recorded prompts; one short of them makes the gate
wait). One evaluation loads two versions: the candidate first (its suite answers, and one sample
per probe prompt at temperature 1 with its log-probabilities), then the serving version (its
suite answers, and the candidate's samples scored under it in one prefill-only request each).
A version of a LoRA adapter (`VersionEntry.adapter`) is loaded as an adapter instead, the
candidate's and the serving one's under names of their own (`gate.candidate`, `gate.serving`),
and every request names its side's (SGLang's `lora_path`); the adapter's start, version 0, is
the bare base.

- **Suites** (`flywheel/promote/suites.py`): an environment's held-out tasks graded by it (`EnvSuite`), or
  recorded traffic compared pairwise by the pinned judge (`flywheel/promote/traffic_suite.py`). Each item
  gets a score; the candidate passes a suite when the one-sided lower confidence bound of the
  mean score at `gate.confidence` is above −`margin`.
- **Guards** on the probe prompts (the suites' first items): KL(candidate ‖ serving) per token on
  the candidate's own samples (the mean of log π_cand − log π_serv, an unbiased estimate); the
  mean reply length of one over the other's; the share of replies that began a tool call nobody
  can read (`flywheel.formats.tool_calls`), and of empty or length-cut replies, each over the serving
  version's share. Crossing any limit rejects.

The report (each suite's and guard's numbers, the verdict, the reasons) is kept in the registry.
"""

from __future__ import annotations

import asyncio
from statistics import fmean
from typing import Any

import httpx

from flywheel.bus import Bus
from flywheel.config import FlywheelConfig
from flywheel.config.promotion import SuiteConfig
from flywheel.formats.tool_calls import detect
from flywheel.models.adapter_names import GATE_SIDES
from flywheel.promote.suites import Answer, EnvSuite, Suite
from flywheel.promote.traffic_suite import TrafficSuite, pinned_judge
from flywheel.versions.records import VersionEntry


class EvalServer:
    """The evaluation server, over HTTP: load a version, generate, score."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def load(self, path: str, version: int) -> None:
        await self._post("/engine/update_weights_from_disk", {"model_path": path, "weight_version": version})

    async def load_adapter(self, name: str, path: str) -> None:
        await self._post("/engine/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def generate(self, input_ids: list[int], max_new_tokens: int, temperature: float,
                       logprobs: bool = False, seed: int | None = None, lora: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        if seed is not None:
            params["sampling_seed"] = seed
        return await self._post("/engine/generate", {"input_ids": input_ids, "return_logprob": logprobs,
                                                     "sampling_params": params, "lora_path": lora})

    async def prefill_logprobs(self, prompt: list[int], output: list[int], lora: str | None = None) -> list[float]:
        scored = await self._post("/engine/generate", {
            "input_ids": prompt + output, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}, "lora_path": lora,
        })
        return [entry[0] for entry in scored["meta_info"]["input_token_logprobs"][1:]]

    async def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.http.post(route, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"the evaluation server answered {route} with {response.status_code}: {response.text[:300]}")
        return response.json()

    async def close(self) -> None:
        await self.http.aclose()


class Gate:
    def __init__(self, config: FlywheelConfig, tokenizer: Any, server: EvalServer, bus: Bus):
        self.config = config
        self.gate = config.promotion.gate
        self.server = server
        self.tool_format = detect(getattr(tokenizer, "chat_template", None))
        self.judge = pinned_judge(config) if any(s.source == "traffic" for s in self.gate.suites) else None
        self.suites = [self._suite(suite, tokenizer, bus) for suite in self.gate.suites]

    def _suite(self, suite: SuiteConfig, tokenizer: Any, bus: Bus) -> Suite:
        if suite.source == "env":
            return EnvSuite(suite, tokenizer)
        assert self.judge is not None
        return TrafficSuite(suite, tokenizer, bus, self.judge, self.config.judge.llm.max_field_chars)

    async def prepare(self) -> str | None:
        """Get every suite's items ready; why the gate cannot evaluate yet, or None."""
        waiting = [f"{suite.config.name}: {why}" for suite in self.suites if (why := await suite.prepare())]
        return "; ".join(waiting) or None

    async def _answers(self, suite: Suite, lora: str | None) -> list[Answer]:
        limit = suite.config.max_new_tokens
        replies = await asyncio.gather(*(self.server.generate(p, limit, self.gate.temperature, seed=i, lora=lora)
                                         for i, p in enumerate(suite.prompts)))
        return [Answer(r["text"], len(r["output_ids"]), (r["meta_info"].get("finish_reason") or {}).get("type") == "length")
                for r in replies]

    async def _side(self, entry: VersionEntry, lora: str) -> tuple[str | None, list[list[Answer]]]:
        """Load a version (an adapter's under the name `lora`) and answer every suite with it; the
        adapter name its requests give (None: the shared weights, or an adapter's start, the base)."""
        if entry.adapter is None or entry.path is None:
            lora = None
            if entry.adapter is None:
                await self.server.load(entry.path or self.config.model, entry.version)
        else:
            await self.server.load_adapter(lora, entry.path)
        return lora, [await self._answers(suite, lora) for suite in self.suites]

    async def evaluate(self, candidate: VersionEntry, serving: VersionEntry) -> dict[str, Any]:
        """The report of `candidate` against `serving` on the items `prepare` got ready;
        `report["passed"]` is the verdict."""
        limit = self.gate.guards.max_new_tokens
        probes = [prompt for suite in self.suites for prompt in suite.prompts][: self.gate.guards.probe_prompts]
        candidate_side, serving_side = GATE_SIDES
        lora, cand = await self._side(candidate, candidate_side)
        samples = await asyncio.gather(*(self.server.generate(p, limit, 1.0, logprobs=True, lora=lora) for p in probes))
        lora, serv = await self._side(serving, serving_side)
        scored = await asyncio.gather(*(self.server.prefill_logprobs(p, s["output_ids"], lora) for p, s in zip(probes, samples)
                                        if s["output_ids"]))
        own = [[e[0] for e in s["meta_info"]["output_token_logprobs"]] for s in samples if s["output_ids"]]
        report: dict[str, Any] = {"candidate": candidate.version, "serving": serving.version, "suites": {}, "guards": {}}
        reasons = []
        for suite, mine, theirs in zip(self.suites, cand, serv):
            report["suites"][suite.config.name], why = await suite.compare(mine, theirs, self.gate.confidence)
            if why is not None:
                reasons.append(f"{suite.config.name}: {why}")
        reasons += self._guards(report["guards"], cand, serv, own, scored)
        report["passed"] = not reasons
        report["reasons"] = reasons
        return report

    async def close(self) -> None:
        await self.server.close()
        if self.judge is not None:
            await self.judge.close()

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
