"""The judge's configuration (`judge.*`): which judge, and the settings of the `llm`, `model`,
`next_state` and `composite` judges. Part of `flywheel.config.schema.FlywheelConfig`; see docs/judges.md."""

from __future__ import annotations

import os
from string import Template
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from flywheel.config.section import Section

JUDGE_SYSTEM_PROMPT = (
    "You are a strict, fair evaluator of an AI assistant's replies. You judge one assistant turn "
    "of a conversation: how correct, helpful and appropriate it is for the task and for what the "
    "assistant was asked at that point. What followed the reply (the user's answer, tool results) "
    "is evidence of whether it worked. Think briefly, then end with a line `Score: N`, where N is "
    "a number from $score_min (worst) to $score_max (best)."
)
JUDGE_USER_PROMPT = (
    "The task:\n$context\n\n"
    "What the assistant was asked at turn $turn_number of $num_turns:\n$request\n\n"
    "The assistant's reply (the turn to judge):\n$response\n\n"
    "What followed the reply:\n$next_state\n\n"
    "Evaluate the reply, then end with `Score: N` ($score_min to $score_max)."
)
NEXT_STATE_SYSTEM_PROMPT = (
    "You judge one reply of an AI assistant by what happened after it: the user's next message, "
    "tool results, test output, feedback about the reply. Score 1 when what followed shows the reply "
    "worked (the user accepts it, thanks, or moves on to something new; a tool ran cleanly; tests "
    "pass), -1 when it shows the reply failed (the user corrects it, complains, asks again or "
    "rephrases the same request; an error; tests fail), 0 when it is unclear. Judge by what followed, "
    "not by your own taste. Think briefly, then end with a line `Score: N`, N one of -1, 0, 1."
)
NEXT_STATE_USER_PROMPT = (
    "What the assistant was asked:\n$request\n\n"
    "The assistant's reply (the turn to judge):\n$response\n\n"
    "What followed the reply:\n$next_state\n\n"
    "Did what followed show that the reply worked? End with `Score: N` (-1, 0 or 1)."
)
JUDGE_TRUSTED_PLACEHOLDERS = frozenset({"score_min", "score_max", "turn_number", "num_turns"})
"""Placeholders filled by the judge itself: allowed in both prompt templates."""
JUDGE_FENCED_PLACEHOLDERS = frozenset({"context", "request", "response", "next_state"})
"""Placeholders filled with conversation text (agent-controlled), each as a fenced block: only
in the user prompt, never in the system prompt."""


def _template_names(template: str) -> set[str]:
    parsed = Template(template)
    if not parsed.is_valid():
        raise ValueError("malformed placeholder (write $$ for a literal $)")
    return set(parsed.get_identifiers())


class TurnJudgeConfig(Section):
    """Settings shared by judges that score each assistant turn (`llm`, `model`)."""

    outcome: Literal["mean", "last", "min"] = "mean"
    """How the trajectory's outcome reward follows from its turn rewards."""


