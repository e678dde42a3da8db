"""The records that travel between the loops, field by field.

Every record is a `msgspec.Struct` encoded as MessagePack on the wire (JSON where people read
them: spill files, `flywheel tail`; `encode`/`decode` take the codec). MessagePack because the loops'
throughput is bound by decoding. Per-token data (ids, logprobs, versions, masks) are typed arrays
(`flywheel.bus.arrays`) that travel as raw bytes: one copy to decode instead of one object per
token; logprobs stay exact float64. Each carries `schema`, the version of its layout: a consumer
accepts any record whose `schema` it knows and ignores fields it does not (so a producer may add
optional fields without breaking older consumers; removing or retyping a field bumps `SCHEMA_VERSION`).

Who produces and consumes what:

    Turn          serve    -> collect   one finished request: exact tokens, logprobs, versions
    SessionEvent  serve    -> collect   feedback (a reward and/or text) or an explicit end
    Trajectory    collect  -> judge     a closed session's turns stitched into token segments
    Sample        judge    -> train     a trajectory with its rewards
    Unscored      judge    -> (people)  a trajectory no judge could score, and why
    WeightUpdate  train    -> serve     a new policy version published to the weight store

Token conventions (the exact-token invariants, docs/architecture.md): `prompt_ids` and `output_ids` are the ids
the engine saw and sampled, never a re-tokenization; `output_logprobs[i]` is the behaviour
log-probability of `output_ids[i]` under the distribution it was sampled from, and
`output_versions[i]` the weight version that sampled it.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal

import msgspec

from flywheel.bus.arrays import Float64s, Int8s, Int32s, decode_hook, encode_json_hook, encode_msgpack_hook

SCHEMA_VERSION = 2
"""2: per-token fields became typed arrays (raw bytes in MessagePack). Version 1 records, with
lists there, still decode."""

TurnType = Literal["main", "side"]
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class Record(msgspec.Struct, kw_only=True, omit_defaults=False, forbid_unknown_fields=False):
    """Base of every bus record: a unique id and the layout version."""

    id: str
    """Unique record id; consumers deduplicate by it and JetStream by `Nats-Msg-Id`."""
    schema: int = SCHEMA_VERSION
    created_at: float = msgspec.field(default_factory=time.time)
    """Unix time at which the producer created the record."""


class Timings(msgspec.Struct, kw_only=True):
    """Where a request's time went, in seconds."""

    queued_s: float = 0.0
    """From arrival at the gateway until the engine started it."""
    first_token_s: float = 0.0
    """From arrival until the first output token existed."""
    total_s: float = 0.0
    """From arrival until the response was complete."""


