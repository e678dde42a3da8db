"""Building the configured judge (`judge.kind`) from the configuration.

`rule`, `llm`, `model`, `next_state` and `composite` (whose components are built the same way,
each from its own sub-config or the top-level `judge.llm` / `judge.model`; `next_state` from
`judge.next_state`). An `llm` judge without `base_url` talks to this deployment's serve loop (the
URL in `run_dir/serve.url`), and without `model` asks for the served model; its API key is
`api_key`, else the `api_key_env` variable.
"""

from __future__ import annotations

from pathlib import Path

from flywheel.bus import addresses
from flywheel.bus.addresses import read_address
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.config.judge import CompositeComponentConfig, LLMJudgeConfig
from flywheel.judge.base import Judge
from flywheel.judge.composite import Component, CompositeJudge
from flywheel.judge.llm import LLMJudge
from flywheel.judge.next_state import NextStateJudge
from flywheel.judge.normalize import Normalizer
from flywheel.judge.rule import RuleJudge


def build_judge(config: FlywheelConfig) -> Judge:
    judge = config.judge
    if judge.kind == "composite":
        components = [Component(_build_component(config, c), c.weight, c.required) for c in judge.composite.components]
        normalizer = Normalizer(judge.composite.normalize_warmup) if judge.composite.normalize else None
        return CompositeJudge(components, normalizer)
    return _build_component(config, CompositeComponentConfig(kind=judge.kind))


def _build_component(config: FlywheelConfig, component: CompositeComponentConfig) -> Judge:
    if component.kind == "rule":
        return RuleJudge()
    if component.kind == "llm":
        return _build_llm(config, component.llm or config.judge.llm)
    if component.kind == "next_state":
        return NextStateJudge(config.judge.next_state)
    from flywheel.judge.reward_model import (
        RewardModelJudge,  # imports torch only when asked for
    )

    return RewardModelJudge(component.model or config.judge.model)


def _build_llm(config: FlywheelConfig, llm: LLMJudgeConfig) -> LLMJudge:
    base_url = llm.base_url
    if base_url is None:
        base_url = server_url(config, addresses.JUDGE if llm.source == "pinned" else addresses.SERVE) + "/v1"
    return LLMJudge(llm, base_url, llm.resolved_api_key(), llm.model or config.served_model)


def server_url(config: FlywheelConfig, address: str) -> str:
    """The URL a server of this run wrote to `run_dir` (`judge.url`: the judge's own server, whose
    weights do not move; `serve.url`: the policy's); a config error when there is none."""
    try:
        return read_address(config.run_dir, address)
    except FileNotFoundError:
        who = "judge server (serve.role: judge)" if address == addresses.JUDGE else "serve loop"
        raise ConfigError(f"judge.llm.base_url: not set, and no {who} has written "
                          f"{Path(config.run_dir) / address} (is it running?)") from None
