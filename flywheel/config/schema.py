"""The typed configuration of a Flywheel deployment, one section per concern.

Names follow AReaL where it has one (`rollout.max_head_offpolicyness`,
`rollout.max_concurrent_rollouts`, `actor.use_decoupled_loss`, `actor.recompute_logprobs`,
`actor.eps_clip`, `actor.behav_imp_weight_cap`; AReaL's `gconfig` is `rollout.sampling`). Every
section forbids unknown keys, so a typo is an error that names the key rather than a silently ignored setting.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flywheel.config.actor import ActorConfig
from flywheel.config.adapters import AdaptersConfig
from flywheel.config.judge import JudgeConfig
from flywheel.config.memory import MemoryConfig
from flywheel.config.promotion import PromotionConfig
from flywheel.config.section import Section
from flywheel.config.serve import ServeConfig
from flywheel.config.tenants import TenantConfig, check_tenants


class BusConfig(Section):
    url: str = "embedded"
    """`embedded` starts a private nats-server under `run_dir/nats`; otherwise the URL of a NATS
    server, or of several servers of one cluster separated by commas
    (`nats://a:4222,nats://b:4222,nats://c:4222`): the client connects to any and fails over."""
    replicas: int = Field(1, ge=1, le=5)
    """Copies JetStream keeps of every stream (and of the large-record store), on different
    servers of a cluster: 3 survives the loss of any one server. 1 on a single server."""
    ack_wait_s: float = Field(30.0, ge=1.0)
    """How long a record a loop has taken may stay unacknowledged before the bus delivers it
    again: how soon a dead loop's records reach its successor. Records held longer (open
    sessions, samples waiting for their group or checkpoint) are kept alive meanwhile."""

    @field_validator("url")
    @classmethod
    def _embedded_or_nats_urls(cls, value: str) -> str:
        if value == "embedded":
            return value
        for server in (part.strip() for part in value.split(",")):
            scheme, found, rest = server.partition("://")
            if not server or (found and scheme not in ("nats", "tls", "ws", "wss")) or not (rest if found else server):
                raise ValueError(f"{server!r} is not a NATS URL (nats://host:port; several separated by commas)")
        return value

    @model_validator(mode="after")
    def _replicas_need_a_cluster(self) -> "BusConfig":
        if self.replicas > 1 and self.url == "embedded":
            raise ValueError(
                f"bus.replicas={self.replicas} needs a JetStream cluster, and `embedded` is one server: point "
                "bus.url at the cluster's servers (`flywheel nats-cluster` starts one on this machine)"
            )
        return self



class CollectConfig(Section):
    idle_timeout_s: float = Field(600.0, gt=0)
    """A session with no traffic for this long, and no request of it in flight, is closed and
    emitted (a reply slower than this does not split its conversation)."""
    reply_timeout_s: float = Field(900.0, gt=0)
    """A request the gateway announced (`pending`) holds its session open at most this long
    after it arrived, when its turn never comes (the gateway died mid-reply); keep it above
    `serve.request_timeout_s`."""
    feedback_grace_s: float = Field(5.0, ge=0)
    """A session ended by `X-Session-Done` or the end endpoint, with no session reward yet,
    waits this long for one before it is emitted (clients often send the reward right after the
    last turn). Session feedback ends the wait at once."""
    max_turns: int = Field(256, ge=1)
    """A session reaching this many main turns is cut (reason `limit`): its later turns form the
    next trajectory. The pieces are held until the session closes and emitted together, each with
    all of the session's feedback."""
    max_tokens: int = Field(131_072, ge=1)
    """Likewise for the total length of its stitched token segments."""
    truncated_turns: Literal["train", "mask"] = "train"
    """Turns cut at `max_tokens` (finish reason `length`): `train` them like any other (the
    length limit is part of what the policy learns to live with: a rambling turn is credited
    with what followed it), or `mask` their sampled tokens out of the loss, as DAPO's overlong
    filtering does where the cut is an artefact. Counted either way (`truncated_turns`)."""
    remember_closed: int = Field(100_000, ge=1)
    """How many emitted sessions, and as many turn ids, are remembered to drop duplicate
    deliveries and to recognise late feedback."""


class SamplingConfig(Section):
    """How the rollout driver samples (AReaL's `gconfig`)."""

    n_samples: int = Field(4, ge=1)
    """Samples per prompt: the group that advantages are normalised over."""
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    length_tail: float | None = Field(None, gt=0.0)
    """α of heavy-tailed generation lengths, as reasoning models produce: each sample's length
    is drawn from a Pareto tail P(L >= x) ∝ x^-α on [`min_new_tokens`, `max_new_tokens`] and
    generated to the end (`ignore_eos`). None: the model decides, up to `max_new_tokens`."""
    min_new_tokens: int = Field(1, ge=1)