class Turn(Record, kw_only=True):
    """One request/response through the gateway, with the exact tokens the engine used. Its `id`
    is the interaction id: the gateway returns it to the client (`X-Interaction-Id`), and
    feedback about this turn names it."""

    session_id: str
    """From `X-Session-Id`, else `metadata.session_id`, else `user`, else a fresh id (the turn
    is then a one-turn session of its own), namespaced by the tenant (`tenant/id`; the open
    tenant's as sent)."""
    tenant: str = "open"
    """The customer whose key sent the request (`open`: a deployment with no keys)."""
    user_id: str | None = None
    """The end user inside the tenant (`X-User-Id`, else `safety_identifier`, `user` or
    `metadata.user_id`), when the request says."""
    adapter: str | None = None
    """The LoRA adapter that sampled it (`adapters.kind: lora`; flywheel/models/adapter_names.py);
    then `output_versions` are that adapter's versions. None: the shared weights."""
    consent: bool = False
    """Whether this turn may be trained: its tenant's and key's `training` and its request's
    `X-Flywheel-Train`, the strictest (false where not said: nothing is trained by default)."""
    turn_index: int
    """The number of assistant messages in the request's history: this turn's position in its
    conversation as the client counts it. Not an identity: retries, sub-agents and helper calls
    share indices within one session (the collector places turns by lineage and `id`)."""
    turn_type: TurnType = "main"
    """`side` turns (from `X-Turn-Type: side`) are served and recorded but not trained."""
    task_id: str | None = None
    """Groups samples of the same task (`X-Task-Id`), e.g. the n samples of one prompt."""
    group_size: int | None = None
    """Sessions in the task group (`X-Group-Size`, or n for one request's choices): the trainer takes
    it once all are scored; None: unknown, complete when none arrives for `train.group_timeout_s`."""
    model: str
    endpoint: Literal["chat", "completions", "responses", "messages"] = "chat"
    """The API the client called (Responses and Messages requests are served, and recorded, as chat)."""
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """The chat request's messages as the model was asked them: redacted where the tenant redacts
    input, with the person's served instructions (`memory.*`); empty for `completions`."""
    memory: bool = True
    """Whether the served memory took this turn: false where its request said `X-Flywheel-Memory:
    false` (then it served no instructions, and reads no correction from its conversation)."""
    instructions: list[str] = msgspec.field(default_factory=list)
    """The person's instructions the served memory put in `messages` (`memory.*`: in the system
    message or before the first user message's text)."""
    opening: str = ""
    """The start of `response` the served memory wrote (`memory.opening`: the greeting asked for,
    `memory.opening_text`), which ends `prompt_ids`: the model continues from it; "" where none."""
    best_of: int = 1
    """Of how many replies the checks of the person's wish chose this (`memory.best_of`; 1: sampled)."""
    prompt: str | None = None
    """The `completions` request's text prompt (None for chat, or a prompt given as ids)."""
    response: dict[str, Any]
    """The assistant message returned to the client (for `completions`: {"text": ...})."""
    prompt_ids: Int32s
    output_ids: Int32s
    output_logprobs: Float64s
    output_versions: Int32s
    finish_reason: FinishReason
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    """The sampling parameters the engine used (temperature, top_p, max_new_tokens, ...)."""
    session_done: bool = False
    """The client marked this turn as the last of its session (`X-Session-Done: true`)."""
    client_disconnected: bool = False
    """The client went away before the answer was complete, streamed or not (the output is what was
    generated until then; `finish_reason` is `abort`). With an engine abort or a request timeout,
    `finish_reason` is `abort` too: a turn the client did not use, unless a later one continues it."""
    timings: Timings = msgspec.field(default_factory=Timings)

    def __post_init__(self) -> None:  # producers may pass lists
        self.prompt_ids = Int32s.coerce(self.prompt_ids)
        self.output_ids = Int32s.coerce(self.output_ids)
        self.output_logprobs = Float64s.coerce(self.output_logprobs)
        self.output_versions = Int32s.coerce(self.output_versions)

    @property
    def oldest_version(self) -> int | None:
        return min(self.output_versions) if self.output_versions else None


class SessionEvent(Record, kw_only=True):
    """A signal about a session that is not a turn: feedback, an explicit end, or a request in flight."""

    session_id: str
    tenant: str = "open"
    """The tenant whose key sent it: its session is that tenant's."""
    kind: Literal["feedback", "end", "pending"]
    """`pending`: a request of the session arrived at the gateway; its turns (`turn_ids`) are
    being generated, so the session is not idle however long they take."""
    reward: float | None = None
    """For feedback: the reward given (any float; judges decide how to scale it)."""
    turn_index: int | None = None
    """For feedback about one turn of the session's first conversation, by its `Turn.turn_index`
    (`interaction_id` names any turn); None with no `interaction_id` means the whole session."""
    interaction_id: str | None = None
    """For feedback about the turn with this id (`X-Interaction-Id`, `Turn.id`)."""
    text: str | None = None
    """Free-text feedback, for judges that read it."""
    source: str = "user"
    """Who gave it: `user` (a person or client), `env` (an environment's verdict), ..."""
    details: dict[str, Any] | None = None
    """Structured facts behind the feedback (e.g. an environment's per-test outcomes)."""
    turn_ids: list[str] | None = None
    """For pending: the ids the request's turns will have (`Turn.id`, one per choice)."""


