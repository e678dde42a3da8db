"""Practice replies on the policy's server (`judge.teacher.practice`): a corrected turn's request
answered again by the same person's adapter, for the judge (flywheel/judge/practice.py).

- `POST /engine/practice` `{"adapter", "tenant", "input_ids" | "messages", "n", "sampling_params"}`:
  `n` replies to the prompt `input_ids` (the corrected turn's exact context), or to chat
  `messages` rendered through the server's chat template as a request's are
  (`judge.teacher.practice_prompt: bare`: the request without the served memory's instructions),
  each sampled as a request of that adapter would be now (`AdapterRouting.serving`: its published
  version, else what it starts from, else the bare base) with SGLang's `sampling_params` (a seed
  is dropped: the replies are to differ). Answers `{"prompt_ids", "replies": [{"output_ids",
  "logprobs", "versions", "text", "finish_reason"}, ...]}`, the prompt they answer and the replies
  recorded as a turn records them: the engine's log-probabilities of
  the tokens it sampled, and the adapter's versions (0 for every token while it has none of its
  own, the version the trainer starts it at). Under the tenant's personal-data policy
  (`tenants.NAME.pii` other than `off`) a reply that holds personal data is left out, as a turn
  holding it is never recorded (flywheel/serve/personal_data.py).

The operator's route (`serve.admin_key`: the judge's own calls). Without an admin key a client
key may name its own tenant's adapters alone, and another tenant's is the 404 of an adapter that
does not exist, as on `/v1` (flywheel/serve/adapter_routing.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field, model_validator

from flywheel.serve.adapter_routing import AdapterRouting, owned
from flywheel.serve.api.chat import Message
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.validation import Body
from flywheel.serve.backends.base import EngineError
from flywheel.serve.backends.pool import EnginePool
from flywheel.serve.engine_choice import Choice
from flywheel.serve.ops.tenants import TenantDirectory
from flywheel.serve.personal_data import PersonalData
from flywheel.serve.prompts import PromptBuilder
from flywheel.serve.scoring_server import operator_only, rendered

MAX_REPLIES = 16


class PracticeRequest(Body):
    adapter: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    input_ids: list[int] | None = Field(None, min_length=1)
    messages: list[Message] | None = Field(None, min_length=1)
    n: int = Field(ge=1, le=MAX_REPLIES)
    sampling_params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_prompt(self) -> "PracticeRequest":
        if (self.input_ids is None) == (self.messages is None):
            raise ValueError("give the prompt as input_ids or as messages, one of them")
        return self


def install_practice_route(app: FastAPI, pool: EnginePool, routing: AdapterRouting, tenants: TenantDirectory,
                           model_name: str) -> None:
    personal_data: PersonalData = app.state.personal_data
    prompts: PromptBuilder = app.state.prompts

    @app.post("/engine/practice")
    async def practice(body: PracticeRequest, request: Request) -> dict[str, Any]:
        operator_only(request)
        caller = getattr(request.state, "tenant", None)
        if caller is not None and (caller != body.tenant or not owned(body.adapter, caller)):
            raise routing.not_found(body.adapter)
        choice = routing.serving(body.adapter)
        params = {key: value for key, value in body.sampling_params.items() if key != "sampling_seed"}
        prompt_ids = (list(body.input_ids or ()) if body.messages is None
                      else await rendered(prompts, model_name, body.messages))
        engine_body = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True,
                       **({"lora_path": choice.lora_path} if choice.lora_path is not None else {})}
        engine = pool.route(body.adapter)
        try:
            responses = await asyncio.gather(*(engine.generate(dict(engine_body)) for _ in range(body.n)))
        except EngineError as exc:
            raise APIError(exc.status, str(exc)) from None
        replies = [Choice.from_response(index, f"practice-{index}", response) for index, response in enumerate(responses)]
        pii, entities = tenants.privacy_of(body.tenant)
        if pii != "off":
            held = await asyncio.to_thread(lambda: [personal_data.holds([r.text], entities) for r in replies])
            replies = [reply for reply, holds in zip(replies, held) if not holds]
        return {"prompt_ids": prompt_ids, "replies": [{"output_ids": r.output_ids, "logprobs": r.logprobs, "text": r.text,
                             "versions": choice.recorded_versions(r.versions), "finish_reason": r.finish_reason}
                            for r in replies]}