class LLMJudgeConfig(TurnJudgeConfig):
    """An LLM as judge behind any OpenAI-compatible endpoint (see docs/judges.md)."""

    mode: Literal["next_state", "score"] = "next_state"
    """`next_state` (default, OpenClaw-RL's process reward): each turn judged from what followed
    it in its own conversation (and feedback about it), votes of -1, 0 or 1, the majority wins and
    a tie is 0; a turn nothing followed is not judged (the session feedback's reward, else left out
    of the loss). `score`: the reply rated on [score_min, score_max], the mean of the votes."""
    source: Literal["pinned", "policy"] = "pinned"
    """Which model judges when `base_url` is not set. `pinned` (default): the judge's own server
    (`run_dir/judge.url`, started by `deploy` with the weights in `judge.weights`), whose weights
    do not move while the policy learns. `policy`: this deployment's serve loop, the policy being
    trained: its scores move as it learns (and a policy grading itself can learn to please
    itself); for comparisons only."""
    base_url: str | None = None
    """Any OpenAI-compatible endpoint's base URL (ending in `/v1`); set, it is the judge."""
    api_key: str | None = None
    """The key sent as `Authorization: Bearer`; None: read from the `api_key_env` variable."""
    api_key_env: str = "FLYWHEEL_JUDGE_API_KEY"
    model: str | None = None
    """The judge model's name at the endpoint; None: this deployment's served model name."""
    system_prompt: str | None = None
    """`string.Template` text; may use $score_min, $score_max, $turn_number, $num_turns. None: the
    mode's (`NEXT_STATE_SYSTEM_PROMPT`, or `JUDGE_SYSTEM_PROMPT` for `score`)."""
    user_prompt: str | None = None
    """`string.Template` text; must use $response, may use $context, $request, $next_state
    (each becomes a fenced block of conversation text) and the system prompt's placeholders.
    None: the mode's."""
    votes: int = Field(3, ge=1)
    """Judge requests per turn (k); the turn's score is the mean of the valid votes."""
    min_valid_votes: int = Field(1, ge=1)
    """A turn with fewer valid votes than this makes the trajectory unscored."""
    temperature: float = Field(0.7, ge=0.0)
    max_tokens: int = Field(256, ge=1)
    score_min: float = 1.0
    score_max: float = 10.0
    """The `score` mode's scale; a score s becomes the reward (s - score_min) / (score_max -
    score_min) in [0, 1]. A vote outside the scale is invalid. (`next_state` votes are -1, 0, 1.)"""
    max_concurrency: int = Field(8, ge=1)
    """Judge requests in flight at once, across all trajectories."""
    max_retries: int = Field(4, ge=0)
    """Retries of a request after a connection error, timeout, 408, 429 or 5xx."""
    retry_backoff_s: float = Field(0.5, gt=0)
    """First pause before a retry; doubled each time (with jitter), up to `retry_backoff_max_s`.
    A `Retry-After` header from the endpoint is honoured up to the same maximum."""
    retry_backoff_max_s: float = Field(8.0, gt=0)
    request_timeout_s: float = Field(60.0, gt=0)
    max_field_chars: int = Field(8000, ge=100)
    """Longest text put into one fenced block; longer text keeps its start and end."""

    @property
    def prompts(self) -> tuple[str, str]:
        """(system, user) templates: the configured ones, else the mode's."""
        system, user = (NEXT_STATE_SYSTEM_PROMPT, NEXT_STATE_USER_PROMPT) if self.mode == "next_state" else (
            JUDGE_SYSTEM_PROMPT, JUDGE_USER_PROMPT)
        return self.system_prompt or system, self.user_prompt or user

    def resolved_api_key(self) -> str:
        """The key to send: `api_key`, else the `api_key_env` variable, else a placeholder."""
        return self.api_key or os.environ.get(self.api_key_env) or "unused"

    @property
    def scale(self) -> tuple[float, float]:
        return (-1.0, 1.0) if self.mode == "next_state" else (self.score_min, self.score_max)

    @field_validator("system_prompt")
    @classmethod
    def _check_system_prompt(cls, template: str | None) -> str | None:
        if template is None:
            return None
        if unknown := _template_names(template) - JUDGE_TRUSTED_PLACEHOLDERS:
            raise ValueError(
                f"placeholder(s) {sorted(unknown)} not allowed here (allowed: "
                f"{sorted(JUDGE_TRUSTED_PLACEHOLDERS)}; conversation text goes in user_prompt)"
            )
        return template

    @field_validator("user_prompt")
    @classmethod
    def _check_user_prompt(cls, template: str | None) -> str | None:
        if template is None:
            return None
        names = _template_names(template)
        if unknown := names - JUDGE_TRUSTED_PLACEHOLDERS - JUDGE_FENCED_PLACEHOLDERS:
            raise ValueError(
                f"unknown placeholder(s) {sorted(unknown)} "
                f"(known: {sorted(JUDGE_TRUSTED_PLACEHOLDERS | JUDGE_FENCED_PLACEHOLDERS)})"
            )
        if "response" not in names:
            raise ValueError("must contain $response (the turn being judged)")
        return template

    @field_validator("min_valid_votes")
    @classmethod
    def _check_min_valid_votes(cls, value: int, info: ValidationInfo) -> int:
        if value > info.data.get("votes", value):
            raise ValueError("cannot exceed votes")
        return value

    @field_validator("score_max")
    @classmethod
    def _check_score_max(cls, value: float, info: ValidationInfo) -> float:
        if value <= info.data.get("score_min", value - 1):
            raise ValueError("must be greater than score_min")
        return value