class Segment(msgspec.Struct, kw_only=True):
    """A run of consecutive tokens that the model saw as one sequence.

    Turns are merged into one segment while each turn's prompt extends the previous prompt plus
    output exactly; a chat template that rewrites history starts a new segment. All four lists
    have the same length.
    """

    token_ids: Int32s
    loss_mask: Int8s
    """1 exactly on sampled tokens; 0 on prompt, user text, tool output and template glue."""
    logprobs: Float64s
    """Behaviour log-probabilities on sampled tokens; 0.0 where `loss_mask` is 0."""
    versions: Int32s
    """Weight version that sampled each token; -1 where `loss_mask` is 0."""
    turn_spans: list[tuple[int, int, int]] = msgspec.field(default_factory=list)
    """(position, start, end) of each turn's sampled tokens within `token_ids`, `position` being
    the turn's place in `Trajectory.turns`. Over a trajectory's segments in order, the k-th span
    is always `turns[k]`'s (records written before positions named the turn by its
    `turn_index`: read spans in order)."""

    def __post_init__(self) -> None:  # producers may pass lists
        self.token_ids = Int32s.coerce(self.token_ids)
        self.loss_mask = Int8s.coerce(self.loss_mask)
        self.logprobs = Float64s.coerce(self.logprobs)
        self.versions = Int32s.coerce(self.versions)


class Trajectory(Record, kw_only=True):
    """A closed session's main turns, arranged into its conversations (threads) and stitched into
    token segments (flywheel/collect/lineage.py, flywheel/bus/stitch.py). A session split at `collect.max_turns`
    or `collect.max_tokens` is several trajectories, each with all of the session's feedback."""

    session_id: str
    tenant: str = "open"
    """The tenant that owns the session (its turns')."""
    user_id: str | None = None
    """The end user its turns name (the one: a session two people share is a trajectory for each
    stretch of one person's turns, flywheel/collect/tracker.py; a turn may name none)."""
    adapter: str | None = None
    """The adapter its turns were sampled with (the last turn's): the one its sample trains."""
    consent: bool = False
    """Whether it may be trained: every one of its turns consented (the strictest holds)."""
    task_id: str | None = None
    group_size: int | None = None
    """The task group's size, from its turns (see `Turn.group_size`)."""
    segments: list[Segment]
    turns: list[Turn]
    """The main turns the client used, thread by thread and in order within each, with their text
    for the judges but without their token lists (`prompt_ids`, `output_ids`, `output_logprobs`,
    `output_versions` are empty): the tokens are in `segments`, once. Retry orphans and turns
    the client never used are not here (counted below)."""
    threads: list[int] = msgspec.field(default_factory=list)
    """Aligned with `turns`: the conversation each belongs to (0: the session's first; a
    sub-agent's, a helper call's, a branch's are others). Empty in older records: one thread."""
    next_states: list[list[dict[str, Any]]] = msgspec.field(default_factory=list)
    """Aligned with `turns`: the messages that followed each assistant turn in its own thread
    (the user's reply, tool results - parallel ones together), taken from that thread's next
    turn's request. Empty for a thread's last turn (its consequence, if any, is in `feedback`)."""
    feedback: list[SessionEvent] = msgspec.field(default_factory=list)
    close_reason: Literal["done", "end", "feedback", "idle", "limit", "user"]
    retry_orphans: int = 0
    """Answers to a request the client sent again (a retry) that no later turn continued from:
    left out of `turns` and of training."""
    unused_turns: int = 0
    """Turns that ended without the client using them (it went away, the request was aborted or
    timed out) and that no later turn continued from: left out."""
    masked_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    """Sampled tokens kept in the sequence (a later turn continued from them) but out of the loss
    (mask 0), by reason: `aborted` (a turn that ended without finishing), `truncated` (cut at
    max_tokens, with `collect.truncated_turns: mask`)."""

    @property
    def oldest_version(self) -> int | None:
        versions = [v for seg in self.segments for v, m in zip(seg.versions, seg.loss_mask) if m]
        return min(versions) if versions else None

    @property
    def num_sampled_tokens(self) -> int:
        return sum(sum(seg.loss_mask) for seg in self.segments)

    def thread_positions(self) -> list[tuple[int, int]]:
        """(thread, place within that thread) of each turn, aligned with `turns`."""
        count: dict[int, int] = {}
        out = []
        for thread in self.threads or [0] * len(self.turns):
            out.append((thread, count.get(thread, 0)))
            count[thread] = count.get(thread, 0) + 1
        return out


