"""Personal adapters (`adapters.*`): what learns when the base model stays frozen.

`kind: none` is full fine-tuning of the shared weights, as before. `kind: lora` freezes the base
and trains LoRA adapters (PEFT's format, so vLLM and SGLang load the same directories), one per
`scope`: `shared` (one for the deployment), `tenant` (one per tenant), `user` (one per end user
of a tenant; a request without a user is its tenant's). A tenant may set its own scope
(`tenants.NAME.adapter_scope`). Which adapter a request or sample belongs to is
`flywheel.models.adapter_names.adapter_for`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from flywheel.config.section import Section

Scope = Literal["shared", "tenant", "user"]


class AdaptersConfig(Section):
    kind: Literal["none", "lora"] = "none"
    """`none`: the trainer fine-tunes the shared weights. `lora`: the base is frozen and each
    `scope` gets its own LoRA adapter, trained only on its own samples and served beside the others
    in one batch (`serve.max_loras` of them resident at once)."""
    scope: Scope = "user"
    """Whose adapter a request uses and its sample trains: `shared`, `tenant` or `user`."""
    rank: int = Field(8, ge=1, le=256)
    """LoRA rank (Thinking Machines, "LoRA Without Regret": rank 1 already matches full fine-tuning
    for RL, with about 10x its learning rate)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The layers adapted: every linear layer but the output head (attention and MLP, as the
    paper above finds necessary), or a list of module names (`q_proj`, `down_proj`, ...)."""
    train_resident: int | None = Field(64, ge=1)
    """The most adapters the trainer holds in memory after a step (weights, gradients, optimizer:
    ~40 MB each for SmolLM2-135M at rank 8); the least recently trained others wait on disk
    (`run_dir/trainer_adapters`) until their next sample. None: every adapter stays in memory."""
    guard_drop: float | None = Field(1.0, gt=0)
    """The most an adapter's version may lower the mean log-probability (nats a token) of the
    base's own answers to general prompts before it is held back, unpublished, and the adapter
    returned to its last published version (flywheel/train/adapter_guard.py): what protects a
    person from a harmful version of their own adapter. None: no check."""
    guard_answers: float | None = Field(0.8, gt=0, le=1)
    """The least share an adapter's version still answers of the everyday questions its origin
    (else the base) answers, by its greedy replies: a reply answers when it fits its own question,
    against another, at least half as well as the origin's replies do on average, as the base
    reads them (flywheel/train/adapter_guard.py). Below it the version is held back as `guard_drop`
    holds one back: one-sample steps erode whether replies answer the question long before they
    erode the base's general answers. 0.8 of eight questions: one may be lost. None: no check."""
    guard_prompts: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    """The general prompts whose base answers the forgetting check (`guard_drop`) measures. None:
    twelve in English (arithmetic, facts, code, plain instructions: `GENERAL_PROMPTS` in
    flywheel/train/adapter_guard.py); a deployment whose people write in another language, or
    whose agent must keep another skill, sets its own."""
    guard_questions: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=2)
    """The everyday questions the answering check (`guard_answers`) asks. None: eight in English
    that ask for a few sentences (`RELEVANCE_PROMPTS` there). At least two: each reply is also
    read against the next question. The base must answer them (those it does not answer count
    for nothing)."""