class RewardModelJudgeConfig(TurnJudgeConfig):
    """A learned reward model: a local HF checkpoint with a scalar head (num_labels=1)."""

    path: str | None = None
    """The checkpoint directory (loads with AutoModelForSequenceClassification and AutoTokenizer)."""
    batch_size: int = Field(8, ge=1)
    """Turns scored in one forward pass."""
    max_length: int = Field(2048, ge=8)
    """Longest input in tokens; a longer conversation keeps its end (the turn being scored)."""
    device: str = "cpu"
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads, set when the judge starts (process-wide: keep 1 beside an engine)."""


class NextStateJudgeConfig(Section):
    """The `next_state` judge: each turn classified from what followed it (no judge model)."""

    reader: Literal["learned", "rules"] = "learned"
    """What reads a user's words: `learned`, a classifier trained on many people's reactions
    (flywheel/judge/reaction_reader.py), the whole of a negative reaction being the hint; `rules`,
    the phrasing rules of flywheel/judge/next_state_rules.py, the hint trimmed to the instruction.
    Pasted tool output and test results are read by rules either way."""

    retry_overlap: float = Field(0.6, gt=0.0, le=1.0)
    """A user message restating the turn's own request is a retry: it shares at least this share
    of the shorter message's content words with the request (and `retry_min_shared` words)."""
    retry_min_shared: int = Field(2, ge=1)


class CompositeComponentConfig(Section):
    """One judge inside a composite (a `next_state` component uses `judge.next_state`)."""

    kind: Literal["rule", "llm", "model", "next_state"]
    weight: float = 1.0
    required: bool = True
    """When false, a trajectory this component cannot score is scored by the others (the
    component is left out of the sum); when true, the whole trajectory is unscored."""
    llm: LLMJudgeConfig | None = None
    """Settings for an `llm` component; None: `judge.llm`."""
    model: RewardModelJudgeConfig | None = None
    """Settings for a `model` component; None: `judge.model`."""


class CompositeJudgeConfig(Section):
    components: list[CompositeComponentConfig] = Field(default_factory=list)
    normalize: bool = False
    """Normalise each component's scores per (task_id, turn index) with a running mean and
    standard deviation before weighting (see docs/judges.md)."""
    normalize_warmup: int = Field(8, ge=2)
    """Scores a key must have seen before they are also divided by its standard deviation;
    until then they are only centred on the running mean."""


class TeacherConfig(Section):
    """Hint distillation (`flywheel/judge/teacher.py`): the pinned model, told a turn's hint, scores the
    tokens the policy sampled in that turn; the trainer moves the policy toward it."""

    enabled: bool | None = None
    """Score hinted turns (feedback text, a correction in the user's words). None: on exactly when
    the judge reads the users' words (`next_state`, `llm`, or a composite with either), off for
    rewards without words (`rule`, `model`). Needs the judge's server (`deploy` starts it);
    without one, samples go out without teacher log-probs."""
    hint_template: str = "\n\n[The user's feedback, how to do better: $hint]"
    """How a hint is appended to the last user message of the turn's request (`string.Template`,
    $hint)."""
    max_hint_chars: int = Field(600, ge=10)
    top_k: int = Field(0, ge=0, le=20)
    """Also send, for each token it scores, the teacher's k likeliest tokens and their
    log-probabilities (SGLang's `input_top_logprobs`): dense distillation toward its whole
    distribution (`actor.opd_topk_coef`), not only the sampled token's. 0: the sampled token's alone."""
    memory: int = Field(0, ge=0, le=32)
    """Hints the judge remembers per person (an end user on the adapter their turns train; a
    tenant's unnamed traffic is one person), told to the teacher on every later turn of theirs as
    well as the turn they were about
    (flywheel/judge/hint_memory.py): one correction teaches every later reply. 0: a hint teaches
    its own turn only."""
    wishes: Literal["words", "beside", "instead"] = "words"
    """What the teacher is told of a correction: `words`, the person's own; `beside`, the
    instruction for the aspect of the reply it asks to change (its length, lists, being named,
    register, ...), read by a learned classifier, then the words; `instead`, the instruction
    alone where one is read (flywheel/judge/wishes.py). A small teacher follows a plain
    instruction more often than a person's words; `instead` drops what the words say beyond the
    aspect (a nickname they want, an exact layout), which `beside` keeps."""
    practice: int = Field(0, ge=0, le=16)
    """Replies to practise on, per corrected turn (a turn judged below zero that got a hint): the
    judge has the person's adapter answer that turn's request this many times more, on the
    policy's server, and the teacher, told the same hint, scores each (flywheel/judge/practice.py);
    they train as one group, rewarded by `practice_reward`. Needs
    adapters (`adapters.kind: lora`). 0: off; else at least 2 (a group of one would be judged
    against the running baseline)."""
    practice_reward: Literal["equal", "checks"] = "equal"
    """The rewards of a practice group: `equal`, the teacher's term alone moves its replies;
    `checks`, where every aspect the person's corrections ask for is one a rule can check (a
    reply's length, lists or prose, register, being named: flywheel/formats/wish_checks.py), the
    rewards rank the replies by how much of it each does, so those that do more are learned past
    what the teacher would write (their RL term at full weight, `actor.rl_coef_hinted`
    notwithstanding), and a reply that does not answer the request (the base model finds it no
    likelier told the request: flywheel/judge/relevance.py) ranks below every one that does,
    whatever the wish; equal where neither tells the replies apart."""

    practice_history: int = Field(0, ge=0, le=8)
    """Earlier requests of the person practised with each corrected turn as well: the judge
    remembers the requests that opened each person's newest conversations (as many as this; the
    exact context of each one's first turn), and a correction has their adapter answer each of them `practice` times too, taught the same
    hint and rewarded as the corrected turn's replies are, each request's replies a group of
    their own: one correction teaches the person's other requests, not only the one it was about.
    Kept and forgotten as the hint memory is (flywheel/judge/people_memory.py). 0: off."""
    practice_prompt: Literal["served", "bare"] = "served"
    """What the practice replies answer: `served`, each request's exact context, with the person's
    instructions where the served memory put them (`memory.enabled`); `bare`, the request as the
    person sent it, without them (rendered again through the chat template, on the policy's
    server): the adapter then learns to do what they ask untold, taught by the teacher told them
    (the memory distilled into the adapter). A request the memory put nothing in goes as served."""

    @field_validator("practice")
    @classmethod
    def _a_group_of_several(cls, value: int) -> int:
        if value == 1:
            raise ValueError("0 (off) or at least 2 replies (they train as one group)")
        return value

    @model_validator(mode="after")
    def _history_is_practised(self) -> "TeacherConfig":
        if self.practice_history and not self.practice:
            raise ValueError("practice_history needs practice (the replies to each remembered request)")
        if self.practice_prompt == "bare" and not self.practice:
            raise ValueError("practice_prompt=bare needs practice (the replies to the bare requests)")
        return self