class EpisodeConfig(Section):
    """Limits on one episode (one attempt at a task); single-turn tasks end at their first reply."""

    max_turns: int = Field(20, ge=1)
    """Model replies per episode; then the attempt is graded as it stands."""
    max_tokens: int | None = Field(None, ge=1)
    """Sampled tokens per episode, over all turns (each turn's `max_tokens` is cut to what is
    left); None: only `rollout.sampling.max_new_tokens` per turn."""
    timeout_s: float = Field(900.0, gt=0)
    """Wall-clock limit: past it the episode stops acting and is graded; an episode that does
    not come back within twice this time fails (unscored, with the reason)."""


class RolloutConfig(Section):
    enabled: bool = True
    """Run the rollout driver (offline RL / environment traffic); off for live traffic only."""
    env: str = "digits"
    """Task source, by name (see `envs.make_env`)."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment, e.g. `{max_operand: 50, word_problems: true}`."""
    endpoint: str | None = None
    """OpenAI-compatible base URL to send rollouts to; default: this deployment's serve loop.
    Requests carry the key in the environment variable `FLYWHEEL_API_KEY` when it is set."""
    max_head_offpolicyness: int = Field(4, ge=0)
    """η: rollouts may start only while (accepted + running) < (η + version + 1) · batch size;
    the trainer also drops samples whose oldest token is more than η versions old."""
    max_concurrent_rollouts: int = Field(32, ge=1)
    sampling: SamplingConfig = SamplingConfig()
    episode: EpisodeConfig = EpisodeConfig()
    n_parallel_envs: int = Field(0, ge=0)
    """0: episodes run in the driver's process (light environments). N > 0: a pool of N Ray
    workers, each running one episode at a time in its own slot (a sandbox's uid is
    10000 + slot); placed by `env_worker_resources`, so a Ray cluster spreads them unchanged."""
    env_worker_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 0.0})
    """Ray resources each environment worker requests, e.g. `{CPU: 1}` or a custom
    `{env_node: 1}` that only CPU nodes advertise."""


class TrainConfig(Section):
    batch_size: int = Field(32, ge=1)
    """Samples per optimizer step (B in the staleness bound)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop training after this many steps; None trains as long as samples come."""
    weight_update_interval: int = Field(1, ge=1)
    """Publish weights to the store and announce them every this many steps; with rollouts, at most
    `rollout.max_head_offpolicyness` + 1 (more could deadlock the admission: refused at start)."""
    keep_versions: int = Field(3, ge=1)
    """Weight versions kept in the store."""
    torch_threads: int = Field(1, ge=1)
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one forward/backward pass; a step accumulates gradients over as many
    micro-batches as its samples need (a segment longer than this gets one of its own)."""
    packing: bool = True
    """Pack segments into rows with no padding (block-diagonal attention); false: one padded
    row per segment (for comparison)."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """The trainer's attention kernel (transformers' `attn_implementation`). Packing needs the
    segments of a row kept apart: sdpa, eager and flex_attention derive that from the restarting
    position ids; flash-attention does only for a single row, so it is refused with packing."""
    checkpoint_interval: int = Field(50, ge=0)
    """Save a full checkpoint (model, optimizer, schedule, counters, RNG, trained sample ids)
    every this many steps, and when the loop stops; 0: only when it stops. Samples are
    acknowledged on the bus when the checkpoint that holds them is saved: a trainer that dies
    is sent again what it trained since, and trains it once more from that checkpoint."""
    keep_checkpoints: int = Field(2, ge=1)
    resume: bool = False
    """Require a checkpoint to continue from (`flywheel train --resume`). The train loop continues
    from the newest checkpoint in `run_dir/checkpoints` whenever there is one."""
    group_timeout_s: float = Field(60.0, gt=0)
    """A task group of unknown size, or one that never fills, is trained once no member has
    arrived for this long (see flywheel/train/grouping.py)."""
    remember_samples: int = Field(100_000, ge=1)
    """How many trained sample ids are remembered (and checkpointed) to drop redeliveries."""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N`."""
    autocast: bool = True
    """On CUDA, run the forward passes under bf16 autocast (weights and AdamW stay float32):
    faster, but its log-probs then differ from a float32 engine's by a few hundredths of a nat
    per token (`behav_logprob_gap`), so π_prox is not exactly π_behav. false: float32
    throughout, and the recompute reproduces the engine. A CPU never autocasts
    (docs/experiments/gpu-path.md)."""
    fsdp: bool = False
    """Shard the model with FSDP2 across the ranks of an initialised torch.distributed process
    group (multi-GPU; docs/experiments/gpu-path.md). Refused without one."""


    @model_validator(mode="after")
    def _packing_needs_separate_segments(self) -> "TrainConfig":
        if self.packing and self.attn_implementation.startswith("flash_attention"):
            raise ValueError(
                f"train.attn_implementation: {self.attn_implementation} would attend across the packed segments of a "
                "row (transformers separates them for single-row batches only); use sdpa, eager or flex_attention, "
                "or set train.packing=false"
            )
        return self


