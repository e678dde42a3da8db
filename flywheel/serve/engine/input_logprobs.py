"""Input token log-probabilities: how likely the model finds tokens it did not sample (SGLang's
`return_logprob` with `logprob_start_len`, `input_token_logprobs`).

A prefill-only request (`max_new_tokens: 0`) that asks for them scores a given continuation
under a given context in one forward pass and generates nothing: how a teacher's log-probability
of every token a policy sampled is obtained for on-policy distillation. The shape is SGLang's
(`scheduler_output_processor_mixin`): entries for positions `logprob_start_len` .. n−1, entry j
being log P(ids[start + j] | ids[:start + j]) at the request's temperature (as its output
log-probabilities are), and entry 0 None (SGLang computes logits from `start` on, each predicting
the next token, then prepends None and drops the prediction of the token after the last). So
the log-probability of a token at position p needs `logprob_start_len` ≤ p − 1.

With `top_logprobs_num` k > 0 the same positions also get SGLang's `input_top_logprobs`: the k
likeliest tokens of each position's distribution as (token id, log-probability), likeliest first,
entry 0 None. Hint distillation's dense form reads a teacher's whole distribution this way
(OpenClaw-RL's top-K distillation).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from flywheel.models.lora_batch import Rows, applied
from flywheel.serve.engine.kv_cache import attention_kernels

log = logging.getLogger(__name__)


def score_input(model: torch.nn.Module, request: Any, lora: Rows | None = None) -> None:
    """Fill `request.input_logprobs` if it asks for them (`logprob_start_len` >= 0), under its
    adapter (`lora`'s one row), if any; a failure marks the request failed, and only it."""
    start = request.params.logprob_start_len
    if start < 0 or request.input_logprobs is not None:
        return
    try:
        request.input_logprobs, request.input_top_logprobs = input_logprobs(
            model, request.input_ids, start, request.params.temperature, request.params.top_logprobs_num, lora)
    except Exception as exc:
        log.exception("scoring the input of request %s failed", request.rid)
        request.mark_failed(f"scoring its input raised: {exc}")


TopLogprobs = list[tuple[int, float]]


def input_logprobs(model: torch.nn.Module, ids: list[int], start: int, temperature: float, top_n: int = 0,
                   lora: Rows | None = None) -> tuple[list[float | None], list[TopLogprobs | None] | None]:
    """SGLang's `input_token_logprobs` values for `ids` from position `start`, and with `top_n`
    its `input_top_logprobs` as (id, logprob) pairs (else None), with the adapter of `lora`'s one
    row, if any; see the module."""
    start = min(start, len(ids) - 1)
    inputs = torch.tensor([ids], device=next(model.parameters()).device)
    with attention_kernels(inputs.device), applied(lora):
        logits = model(input_ids=inputs, use_cache=False).logits[0, start:-1].float()
    if temperature > 0:
        logits = logits / temperature
    targets = inputs[0, start + 1:].unsqueeze(1)
    logp = torch.log_softmax(logits, dim=-1)
    values = logp.gather(1, targets).squeeze(1)
    if not top_n:
        return [None, *values.tolist()], None
    top = logp.topk(top_n, dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    return [None, *values.tolist()], [None, *tops]
