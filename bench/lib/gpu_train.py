"""The trainer's half of `bench/gpu_path.py`: the engine's behaviour log-probs against the
trainer's recompute (`logprob_part`), and `Trainer.step` on the device (`train_part`); see
`bench/gpu_path.py` for what is measured and how to run it."""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import time
from typing import Any, Callable

import torch

from bench.lib.workload import mixed_requests, training_rows
from flywheel.bus import Segment
from flywheel.config import load_config
from flywheel.train.packing import MicroBatch, Row, micro_batches
from flywheel.train.trainer import Trainer


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _trainer(model: torch.nn.Module, args: Any, *overrides: str) -> Trainer:
    config = load_config(None, [f"train.device={args.device}", f"train.micro_batch_tokens={args.budget}",
                                "actor.ppo_n_minibatches=1", *overrides])
    return Trainer(model, config.actor, config.train)


def _sample(args: Any, build: Callable, dtype: str) -> tuple[list[Row], int]:
    """The engine at `dtype` answers `args.lp_requests` chat prompts with `args.lp_tokens` tokens
    each (temperature 1); each answer becomes one training row carrying the engine's logprobs."""
    from flywheel.serve.engine import Engine, SamplingParams

    model, tokenizer = build(args, dtype)
    engine = Engine(model, tokenizer, max_batch_size=32).start()
    requests = mixed_requests(tokenizer, args.lp_requests, [args.lp_tokens], [1], args.seed + 2)
    params = SamplingParams(max_new_tokens=args.lp_tokens, temperature=1.0, ignore_eos=True)

    async def go() -> list:
        return await asyncio.gather(*(engine.generate(r["prompt_ids"], params) for r in requests))

    try:
        results = asyncio.run(go())
    finally:
        engine.stop()
    rows = []
    for r in results:
        prompt, output = len(r.prompt_ids), len(r.output_ids)
        segment = Segment(token_ids=r.prompt_ids + r.output_ids, loss_mask=[0] * prompt + [1] * output,
                          logprobs=[0.0] * prompt + list(r.logprobs), versions=[-1] * prompt + [0] * output)
        rows.append(Row(segment, [0.0] * (prompt + output)))
    engine = model = None  # the engine's model leaves the GPU before the next one is built
    _free(args.device)
    return rows, len(tokenizer)


def _gaps(trainer: Trainer, batches: list[MicroBatch], eps: float, cap: float | None) -> dict[str, Any]:
    diffs = []
    with torch.no_grad():
        for batch in batches:
            logp = trainer.token_logprobs(batch).logp
            own = batch.loss_mask.bool() & (batch.versions == 0)
            diffs.append((logp - batch.behav_logp)[own].double().cpu())
    d = torch.cat(diffs)
    weight = d.exp()  # pi_prox / pi_behav
    return {
        "tokens": d.numel(), "gap_mean": float(d.abs().mean()), "gap_max": float(d.abs().max()),
        "gap_p99": float(d.abs().quantile(0.99)), "signed_mean": float(d.mean()),
        "weight_mean": float(weight.mean()), "weight_min": float(weight.min()), "weight_max": float(weight.max()),
        "weight_outside_clip": float(((weight - 1).abs() > eps).double().mean()),
        "weight_above_cap": float((weight > cap).double().mean()) if cap else None,
    }


def logprob_part(args: Any, build: Callable) -> list[dict[str, Any]]:
    """Per engine dtype: |engine logprob - trainer logprob| on every sampled token, the trainer
    recomputing as `Trainer._proximal` does, with `train.autocast` (bf16 on CUDA) and without."""
    out = []
    trainer_model, _ = build(args, "float32")
    trainers = {"autocast": _trainer(trainer_model, args)}
    if args.device.startswith("cuda"):  # a CPU never autocasts: the one trainer is float32
        trainers["float32"] = _trainer(trainer_model, args, "train.autocast=false")
    eps, cap = trainers["autocast"].actor.eps_clip, trainers["autocast"].actor.behav_imp_weight_cap
    for dtype in args.lp_dtypes:
        rows, _ = _sample(args, build, dtype)
        for recompute, trainer in trainers.items():
            batches = [trainer._to_device(b) for b in micro_batches(rows, args.budget, pad_id=0)]
            _, reported = trainer._proximal([batches], 0)  # what the trainer's metric says
            gaps = _gaps(trainer, batches, eps, cap)
            mode = "bf16 autocast" if args.device.startswith("cuda") and recompute == "autocast" else "float32"
            out.append({"engine_dtype": dtype, "recompute": mode, **gaps, "trainer_metric_gap": reported.mean})
            print(f"  engine {dtype} vs trainer {mode}: mean |gap| {gaps['gap_mean']:.3g}, max {gaps['gap_max']:.3g} over "
                  f"{gaps['tokens']} tokens", flush=True)
    del trainers, trainer_model
    _free(args.device)
    return out