LOOP_NAMES = ("serve", "collect", "judge", "train", "rollout", "promote", "eval_serve")


class DeployConfig(Section):
    ray_address: str | None = None
    """None starts a Ray of its own (`auto` joins the one a `ray start` here last wrote down), else a cluster's address."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs for a local Ray (default: all)."""
    loops: list[Literal["serve", "collect", "judge", "train", "promote"]] = ["serve", "collect", "judge", "train", "promote"]
    """The loops this deployment hosts (the rollout driver joins them when `rollout.enabled`;
    `promote`, with its evaluation server, runs only when `promotion.mode` is not off).
    Where gateways run on their own (a Kubernetes Deployment), the Ray cluster hosts
    `[collect, judge, train]` and rollouts reach the gateways at `rollout.endpoint`."""
    serve_torch_threads: int = Field(1, ge=1)
    """Intra-op torch threads of the serve loops a deployment hosts when `serve.torch_threads` is
    not set: the loops share their machine's cores (the trainer and the judge's model take one
    each too). A gateway run alone (`flywheel serve`, `flywheel engine`) takes every core it may;
    a serve loop placed on a node of its own (`resources`) is given more by setting either key."""
    resources: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Ray resources each loop's actor requests, by loop (serve, collect, judge, train, rollout,
    promote, eval_serve),
    e.g. `{train: {trainer: 1}, serve: {engine: 1}}`: a custom resource places the loop on the
    nodes started with it (`ray start --resources '{"trainer": 1}'`); `CPU` and `GPU` are
    Ray's own. A loop not named reserves nothing and runs on any node."""

    @field_validator("resources")
    @classmethod
    def _known_loops(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for loop, wanted in value.items():
            if loop not in LOOP_NAMES:
                raise ValueError(f"{loop!r} is not a loop (one of {', '.join(LOOP_NAMES)})")
            if any(amount < 0 for amount in wanted.values()):
                raise ValueError(f"{loop}: resource amounts cannot be negative")
        return value


class FlywheelConfig(Section):
    run_dir: str = "runs/local"
    """Where a run keeps its bus data, weight store, logs and metrics."""
    model: str = "tiny"
    """`tiny`, `smollm2-135m`, or a local Hugging Face model directory."""
    seed: int = 0
    bus: BusConfig = BusConfig()
    serve: ServeConfig = ServeConfig()
    collect: CollectConfig = CollectConfig()
    judge: JudgeConfig = JudgeConfig()
    rollout: RolloutConfig = RolloutConfig()
    actor: ActorConfig = ActorConfig()
    train: TrainConfig = TrainConfig()
    promotion: PromotionConfig = PromotionConfig()
    deploy: DeployConfig = DeployConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    """Personal LoRA adapters instead of full fine-tuning (flywheel/config/adapters.py)."""
    memory: MemoryConfig = MemoryConfig()
    """Each person's instructions, read from their corrections and put in their prompts
    (flywheel/config/memory.py)."""
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    """The customers and their keys (flywheel/config/tenants.py); empty: each key in
    `serve.api_keys` is a tenant of its own, and with no keys there is one open tenant."""

    @property
    def served_model(self) -> str:
        """The model's name on the endpoint: what clients (the rollout driver, an `llm` judge on this
        deployment) put in `model`."""
        return self.serve.served_model_name or self.model

    @property
    def base_teaches(self) -> bool:
        """Whether the policy's own server is the judge's teacher: with adapters the base never
        moves, so a request with no adapter is the frozen starting model, and no second copy of
        the weights is needed (unless `judge.weights` names other weights)."""
        return self.adapters.kind == "lora" and self.judge.weights is None

    @model_validator(mode="after")
    def _tenants_keep_their_keys_apart(self) -> "FlywheelConfig":
        check_tenants(self.tenants, self.serve.api_keys)
        return self

    @model_validator(mode="after")
    def _adapters_train_alone(self) -> "FlywheelConfig":
        if self.promotion.enabled and self.serve.admin_key is None and any(t.keys for t in self.tenants.values()):
            raise ValueError("promotion.mode on with tenants' keys needs serve.admin_key: the gate loads versions on "
                             "the evaluation server with it, and no tenant's key may")
        if self.adapters.kind == "lora" and self.promotion.enabled and self.rollout.enabled:
            raise ValueError("adapters.kind=lora with promotion.mode on and rollout.enabled=true: the rollout driver's "
                             "admission follows the shared weights' versions, which adapters never move; set "
                             "rollout.enabled=false (live traffic trains the adapters)")
        if self.adapters.kind == "lora" and self.train.fsdp:
            raise ValueError("adapters.kind=lora with train.fsdp: adapters are trained on one device")
        return self

    @model_validator(mode="after")
    def _memory_reads_corrections(self) -> "FlywheelConfig":
        if self.memory.enabled and self.judge.kind == "llm" and self.judge.llm.mode != "next_state":
            raise ValueError(f"memory.enabled with judge.kind=llm and judge.llm.mode={self.judge.llm.mode}: its rewards "
                             "are in [0, 1], so no reply is judged below zero and no correction is read; use "
                             "judge.llm.mode=next_state or judge.kind=next_state")
        if self.memory.best_of > 1 and self.serve.engine_kind == "vllm":
            raise ValueError("memory.best_of > 1 with serve.engine_kind=vllm: each reply's answering is read with "
                             "prefill-only scoring, which the vLLM engine client does not do; set memory.best_of=1")
        return self

    @model_validator(mode="after")
    def _practice_needs_adapters(self) -> "FlywheelConfig":
        if self.judge.teacher.practice and self.adapters.kind != "lora":
            raise ValueError("judge.teacher.practice needs adapters.kind=lora: the practice replies are the person's "
                             "adapter's, on the policy's server")
        if self.judge.teacher.practice and self.serve.admin_key is None and any(t.keys for t in self.tenants.values()):
            raise ValueError("judge.teacher.practice with tenants' keys needs serve.admin_key: the judge samples every "
                             "tenant's adapters with it, and no tenant's key may")
        if self.judge.teacher.practice_prompt == "bare" and not self.memory.enabled:
            raise ValueError("judge.teacher.practice_prompt=bare needs memory.enabled: it leaves out the instructions "
                             "the served memory puts in a person's prompts")
        return self

    @model_validator(mode="after")
    def _a_canary_needs_traffic_that_does_not_wait(self) -> "FlywheelConfig":
        if self.promotion.mode == "canary" and self.rollout.enabled:
            raise ValueError(
                "promotion.mode=canary with rollout.enabled=true: the rollout driver waits for the trainer, which waits "
                "for the canary's evidence, which waits for traffic; use promotion.mode=gate with the driver, canary "
                "with live traffic"
            )
        return self

    @model_validator(mode="after")
    def _rollouts_need_a_gateway(self) -> "FlywheelConfig":
        if self.rollout.enabled and "serve" not in self.deploy.loops and self.rollout.endpoint is None:
            raise ValueError(
                "rollout.enabled=true and deploy.loops without serve: set rollout.endpoint to the gateways' URL "
                "(or rollout.enabled=false for live traffic only)"
            )
        return self

    @model_validator(mode="after")
    def _admission_reaches_the_next_announcement(self) -> "FlywheelConfig":
        # Deadlock-free iff k <= η + 1, with k = train.weight_update_interval, B = train.batch_size
        # and every step taking B samples (rollout.sampling.n_samples divides B; every episode scored).
        # While v is the newest announced version the driver admits (η + v + 1)·B samples in all,
        # and no more. The trainer's version is at least its step count s (one more a step; a
        # restarted trainer may jump ahead) and it announces when s is a multiple of k: having
        # announced v at step s <= v, it announces again by step s + k, once at most
        # (s + k)·B <= (v + k)·B samples in all are trained, which the driver admits if k <= η + 1.
        # If k > η + 1 a fresh run stops at once: the driver admits (η + 1)·B samples, the trainer
        # takes η + 1 < k steps without announcing, and each waits for the other.
        interval, eta = self.train.weight_update_interval, self.rollout.max_head_offpolicyness
        if self.rollout.enabled and interval > eta + 1:
            raise ValueError(
                f"train.weight_update_interval={interval} with rollout.max_head_offpolicyness={eta} can deadlock: the "
                f"rollout driver admits at most ({eta} + v + 1)·train.batch_size samples while v is the newest announced "
                f"version, and the trainer announces one only every {interval} steps; set train.weight_update_interval <= "
                "rollout.max_head_offpolicyness + 1 (or rollout.enabled=false for live traffic only)"
            )
        return self
