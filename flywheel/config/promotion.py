"""The promotion loop's configuration (`promotion.*`): when a new version may serve.

`mode: off` is the behaviour without a gate: every announced version is swapped into every
engine. `gate`: a version serves only after the evaluation gate found it no worse than the
serving one. `canary`: after the gate, it serves a share of new sessions until a sequential test
on their online signals promotes it or rolls it back. Part of `flywheel.config.schema.FlywheelConfig`;
see docs/promotion.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from flywheel.config.section import Section

TRAFFIC_ONLY = frozenset({"min_items", "window", "max_prompt_tokens", "max_invalid"})
"""The keys of a suite that only a `source: traffic` suite may set."""


class SuiteConfig(Section):
    """One evaluation suite of the gate: the same items answered by the candidate and by the
    serving version, each pair of answers scored, the scores' lower confidence bound compared
    with −margin.

    `source: env`: the items are an environment's held-out tasks, each reply graded by it (the
    score of an item: candidate's reward − serving's). `source: traffic`: the items are recent
    prompts of recorded sessions, the two replies compared by the pinned judge in both orders
    (the score of an item: the mean of the two verdicts, +1 the candidate's reply better, −1 the
    serving version's, 0 a tie) (docs/promotion.md)."""

    name: str
    source: Literal["env", "traffic"] = "env"
    env: str | None = None
    """`source: env`: the environment whose held-out tasks are the items (`arithmetic`, `digits`,
    `humaneval`, ..., as `rollout.env` names them), each reply graded by it."""
    env_args: dict = Field(default_factory=dict)
    items: int = Field(32, ge=2)
    """How many items the suite has: held-out tasks, or recorded prompts (at most this many)."""
    max_new_tokens: int = Field(128, ge=1)
    margin: float = Field(0.1, ge=0)
    """The candidate fails when, with `gate.confidence`, the mean item score is below −margin:
    its mean reward below the serving version's by more than this (env), or the judge's mean
    preference against it beyond this (traffic, on [−1, 1])."""
    min_items: int = Field(8, ge=2)
    """`source: traffic`: with fewer recorded prompts than this the gate waits (the candidate stays
    a candidate, the reason shown in its entry) and evaluates once traffic has brought them."""
    window: int = Field(4096, ge=1)
    """`source: traffic`: how many of the TRAFFIC stream's newest messages the prompts are drawn from."""
    max_prompt_tokens: int = Field(2048, ge=1)
    """`source: traffic`: longer prompts are left out (a session's earlier turn may serve instead)."""
    max_invalid: float = Field(0.5, ge=0, le=1)
    """`source: traffic`: the share of the judge's verdicts that may be unreadable (each counts as a
    tie); above it the suite fails: a judge that does not answer is no evidence either way."""

    @model_validator(mode="after")
    def _fields_of_its_source(self) -> "SuiteConfig":
        # Compared with the defaults, not `model_fields_set`: a configuration passed on as a dump
        # (deploy hands every loop one) sets every field.
        fields = type(self).model_fields
        changed = {name for name in ("env", "env_args", *TRAFFIC_ONLY)
                   if getattr(self, name) != fields[name].get_default(call_default_factory=True)}
        if self.source == "env" and self.env is None:
            raise ValueError("env: an env suite needs the environment whose held-out tasks it answers (or source: traffic)")
        if self.source == "env" and changed & TRAFFIC_ONLY:
            raise ValueError(f"{', '.join(sorted(changed & TRAFFIC_ONLY))}: only for source: traffic")
        if self.source == "traffic" and changed & {"env", "env_args"}:
            raise ValueError("env: a traffic suite's items are recorded prompts, not an environment's tasks")
        if self.source == "traffic" and self.min_items > self.items:
            raise ValueError(f"min_items: {self.min_items} is more than items ({self.items}); set min_items to at most items")
        return self


class GuardsConfig(Section):
    """Limits on how the candidate's replies to the probe prompts may differ from the serving
    version's; crossing any rejects it."""

    probe_prompts: int = Field(16, ge=1)
    """Prompts taken from the suites' items to probe with."""
    max_new_tokens: int = Field(64, ge=1)
    max_kl: float = Field(1.0, gt=0)
    """KL(candidate ‖ serving) per token on the candidate's own replies, in nats."""
    max_length_ratio: float = Field(2.0, gt=1)
    """Mean reply length of the candidate over the serving version's (and its inverse) at most this."""
    max_malformed_tool_calls: float = Field(0.1, ge=0, le=1)
    """Share of the replies that began a tool call it could not read, above the serving version's share."""
    max_empty_or_cut: float = Field(0.2, ge=0, le=1)
    """Share of empty replies or replies cut at the length limit, above the serving version's share."""


class GateConfig(Section):
    suites: list[SuiteConfig] = Field(default_factory=list)
    """At least one when `promotion.mode` is not off."""
    guards: GuardsConfig = GuardsConfig()
    confidence: float = Field(0.9, gt=0.5, lt=1)
    """One-sided confidence of a suite's verdict: a candidate passes a suite when the lower bound of
    (candidate − serving) at this confidence is above −margin."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the gate's answers (0: greedy). Above 0, item i is sampled with seed i
    by both versions, so an item whose distribution a version left alone gets the same answer."""
    timeout_s: float = Field(900.0, gt=0)
    """An evaluation that takes longer is abandoned and retried (the candidate stays a candidate)."""


class CanaryConfig(Section):
    share: float = Field(0.1, gt=0, lt=1)
    """Share of new sessions that go to the canary (sticky: a session stays on its version)."""
    delta: float = Field(0.1, gt=0)
    """The harm the sequential test is built to tell apart: a canary whose mean online reward is
    below the serving version's by `delta` should be rolled back, one that is not below should be promoted."""
    alpha: float = Field(0.05, gt=0, lt=0.5)
    """Probability of promoting a canary that is `delta` worse (the test's bound, checked by simulation)."""
    beta: float = Field(0.1, gt=0, lt=0.5)
    """Probability of rolling back a canary that is no worse."""
    min_sessions: int = Field(8, ge=2)
    """Judged sessions each arm needs before the test may decide."""
    max_sessions: int = Field(400, ge=4)
    """Canary sessions after which the test must decide: promote if the estimate is nearer no harm than `delta`."""
    variance_floor: float = Field(0.01, gt=0)
    """Lower bound on each arm's reward variance in the test (a few identical rewards would otherwise
    claim certainty)."""
    max_error_rate_increase: float = Field(0.1, ge=0, le=1)
    """Roll back at once when the canary's turns fail (aborted, errors) this much more often than
    the serving version's, once each arm has `min_sessions` worth of turns."""
    max_latency_ratio: float | None = Field(None, gt=1)
    """Roll back at once when the canary's median time per output token exceeds the serving
    version's by this factor (None: not checked). Versions of one architecture decode at the
    same speed on the same hardware, so a difference says where the canary runs (a second
    embedded engine shares the gateway's process and cores: 2.2x slower in the drill); set it
    when canary engines are like the serving ones, to catch what a version does to them."""
    max_minutes: float | None = Field(None, gt=0)
    """Roll back a canary still undecided after this long (None: wait for `max_sessions`)."""
    engine_urls: list[str] = Field(default_factory=list)
    """External engines for the canary (needed when `serve.engine_urls` are external); empty: a
    second embedded engine in the gateway's process, created when the first canary starts."""

    @model_validator(mode="after")
    def _room_to_decide(self) -> "CanaryConfig":
        if self.max_sessions < self.min_sessions:
            raise ValueError("promotion.canary.max_sessions must be at least promotion.canary.min_sessions")
        return self


class PromotionConfig(Section):
    mode: Literal["off", "gate", "canary"] = "off"
    """`off`: every announced version serves at once (no registry, no promotion loop); `gate`: a
    version serves once the gate passes it; `canary`: the gate, then a canary of new sessions and
    a sequential test."""
    gate: GateConfig = GateConfig()
    canary: CanaryConfig = CanaryConfig()
    continue_from: Literal["last_good", "latest"] = "last_good"
    """What the trainer continues from after a version is rejected or rolled back: the weights of
    the last good version (serving, or retired after serving) with a fresh optimizer, or its own
    latest weights (the verdict then only decides what serves)."""
    eval_torch_threads: int = Field(1, ge=1)
    """Threads of the evaluation server's engine (it runs beside serving and training)."""
    eval_url: str | None = None
    """The evaluation server (`serve.role: eval`) the gate uses; `deploy` starts one and sets it."""

    @field_validator("mode", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: object) -> object:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @model_validator(mode="after")
    def _something_to_compare_on(self) -> "PromotionConfig":
        if self.enabled and not self.gate.suites:
            raise ValueError("promotion.gate.suites: the gate needs at least one suite (e.g. {name: heldout, env: arithmetic})")
        return self