class Sample(Record, kw_only=True):
    """A scored trajectory, ready for the trainer. Its `id` is the trajectory's.

    It either carries its trajectory or refers to it by its sequence number in the TRAJECTORIES
    stream. The judge publishes references, so a trajectory's tokens travel through the bus
    once rather than twice (bench/collect_judge.py: the copy cost the pipeline a sixth of its
    throughput); the trainer attaches the trajectory with `Bus.resolve` before using it.
    """

    trajectory: Trajectory | None = None
    trajectory_seq: int | None = None
    tenant: str = "open"
    """Whose traffic it is (the trajectory's tenant)."""
    user_id: str | None = None
    """The end user (the trajectory's)."""
    consent: bool = False
    """Whether it may be trained (the trajectory's): the trainer refuses a sample without it."""
    """The trajectory's sequence number in the TRAJECTORIES stream, when not carried."""
    reward: float
    """The trajectory's scalar reward (outcome)."""
    turn_rewards: list[float] = msgspec.field(default_factory=list)
    """Optional per-turn rewards, aligned with `trajectory.turns`."""
    judge: str
    """Which judge produced the reward, e.g. `rule`."""
    judge_model: str | None = None
    """The model behind the scores, when a model judged: its name, where, and which weights
    (e.g. `tiny at http://127.0.0.1:41234/v1, weights v0`)."""
    details: dict[str, Any] = msgspec.field(default_factory=dict)
    """What the judge saw and decided, for people: e.g. each component's scores, the votes."""
    teacher_logprobs: list[Float64s] = msgspec.field(default_factory=list)
    """Hint distillation: per segment of the trajectory (aligned with its tokens), a teacher's
    log-probability of each sampled token of a turn that got a hint (the pinned model, told the
    hint, scoring what the policy sampled); NaN elsewhere. Empty: no turn got a hint."""
    teacher_top_k: int = 0
    """How many of the teacher's likeliest tokens each position of `teacher_top_ids` holds (0: none)."""
    teacher_top_ids: list[Int32s] = msgspec.field(default_factory=list)
    """Dense hint distillation: per segment, for each token `teacher_top_k` ids, the likeliest
    tokens of the teacher's distribution at that position, likeliest first (token t's at
    [t·k, (t+1)·k)); -1 where no teacher spoke. Empty when `teacher_top_k` is 0."""
    teacher_top_logprobs: list[Float64s] = msgspec.field(default_factory=list)
    """Their log-probabilities under the teacher, aligned with `teacher_top_ids` (NaN where none)."""

    def __post_init__(self) -> None:
        if (self.trajectory is None) == (self.trajectory_seq is None):
            raise ValueError("a Sample needs exactly one of `trajectory` and `trajectory_seq`")
        self.teacher_logprobs = [Float64s.coerce(values) for values in self.teacher_logprobs]
        self.teacher_top_ids = [Int32s.coerce(values) for values in self.teacher_top_ids]
        self.teacher_top_logprobs = [Float64s.coerce(values) for values in self.teacher_top_logprobs]


