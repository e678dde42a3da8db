"""The embedded engine's own decode step for Llama-family decoders (Llama, Qwen2): the model's
weights laid out for one-token-per-row steps, and a forward pass written for them.

transformers' forward is written for every use (training, any cache, any mask); a decode step
of the engine is one narrow case, run thousands of times a minute, and on a CPU its cost is the
weights' matrix products (~70 % of a step, docs/experiments/engine-vs-vllm.md). `Decoder` keeps, next to the
model's own parameters, a copy of each layer's projections fused (q, k and v as one matrix, gate
and up as one) and, where oneDNN serves the dtype, packed into oneDNN's blocked layout once
(`torch.ops.mkldnn._reorder_linear_weight`), so a step neither re-lays out the weights nor runs
seven products per layer where four do. Its forward does what transformers' does for these
models, in the same order and dtypes (RMSNorm in float32, rotary embedding from the model's own
`rotary_emb`, so scaled ropes are as the model defines them; attention by torch's fused
`scaled_dot_product_attention`, as transformers' default, over the engine's `KVBatch` columns,
in spans of slots each over its own longest row), and nothing else: logits agree with
transformers' to float rounding (tests/test_engine_decoder.py). A row's query heads that share a
KV head attend as one short query sequence over it, so the cache is never repeated per query
head; in bfloat16 that kernel took a decode step from 80 to 70 ms against two batched products
(docs/experiments/engine-vs-vllm.md).

Rows with LoRA adapters (`flywheel.models.lora_batch.Rows`) get their low-rank deltas added to
each fused product's output, per layer it holds (q, k and v each their own), the rows' inputs
gathered once per product; a step without adapter rows runs no LoRA code at all.

The copy costs memory (about the model's linear weights once more) and must follow the model:
after a weight update, `refresh()` rebuilds it (the engine does, between two steps). Models this
file does not know (other architectures, sliding windows, query/key norms) get `None` from
`Decoder.build` and the engine keeps transformers' forward. Prefill keeps transformers' forward:
it is a few large products per prompt, where the layout matters less.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flywheel.models.lora_batch import FixedRows, Rows

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2")
Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Product:
    """One fused product of a layer, and the model's linear layers whose weights it holds, in
    the order of its output's columns (where their adapters' deltas go)."""

    linear: Linear
    layers: tuple[torch.nn.Linear, ...]

    def __call__(self, x: torch.Tensor, lora: Rows | FixedRows | None) -> torch.Tensor:
        out = self.linear(x)
        if lora is not None:
            lora.add(out, x, self.layers)
        return out


@dataclass
class _Layer:
    qkv: _Product
    out: _Product
    gate_up: _Product
    down: _Product
    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    act: Callable[[torch.Tensor], torch.Tensor]


class Decoder:
    """A decode step over the engine's KV cache for one Llama-family model (see module docstring)."""

    def __init__(self, model: torch.nn.Module, rows_hint: int):
        config = model.config
        self.model = model
        self.rows_hint = rows_hint
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = 1 / math.sqrt(self.head_dim)
        self.generation = 0
        """Counts `refresh`es: what holds the fused weights (a captured CUDA graph) must take them again."""
        self.refresh()

    @classmethod
    def build(cls, model: torch.nn.Module, rows_hint: int) -> "Decoder | None":
        """A `Decoder` for `model`, or None when its architecture is not one this file implements."""
        reason = _unsupported(model)
        if reason:
            log.info("engine: transformers' forward for decode steps (%s)", reason)
            return None
        return cls(model, rows_hint)

    def refresh(self) -> None:
        """Rebuild the fused (and packed) weights from the model's parameters: after a weight update."""
        self.generation += 1  # first: a refresh that raises half-way leaves no graph on the old weights
        body = self.model.model
        pack = _packer(next(self.model.parameters()), self.rows_hint)
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                qkv=_fused(pack, attn.q_proj, attn.k_proj, attn.v_proj),
                out=_fused(pack, attn.o_proj),
                gate_up=_fused(pack, mlp.gate_proj, mlp.up_proj),
                down=_fused(pack, mlp.down_proj),
                input_norm=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                post_norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                act=mlp.act_fn,
            ))
        self.norm = (body.norm.weight, body.norm.variance_epsilon)
        self.head = pack(self.model.lm_head.weight, self.model.lm_head.bias)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
             spans: list[tuple[int, int, torch.Tensor]], lora: Rows | FixedRows | None = None) -> torch.Tensor:
        """One token per row: `tokens` [rows] at `positions` [rows] (each row's column in the cache);
        writes their keys and values into `keys`/`values` (per layer [slots, kv heads, columns, head
        dim]) and attends span by span: rows [start, end) over the columns where their `visible`
        [rows in span, columns] is true (`KVBatch._spans`); each row with the adapter of its row in
        `lora`, if any. Returns next-token logits [rows, vocab] in float32."""
        rows = len(tokens)
        hidden = self.model.model.embed_tokens(tokens)
        cos, sin = self.model.model.rotary_emb(hidden, positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [rows, 1, head dim]
        slots = torch.arange(rows, device=tokens.device)
        hidden_q, hidden_kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        group = self.heads // self.kv_heads
        spans = [(start, end, visible[:, None, None, :]) for start, end, visible in spans]
        for layer, layer_keys, layer_values in zip(self.layers, keys, values):
            normed = _rms_norm(hidden, *layer.input_norm)
            q, k, v = layer.qkv(normed, lora).split([hidden_q, hidden_kv, hidden_kv], dim=-1)
            q = _rotate(q.view(rows, self.heads, self.head_dim), cos, sin)
            k = _rotate(k.view(rows, self.kv_heads, self.head_dim), cos, sin)
            layer_keys[slots, :, positions] = k
            layer_values[slots, :, positions] = v.view(rows, self.kv_heads, self.head_dim)
            q = q.view(rows, self.kv_heads, group, self.head_dim)
            context = torch.cat([
                F.scaled_dot_product_attention(q[start:end], layer_keys[start:end, :, :visible.shape[-1]],
                                               layer_values[start:end, :, :visible.shape[-1]], attn_mask=visible, scale=self.scale)
                for start, end, visible in spans])
            hidden = hidden + layer.out(context.reshape(rows, hidden_q), lora)
            gate, up = layer.gate_up(_rms_norm(hidden, *layer.post_norm), lora).chunk(2, dim=-1)
            hidden = hidden + layer.down(layer.act(gate) * up, lora)
        return self.head(_rms_norm(hidden, *self.norm)).float()


def _unsupported(model: torch.nn.Module) -> str | None:
    config = model.config
    if config.model_type not in ARCHITECTURES:
        return f"model type {config.model_type!r}"
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "sliding-window attention"
    if not hasattr(model, "lm_head") or not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "no lm_head or rotary embedding where Llama has them"
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm") or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention projections unlike Llama's"
        if not all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "an MLP unlike Llama's"
    return None


def _fused(pack: Callable[[torch.Tensor, torch.Tensor | None], Linear], *linears: torch.nn.Linear) -> _Product:
    """One product over `linears` (same input): their weights and biases concatenated, packed."""
    weight = linears[0].weight if len(linears) == 1 else torch.cat([linear.weight for linear in linears])
    return _Product(pack(weight, _cat_bias(*linears)), linears)


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else linear.weight.new_zeros(linear.out_features) for b, linear in zip(biases, linears)])


def _packer(example: torch.Tensor, rows_hint: int) -> Callable[[torch.Tensor, torch.Tensor | None], Linear]:
    """How weights become products here: oneDNN-packed where it serves this dtype on the CPU
    (checked once against `F.linear`), else plain `F.linear` over the fused weights."""
    if example.device.type == "cpu" and _onednn_serves(example.dtype, rows_hint):
        def packed(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
            bias = None if bias is None else bias.detach()
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")
        return packed

    def plain(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        return lambda x: F.linear(x, weight, bias)
    return plain


_ONEDNN: dict[torch.dtype, bool] = {}


def _onednn_serves(dtype: torch.dtype, rows_hint: int) -> bool:
    if dtype not in _ONEDNN:
        try:
            weight, x = torch.randn(48, 64).to(dtype), torch.randn(5, 64).to(dtype)
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
            got = torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")
            _ONEDNN[dtype] = torch.allclose(got.float(), F.linear(x, weight).float(), rtol=1e-2, atol=1e-2)
        except (RuntimeError, AttributeError):
            _ONEDNN[dtype] = False
    return _ONEDNN[dtype]


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, scaled by the weight after the cast back."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it (rotate_half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
