"""The serve loop's configuration (`serve.*`): the gateway, its engines, weight swaps, operations.
Part of `flywheel.config.schema.FlywheelConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from flywheel.config.section import Section


class ServeConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    """0 picks a free port (the chosen one is written to `run_dir/serve.url`)."""
    served_model_name: str | None = None
    """The model id clients use; defaults to the `model` setting."""
    max_batch_size: int = Field(32, ge=1)
    """Most sequences the engine decodes together."""
    max_new_tokens: int = Field(1024, ge=1)
    """Upper bound on a request's `max_tokens`."""
    default_max_new_tokens: int = Field(256, ge=1)
    """Used when a request does not say (`max_new_tokens` still bounds it)."""
    publish_queue_size: int = Field(10_000, ge=1)
    """Finished turns waiting to be published, off the response path."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op threads of the embedded engine's torch. None: every core this process may use, as
    a gateway alone on its machine wants (docs/experiments/engine-vs-vllm.md: 1.17x vLLM's throughput on
    2 cores here in float32, 0.77x on one); the serve loops of a deployment, whose loops share
    their machine, take `deploy.serve_torch_threads` instead."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The embedded engine's weights and KV cache (its logits and sampling stay float32; a vLLM
    engine takes `--dtype` from `FLYWHEEL_VLLM_ARGS`). A `bfloat16` decode step takes ~0.64x
    the CPU time of a float32 one here (AVX-512 BF16), but its behaviour log-probs differ
    from the float32 trainer's recomputation (`behav_logprob_gap`, docs/experiments/engine-vs-vllm.md)."""
    chunked_prefill_size: int = Field(512, ge=1)
    """Most prompt tokens the embedded engine prefills between two decode steps (SGLang's
    `--chunked-prefill-size`): a longer prompt is prefilled in pieces, and the running streams
    get tokens between them (`max_stall_s`; `flywheel/serve/engine/chunked.py`)."""
    schedule_policy: Literal["shortest-first", "fcfs"] = "shortest-first"
    """The order in which the embedded engine admits waiting requests (SGLang's
    `--schedule-policy`): `shortest-first`, the least prompt left to prefill first (a burst's
    short prompts do not wait behind its long ones; a request passed over in 8 rounds then goes
    first), or `fcfs`, arrival order (`flywheel/serve/engine/chunked.py`; docs/experiments/engine-vs-vllm-first-token.md)."""
    max_stall_s: float = Field(0.5, ge=0)
    """While prompts wait to be prefilled and a row is free, the embedded engine runs its prefill
    rounds back to back (SGLang's prefill-first order) until the running streams' last tokens are
    this old; then a decode step gives each of them a token. A round under way finishes, so a stream
    may wait this plus one round. 0: a decode step after every round. Under a burst of 32 prompts
    0.5 took the time to first token's p90 from 1.09 to 0.89 s, the median from 0.38 to 0.27 s
    (bfloat16, medians of two; docs/experiments/engine-vs-vllm-first-token.md)."""
    own_decoder: bool = True
    """Decode steps of Llama-family models through the embedded engine's own forward
    (`flywheel/serve/engine/decoder.py`: fused, oneDNN-packed weights; 0.77x the CPU time of a float32
    step, 0.72x bfloat16; docs/experiments/engine-vs-vllm.md). False: transformers' forward."""
    cuda_graphs: bool = True
    """On CUDA, the embedded engine's own decode steps (`own_decoder`) are captured as CUDA graphs,
    one per batch bucket, with adapter rows or without, and replayed: one launch for a step's
    ~1,340 kernels, where an eager step of a small model waits on launching them
    (`flywheel/serve/engine/decode_graphs.py`; docs/experiments/adapters.md). No effect on a CPU."""
    max_loras: int = Field(8, ge=0)
    """LoRA adapters the embedded engine holds at once (slots; vLLM's `--max-loras`): rows of
    that many adapters, and of the bare base, decode in one batch. Beyond it the least recently
    used adapter that no request holds is evicted (read from disk again on its next use); a
    request whose adapter finds every slot held waits. Memory: per slot, the largest adapter's
    matrices (SmolLM2-135M, all linear layers: ~9.8 MB at rank 8, in float32). 0: no adapters
    (`flywheel/serve/engine/adapters.py`)."""
    lora_root: str | None = None
    """A directory of LoRA adapters in PEFT's format, one per subdirectory named for it: a request
    naming an adapter (SGLang's `lora_path`) that was not loaded with `/load_lora_adapter` is
    served from `lora_root/<name>/`. None: only loaded adapters."""
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    """Where the embedded engine runs: `cpu`, `cuda` or `cuda:N` (then its weights, KV cache and
    sampling are on that GPU; a machine without one refuses to start, naming this key)."""
    engine_urls: list[str] = Field(default_factory=list)
    """External engines speaking SGLang's protocol (real SGLang, or `flywheel engine`);
    empty: one embedded engine in this process."""
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    """What the engines speak: `sglang` (SGLang's protocol: the `engine_urls`, else the embedded
    engine) or `vllm` (vLLM servers and their RL endpoints, `flywheel/serve/backends/vllm.py`: the
    `engine_urls`, else one vLLM server this gateway starts for `model` from `.venv-vllm` and
    stops with it; a judge or eval server beside it keeps the embedded engine). A canary's
    `promotion.canary.engine_urls` are engines of this kind too."""
    keep_alive_s: float = Field(75.0, gt=0)
    """How long an idle client connection is kept open. Longer than clients' own idle expiry
    (httpx, under the openai client, drops idle connections after 5 s) so a client never sends
    a request on a connection the server is closing."""
    swap_mode: Literal["in_place", "retract"] = "in_place"
    """How in-flight generations cross a weight swap: keep their KV cache (`in_place`; later
    tokens carry the new version) or have it recomputed under the new weights (`retract`)."""
    role: Literal["policy", "judge", "eval"] = "policy"
    """`judge`: a server whose weights do not move (a judge's, a hint teacher's): it keeps the
    weights it started with and never follows announced versions, writes its URL to
    `run_dir/judge.url` (not serve.url), and also serves SGLang's `/generate` at
    `/engine/generate` (prefill scoring). Its requests are recorded as any, judges send side
    turns, which nothing trains on. `deploy` starts one when a judge needs it. `eval`: the same,
    for the promotion gate (`run_dir/eval.url`), which loads the versions it compares through
    SGLang's `/engine/update_weights_from_disk` (any version, older ones too)."""
    swap_weights: bool = True
    """Whether this gateway loads announced weights into its engines. Several gateways in front
    of the same `engine_urls` should leave it to one: the others (`false`) follow, polling the
    engines until each reports the announced version, so an engine loads each version once."""
    follow_timeout_s: float = Field(600.0, gt=0)
    """How long a following gateway waits for the engines to reach an announced version before
    it logs a warning and waits for the next one."""
    api_keys: list[str] = Field(default_factory=list)
    """Keys clients send as `Authorization: Bearer <key>` on `/v1/...`; empty: no key needed."""
    admin_key: str | None = None
    """Key for engines' control routes (pause, weight loading, aborts): the gateway sends it to
    the engines in `engine_urls` (SGLang's `--admin-api-key`); None: not required."""
    metrics_key: str | None = None
    """A key that opens `GET /metrics` and `/dashboard.json` and nothing else (a Prometheus
    scraper's: `authorization: {credentials: ...}` in its scrape config). Where `admin_key` is set,
    those need one of the two: they name every tenant."""
    max_concurrent_requests: int = Field(256, ge=1)
    """Generations in flight at once; more wait in line."""
    max_queued_requests: int = Field(1024, ge=0)
    """Requests waiting for a generation slot at most; beyond that a 429 with `Retry-After`. Shared
    fairly between tenants: a freed slot goes to the waiting tenant holding the fewest, and a
    tenant with at least two fewer requests waiting than the longest line takes that line's newest
    place (flywheel/serve/ops/limits.py)."""
    retry_after_s: float = Field(1.0, gt=0)
    """What the 429 asks clients to wait before retrying."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1)
    """Larger request bodies get a 413."""
    request_timeout_s: float = Field(600.0, gt=0)
    """A request still unanswered after this long (waiting for a slot included) gets a 504."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """How long a graceful shutdown waits for in-flight requests to finish."""
    spill_dir: str | None = None
    """Where turns go while the bus is unreachable or the publish queue is full, to be published
    later in order; None: `run_dir/spill`."""
    chat_template: str | None = None
    """A Jinja chat template to use instead of the model's: a file path, or the template text."""
    continue_sessions: int = Field(4096, ge=0)
    """How many sessions' latest token sequences the gateway keeps so that their next prompt
    continues the exact ids the model saw (`flywheel/serve/continuation.py`); 0 turns this off."""
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """How the model writes tool calls (`flywheel/formats/tool_calls.py`); `auto` reads it from the chat
    template. A template that renders no tools always gets the gateway's Hermes prompt."""
    stored_responses: int = Field(10_000, ge=0)
    """How many Responses API answers (with `store`) the gateway keeps in memory for each tenant, for
    `previous_response_id` and `GET /v1/responses/{id}`; the least recently used go first."""
    client_store: Literal["honour", "ignore"] = "honour"
    """A request's own `store: false` (chat completions, Responses API): `honour` it (nothing of
    the request is kept or trained), or `ignore` it, for agents that send it out of habit (Codex
    CLI sends it on every request) on a deployment whose operator wants their traffic. A
    tenant's or key's `store: false` holds either way."""

    @model_validator(mode="after")
    def _someone_swaps_an_embedded_engine(self) -> "ServeConfig":
        if not self.swap_weights and not self.engine_urls:
            raise ValueError("serve.swap_weights=false needs serve.engine_urls: nobody else can swap an embedded engine")
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_or_file(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or "{%" in value:
            return value
        try:
            return Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"neither a Jinja template nor a readable file: {exc}") from None