class Unscored(Record, kw_only=True):
    """A trajectory the judge could not score: kept, never turned into a silent zero."""

    trajectory: Trajectory
    judge: str
    reason: str
    """Why, e.g. `no reward in the feedback`, `deadline of 30s exceeded`, `unparseable votes`."""


class WeightUpdate(Record, kw_only=True):
    """A new policy version, published to the weight store and ready to load."""

    version: int
    path: str
    """Directory in the weight store holding the checkpoint (safetensors + config)."""
    step: int
    """Trainer step that produced it."""
    parent: int | None = None
    """The version its training continued from: the previous one announced, or, after a
    rollback, the version the trainer was told to continue from (`flywheel/versions/records.py`)."""
    trained_on: dict[str, Any] = msgspec.field(default_factory=dict)
    """What made it since `parent`: `samples`, `steps` ([first, last]), `sample_digests` (the
    newest samples', by `sample_digest`)."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    """Training metrics of the steps since `parent`, averaged: reward, KL to the reference, entropy, ..."""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    """The training settings that made it."""
    adapter: str | None = None
    """A version of this LoRA adapter (its directory alone, in PEFT's format, at `path`), not of
    the shared weights; versions count per adapter."""


Codec = Literal["msgpack", "json"]
_ENCODERS = {
    "msgpack": msgspec.msgpack.Encoder(enc_hook=encode_msgpack_hook),
    "json": msgspec.json.Encoder(enc_hook=encode_json_hook),
}
_DECODER_TYPES = {"msgpack": msgspec.msgpack.Decoder, "json": msgspec.json.Decoder}
_DECODERS: dict[tuple[type, Codec], Any] = {}


def encode(record: Record, codec: Codec = "msgpack") -> bytes:
    """Serialize a record (MessagePack on the bus; JSON for files and people)."""
    return _ENCODERS[codec].encode(record)


def decode(data: bytes, kind: type[Record], codec: Codec = "msgpack") -> Record:
    """Parse bytes as a record of `kind`; raises `msgspec.DecodeError` for bytes that are not
    the codec's, `msgspec.ValidationError` for a record of the wrong shape or a newer schema."""
    decoder = _DECODERS.get((kind, codec))
    if decoder is None:
        decoder = _DECODERS[kind, codec] = _DECODER_TYPES[codec](kind, dec_hook=decode_hook)
    record = decoder.decode(data)
    if record.schema > SCHEMA_VERSION:
        raise msgspec.ValidationError(
            f"{kind.__name__} has schema {record.schema}; this build reads up to {SCHEMA_VERSION}"
        )
    return record



class AuditEntry(Record, kw_only=True):
    """One administrative action, kept on the AUDIT stream: who did what to what (its `created_at`
    says when): tenants and keys changed, data forgotten, versions promoted, rolled back or pinned."""

    actor: str
    """Who: `admin` (the admin key), `cli`, or an operator's name."""
    action: str
    """What: `tenant.add`, `key.add`, `key.revoke`, `forget`, `version.promote`, ..."""
    target: str
    """On what: a tenant, `tenant/key-id`, a version."""
    details: dict[str, Any] = msgspec.field(default_factory=dict)


def tenant_of(record: Record) -> str | None:
    """Whose traffic a record holds (an unscored one: its trajectory's); None for records that
    are nobody's (weights, versions)."""
    if isinstance(record, Unscored):
        return record.trajectory.tenant
    return getattr(record, "tenant", None)


def sample_digest(sample_id: str) -> str:
    """How the lineage names a sample (`trained.jsonl`, a version's `trained_on`, the trainer's
    checkpoint): the first 24 hex digits of the SHA-256 of its id, never the id. An id holds its
    session's, which a client chose and which may say who they are; once a sample is forgotten
    (flywheel/tenants/forget.py) nothing readable of it stays, and its digest still says which
    versions it trained."""
    return hashlib.sha256(sample_id.encode()).hexdigest()[:24]