class JudgeConfig(Section):
    kind: Literal["rule", "llm", "model", "next_state", "composite"] = "rule"
    max_concurrency: int = Field(64, ge=1)
    """Trajectories being judged at once; the loop keeps fetching while they run."""
    deadline_s: float = Field(300.0, gt=0)
    """A trajectory not judged within this time is published as unscored."""
    llm: LLMJudgeConfig = LLMJudgeConfig()
    model: RewardModelJudgeConfig = RewardModelJudgeConfig()
    next_state: NextStateJudgeConfig = NextStateJudgeConfig()
    composite: CompositeJudgeConfig = CompositeJudgeConfig()
    weights: str | None = None
    """The judge's server's weights (`llm.source: pinned`, the teacher): a model name, a model
    directory or a weight-store version (`run_dir/weights/vN`); None: the run's starting model
    (`model`), a frozen copy of the policy as it began."""
    teacher: TeacherConfig = TeacherConfig()

    def needs_server(self, for_teacher: bool = True) -> bool:
        """Whether this judge needs its own server: a pinned `llm` judge, or the teacher (unless
        not `for_teacher`: the policy's server teaches, `FlywheelConfig.base_teaches`)."""
        llms = [self.llm] if self.kind == "llm" else [
            c.llm or self.llm for c in self.composite.components if c.kind == "llm"] if self.kind == "composite" else []
        return (for_teacher and self.teaches()) or any(llm.base_url is None and llm.source == "pinned" for llm in llms)

    def teaches(self) -> bool:
        """Whether the hint teacher runs: `teacher.enabled`, else whether this judge reads words."""
        if self.teacher.enabled is not None:
            return self.teacher.enabled
        kinds = {self.kind, *(c.kind for c in self.composite.components if self.kind == "composite")}
        return bool(kinds & {"next_state", "llm"})

    @model_validator(mode="after")
    def _check_kind(self) -> "JudgeConfig":
        if self.kind == "model" and self.model.path is None:
            raise ValueError("judge.model.path: required when judge.kind is model")
        if self.kind == "composite":
            if not self.composite.components:
                raise ValueError("judge.composite.components: a composite judge needs at least one component")
            for i, component in enumerate(self.composite.components):
                model = component.model or self.model
                if component.kind == "model" and model.path is None:
                    raise ValueError(f"judge.composite.components.{i}.model.path: required for a model component")
        return self
