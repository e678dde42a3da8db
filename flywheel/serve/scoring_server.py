"""Scoring what a policy sampled, on a judge's server (`serve.role: judge`): how hint
distillation's teacher gets its log-probabilities; and the promotion gate's evaluation server
(`serve.role: eval`), which answers the gate's suites with the versions it compares.

- `POST /engine/generate`: SGLang's native `/generate` on the server's engine, as is, but on the
  base only: a body naming a LoRA adapter (`lora_path`) is refused (400), so that no key reaches
  a tenant's adapter through it; on the evaluation server the operator's requests (the gate's)
  may name the two adapters the gate loads (`adapter_names.GATE_SIDES`), and nothing else may.
- `POST /engine/score` `{"messages", "output_ids", "temperature"}`: the chat `messages` rendered
  through the server's chat template as for a request (the teacher's prompt: the turn's context
  with its hint), followed by `output_ids` (the tokens the policy sampled), scored with one
  prefill-only engine request (SGLang's `/generate` with `input_ids`, `return_logprob`,
  `logprob_start_len` = the prompt's length − 1, `max_new_tokens: 0`, at `temperature`);
  answers `{"logprobs": [log π(output_ids[i] | prompt, output_ids[:i])...], "prompt_tokens"}`;
  with `"top_k": k` also the k likeliest tokens of each of those positions' distributions,
  `"top_ids"` and `"top_logprobs"` (one list of k per output token, likeliest first; SGLang's
  `top_logprobs_num` and `input_top_logprobs`): a teacher's distribution for dense distillation.

- `POST /engine/update_weights_from_disk` `{"model_path", "weight_version"}` (`serve.role: eval`
  only): SGLang's route, loading any version, older ones too (the gate goes back and forth).
- `POST /engine/load_lora_adapter` `{"lora_name", "lora_path"}` (`serve.role: eval` only):
  SGLang's route; the gate loads the two versions of an adapter it compares under those names.
  This and the weights route are the operator's (`request.state.operator`, flywheel/serve/ops/auth.py):
  with an admin key, it alone opens them; a tenant's key gets 403. (Promotion with tenants' keys
  needs `serve.admin_key`: the configuration says so.)

With adapters (`FlywheelConfig.base_teaches`) the policy's own server has `/engine/score` too: its
base, with no adapter, is the frozen starting model, so the teacher needs no server of its own.

Both score and generate with the bare base, never a LoRA adapter (the base is the frozen judge and
hint teacher). All sit under `/engine/`, which needs a client key when the server has keys (`flywheel/serve/ops/auth.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from flywheel.models.adapter_names import GATE_SIDES
from flywheel.serve.api.chat import ChatCompletionRequest, Message
from flywheel.serve.api.errors import APIError, translated
from flywheel.serve.api.sessions import session_of
from flywheel.serve.api.validation import Body
from flywheel.serve.backends.base import EngineClient, EngineError
from flywheel.serve.backends.pool import EnginePool
from flywheel.serve.prompts import PromptBuilder


class ScoreRequest(Body):
    messages: list[Message] = Field(min_length=1)
    output_ids: list[int] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=0, le=20)


class LoadRequest(Body):
    model_path: str = Field(min_length=1)
    weight_version: int = Field(ge=0)


class AdapterLoadRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


async def rendered(prompts: PromptBuilder, model_name: str, messages: list[Message], opening: str = "") -> list[int]:
    """The prompt's token ids of chat `messages`, rendered through the server's chat template as a
    request's are (no session: nothing a gateway adds to a person's requests), ending with
    `opening`, the start of the reply the served memory writes (`memory.opening`)."""
    chat = translated(lambda: ChatCompletionRequest(model=model_name, messages=messages))
    prompt_ids, *_ = await prompts.chat(chat, replace(session_of({}, None, None), opening=opening))
    return prompt_ids


async def input_logprobs(engine: EngineClient, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0,
                         top_k: int = 0) -> dict[str, Any]:
    """The engine's `meta_info` for `output_ids` after `prompt_ids`, scored in one prefill-only
    request on its base (see the module's `/engine/score`): `input_token_logprobs[1:]` are the
    output's, with `top_k` also `input_top_logprobs[1:]`. `EngineError` if the engine cannot."""
    scored = await engine.generate({
        "input_ids": prompt_ids + output_ids, "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1,
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
        **({"top_logprobs_num": top_k} if top_k else {}),
    })
    return scored["meta_info"]


def output_logprobs(meta: dict[str, Any]) -> list[float]:
    """The output's log-probabilities in `input_logprobs`' answer."""
    return [entry[0] for entry in meta["input_token_logprobs"][1:]]


def operator_only(request: Request) -> None:
    if not getattr(request.state, "operator", False):
        raise APIError(403, "this route is the operator's: send the admin key", code="permission_denied")


def install_scoring_routes(app: FastAPI, pool: EnginePool, prompts: PromptBuilder, model_name: str,
                           loads_weights: bool = False, generates: bool = True) -> None:
    """The routes above; `/engine/generate` only if `generates`, the weights route only if `loads_weights`."""
    engine = pool.engines[0]

    if loads_weights:
        @app.post("/engine/update_weights_from_disk")
        async def load(body: LoadRequest, request: Request) -> dict[str, Any]:
            operator_only(request)
            try:
                await pool.swap(body.model_path, body.weight_version, only_newer=False)
            except (OSError, ValueError) as exc:
                raise APIError(400, f"could not load {body.model_path}: {exc}") from None
            return {"success": True, "weight_version": pool.weight_version}

        @app.post("/engine/load_lora_adapter")
        async def load_adapter(body: AdapterLoadRequest, request: Request) -> dict[str, Any]:
            operator_only(request)
            if body.lora_name not in GATE_SIDES:
                raise APIError(400, f"lora_name: this server loads adapters as {' or '.join(GATE_SIDES)} only")
            try:
                await pool.load_adapter(body.lora_name, body.lora_path, pool.adapter_versions.get(body.lora_name, 0) + 1)
            except (OSError, ValueError, EngineError) as exc:
                raise APIError(400, f"could not load adapter {body.lora_name} from {body.lora_path}: {exc}") from None
            return {"success": True, "loaded_adapters": sorted(pool.adapter_versions)}

    async def generate(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object"}}, status_code=400)
        named = body.get("lora_path")
        named = [n for n in (named if isinstance(named, list) else [named]) if n is not None]
        gate = loads_weights and getattr(request.state, "operator", False)
        if named and not (gate and all(n in GATE_SIDES and n in pool.adapter_versions for n in named)):
            return JSONResponse({"error": {"message": "lora_path: this route serves the base model only"}}, status_code=400)
        try:
            return await engine.generate(body)
        except EngineError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)

    if generates:
        app.post("/engine/generate")(generate)

    @app.post("/engine/score")
    async def score(body: ScoreRequest) -> dict[str, Any]:
        prompt_ids = await rendered(prompts, model_name, body.messages)
        try:
            meta = await input_logprobs(engine, prompt_ids, body.output_ids, body.temperature, body.top_k)
        except EngineError as exc:
            raise APIError(exc.status, str(exc)) from None
        answer: dict[str, Any] = {"logprobs": output_logprobs(meta),
                                  "prompt_tokens": len(prompt_ids)}
        if body.top_k:
            tops = meta["input_top_logprobs"][1:]
            answer.update(top_ids=[[entry[1] for entry in top] for top in tops],
                          top_logprobs=[[entry[0] for entry in top] for top in tops])
        return answer