def _bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[MicroBatch], autocast: bool) -> None:
    """The least a step can do (bench/trainer_efficiency.py's bare loop), under the trainer's autocast."""
    optimizer.zero_grad(set_to_none=True)
    total = float(sum(b.loss_mask.sum() for b in batches))
    for b in batches:
        with torch.autocast(device_type="cuda" if autocast else "cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, b.input_ids[:, 1:, None]).squeeze(2)
        loss = -(b.advantages[:, 1:] * logp * b.loss_mask[:, 1:]).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _timed(step: Callable[[], Any], repeats: int, device: str) -> list[float]:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - started)
    return times


def train_part(args: Any, build: Callable) -> list[dict[str, Any]]:
    model, tokenizer = build(args, "float32")
    rows = training_rows(args.train_samples, len(tokenizer), args.seed)
    packed = micro_batches(rows, args.budget, pad_id=0, packing=True)
    real, computed = sum(len(r) for r in rows), sum(b.computed_tokens for b in packed)
    cuda = args.device.startswith("cuda")
    out = []

    def record(variant: str, times: list[float], extra: dict | None = None) -> None:
        step = statistics.median(times)
        out.append({"variant": variant, "step_s": step, "steps_s": times, "real_tokens": real, "computed_tokens": computed,
                    "micro_batches": len(packed), "real_tokens_per_s": real / step, "computed_tokens_per_s": computed / step,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, **(extra or {})})
        print(f"  train {variant}: {step:.3f} s/step, {real / step:.0f} real tok/s", flush=True)

    variants = {"standard PPO": ("actor.use_decoupled_loss=false", "actor.recompute_logprobs=false"), "decoupled PPO": (),
                "decoupled PPO, float32 (train.autocast=false)": ("train.autocast=false",)}
    if "train" in args.parts:
        for variant, overrides in variants.items():
            _free(args.device)
            trainer = _trainer(model, args, *overrides)
            metrics: dict = {}
            times = _timed(lambda: metrics.update(trainer.step([packed], version=0)), args.train_repeats, args.device)
            record(variant, times, {"trainer_step_s": metrics["step_s"], "loss": metrics["loss"]})
            del trainer
        _free(args.device)
        device_batches = [MicroBatch(**{k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in vars(b).items()})
                          for b in packed]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        record("bare loop", _timed(lambda: _bare_step(model, optimizer, device_batches, cuda), args.train_repeats, args.device))
        del optimizer, device_batches
    if "fsdp" in args.parts and cuda:
        out.append(_fsdp(args, build, packed, record))
    return out


def _fsdp(args: Any, build: Callable, packed: list[MicroBatch], record: Callable) -> dict[str, Any]:
    """The decoupled step with `train.fsdp: true` on a one-rank process group (what `torchrun
    --nproc-per-node 1` gives); an error is reported, not raised."""
    import torch.distributed as dist

    _free(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    try:
        dist.init_process_group("nccl", rank=0, world_size=1)
        model, _ = build(args, "float32")
        trainer = _trainer(model, args, "train.fsdp=true")
        times = _timed(lambda: trainer.step([packed], version=0), args.train_repeats, args.device)
        record("decoupled PPO, FSDP2 on 1 rank", times)
        return {"variant": "fsdp", "ok": True}
    except Exception as exc:  # reported, not raised
        print(f"  fsdp failed: {exc!r}", flush=True)
        return {"variant": "fsdp", "ok": False, "error": repr(exc)[:2000]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
