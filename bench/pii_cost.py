"""PII detection cost: what `flywheel.privacy.find` adds per request on the gateway's hot path.

What it measures
    Seeded synthetic chat requests shaped like an agent's traffic: 2-6 messages (an optional
    system prompt, then user, assistant and tool turns) of 50-2,000 characters each (log-uniform),
    made of prose, code, logs, JSON tool output and, in one message in five, personal data
    (e-mail, phone, card, IBAN, SSN, IP); and a reply of 100-1,500 characters. The gateway calls
    `find` on every message's text and on the reply (and `redact` on user and tool texts, whose
    `find` is then a cache hit), so per request:

    - cold: `find` over all messages and the reply with a detector without cache (every text
      new to it): µs per text by length, and µs per request; median and p90.
    - next turn: the same conversation one turn later (earlier messages again, the previous
      reply, one new user message, a new reply) through a detector with its cache, as a chat
      client resends history: µs per request.
    - where the time goes: on the longest texts, the tokenizer, each recognizer alone, and the
      rest (Presidio's context enhancement, copies, de-duplication).
    - baseline: the same texts through Presidio's stock parts for the same entity types (a blank
      spaCy pipeline as NLP engine, the stock phone and IP recognizers, context words matched
      as substrings): what `flywheel.privacy`'s adjustments saved.
    - serving: the time the request costs to serve, by default from the repository's own
      gateway benchmark (bench/results/gateway_overhead_smollm2-135m.json, SmolLM2-135M, 32
      streams on this 2-core machine, through the gateway): CPU per output token (engine and
      gateway threads) × output tokens, and TTFT p50 + TPOT p50 × output tokens, with output
      tokens = reply characters / `--chars-per-token` (4). Prefill is not counted, so the serving
      cost is low and the share high. Or, with `--engine MODEL`, a few of the requests served
      one at a time by the embedded engine in this process (the chat template applied, the
      reply's token count generated with `ignore_eos`): wall and CPU time each.

    Reported: median and p90 µs per request and per text length, and `find`'s share of the
    serving CPU and of the request's latency. Each timed phase waits (up to 90 s) for other
    processes to use under 0.25 cores, and records what they used.

How to run (from the repository root)
    .venv/bin/python bench/pii_cost.py --short          # 40 requests
    .venv/bin/python bench/pii_cost.py                  # 300 requests
    options: --requests N --seed S --engine smollm2-135m --no-baseline
             --serve-cpu-ms-per-token X --serve-tpot-ms X --serve-ttft-ms X --chars-per-token X
    Writes bench/results/pii_cost.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    RESULTS,
    CpuWatch,
    machine,
    median,
    percentile,
    quiet_logs,
    table,
    wait_quiet,
    write_result,
)
from bench.lib.pii_requests import BUCKETS, bucket, make_requests, next_turn, request_texts  # noqa: E402

GATEWAY_RESULT = RESULTS / "gateway_overhead_smollm2-135m.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="40 requests instead of 300")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default=None, help="also serve a few requests in-process with this model")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--serve-cpu-ms-per-token", type=float, default=None)
    p.add_argument("--serve-tpot-ms", type=float, default=None)
    p.add_argument("--serve-ttft-ms", type=float, default=None)
    p.add_argument("--chars-per-token", type=float, default=4.0)
    args = p.parse_args()
    args.requests = args.requests or (40 if args.short else 300)
    return args


def stock_analyzer(entities):
    """Presidio's stock parts for `entities`: a blank spaCy pipeline as the NLP engine (what a
    saved `spacy.blank("en")` given to `SpacyNlpEngine` amounts to), the stock recognizers
    (the e-mail one made offline: not a speed matter), the default context enhancer."""
    import presidio_analyzer.predefined_recognizers as predefined
    import spacy
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.nlp_engine import SpacyNlpEngine

    from flywheel.privacy.adjusted import OfflineEmail
    from flywheel.privacy.entities import RECOGNIZERS

    class BlankSpacy(SpacyNlpEngine):
        def load(self) -> None:
            self.nlp = {"en": spacy.blank("en")}

    nlp = BlankSpacy()
    nlp.load()
    recognizers = [OfflineEmail() if RECOGNIZERS[e] == "EmailRecognizer" else getattr(predefined, RECOGNIZERS[e])(supported_language="en")
                   for e in entities]
    return AnalyzerEngine(registry=RecognizerRegistry(recognizers=recognizers, supported_languages=["en"]),
                          nlp_engine=nlp, supported_languages=["en"])


def stats(values: list[float]) -> dict:
    return {"n": len(values), "median": median(values), "p90": percentile(values, 90), "max": max(values, default=None)}


def timed_find(detector, text: str) -> float:
    t0 = time.perf_counter_ns()
    detector.find(text)
    return (time.perf_counter_ns() - t0) / 1e3



def cold(requests: list[dict]) -> dict:
    from flywheel.privacy import Detector

    detector = Detector(cache_size=0)
    by_bucket: dict[str, list[float]] = {name: [] for name, _, _ in BUCKETS}
    per_request, chars = [], []
    for request in requests:
        total = 0.0
        for text in request_texts(request):
            us = timed_find(detector, text)
            by_bucket[bucket(len(text))].append(us)
            total += us
        per_request.append(total)
        chars.append(sum(map(len, request_texts(request))))
    return {"per_request_us": stats(per_request), "chars_per_request": stats(chars),
            "per_text_us": {name: stats(v) for name, v in by_bucket.items()},
            "us_per_kchar": sum(per_request) / sum(chars) * 1e3}


def warm_turns(requests: list[dict], seed: int) -> dict:
    from flywheel.privacy import Detector

    detector, rng, per_request = Detector(), random.Random(seed + 1), []
    for request in requests:
        for text in request_texts(request):
            detector.find(text)  # the turn before: everything it sent is now cached
        later = next_turn(rng, request)
        per_request.append(sum(timed_find(detector, t) for t in request_texts(later)))
    return {"per_request_us": stats(per_request)}


def breakdown(texts: list[str]) -> dict:
    """µs per text of the tokenizer, each recognizer alone, and the whole `find`."""
    from flywheel.privacy import DEFAULT_ENTITIES, LANGUAGE, Detector
    from flywheel.privacy.engine import analyzer

    engine = analyzer()
    recognizers = engine.registry.get_recognizers(language=LANGUAGE, entities=list(DEFAULT_ENTITIES))
    t0 = time.perf_counter()
    artifacts = [engine.nlp_engine.process_text(t, LANGUAGE) for t in texts]
    parts = {"tokenizer (nlp engine)": (time.perf_counter() - t0) / len(texts) * 1e6}
    for r in recognizers:
        t0 = time.perf_counter()
        for text, a in zip(texts, artifacts):
            r.analyze(text, r.supported_entities, a)
        parts[r.name] = (time.perf_counter() - t0) / len(texts) * 1e6
    detector = Detector(cache_size=0)
    total = sum(timed_find(detector, t) for t in texts) / len(texts)
    top = dict(sorted(parts.items(), key=lambda kv: -kv[1]))
    return {"texts": len(texts), "mean_chars": sum(map(len, texts)) / len(texts), "find_mean_us": total,
            "parts_mean_us": top, "recognizers": len(recognizers),
            "rest_mean_us (context words, de-duplication, rules)": total - sum(parts.values())}


def baseline(requests: list[dict]) -> dict:
    """The same texts through stock Presidio parts, for the same entity types."""
    from flywheel.privacy import DEFAULT_ENTITIES, LANGUAGE

    engine = stock_analyzer(DEFAULT_ENTITIES)
    texts = [t for r in requests for t in request_texts(r)]
    for t in texts[:5]:
        engine.analyze(t, language=LANGUAGE, entities=list(DEFAULT_ENTITIES), score_threshold=0.4)
    by_bucket: dict[str, list[float]] = {name: [] for name, _, _ in BUCKETS}
    per_request = []
    for r in requests:
        total = 0.0
        for text in request_texts(r):
            t0 = time.perf_counter_ns()
            engine.analyze(text, language=LANGUAGE, entities=list(DEFAULT_ENTITIES), score_threshold=0.4)
            us = (time.perf_counter_ns() - t0) / 1e3
            by_bucket[bucket(len(text))].append(us)
            total += us
        per_request.append(total)
    return {"per_request_us": stats(per_request), "per_text_us": {k: stats(v) for k, v in by_bucket.items()}}


def serving_defaults(args: argparse.Namespace) -> dict:
    src = {"source": "command line"}
    cpu, tpot, ttft = args.serve_cpu_ms_per_token, args.serve_tpot_ms, args.serve_ttft_ms
    if GATEWAY_RESULT.exists():
        g = json.loads(GATEWAY_RESULT.read_text())["summary"]["gateway"]
        share = g["cpu_share"]
        cpu = cpu if cpu is not None else (share["engine_us"] + share["front_us"]) / 1e3
        tpot = tpot if tpot is not None else g["tpot_p50_ms"]
        ttft = ttft if ttft is not None else g["ttft_p50_ms"]
        src = {"source": f"{GATEWAY_RESULT.relative_to(RESULTS.parent.parent)} (summary.gateway), unless given"}
    cpu, tpot, ttft = cpu or 10.94, tpot or 126.9, ttft or 2267.0  # that file's figures, if it is gone
    return {**src, "cpu_ms_per_output_token": cpu, "tpot_ms": tpot, "ttft_ms": ttft,
            "chars_per_token": args.chars_per_token}


def shares(requests: list[dict], per_request_us: list[float], serve: dict) -> dict:
    cpu_share, latency_share, cpu_ms, latency_ms = [], [], [], []
    for r, us in zip(requests, per_request_us):
        tokens = max(1, math.ceil(len(r["reply"]) / serve["chars_per_token"]))
        cpu = serve["cpu_ms_per_output_token"] * tokens
        latency = serve["ttft_ms"] + serve["tpot_ms"] * tokens
        cpu_ms.append(cpu)
        latency_ms.append(latency)
        cpu_share.append(us / 1e3 / cpu)
        latency_share.append(us / 1e3 / latency)
    return {"serving_cpu_ms": stats(cpu_ms), "serving_latency_ms": stats(latency_ms),
            "share_of_serving_cpu": stats(cpu_share), "share_of_latency": stats(latency_share),
            "total_share_of_serving_cpu": sum(per_request_us) / 1e3 / sum(cpu_ms)}


def served_in_process(model_name: str, requests: list[dict], chars_per_token: float) -> list[dict]:
    import asyncio

    import torch

    from bench.lib.workload import render
    from flywheel.models import load_model
    from flywheel.serve.engine import Engine, SamplingParams

    torch.set_num_threads(2)
    model, tokenizer = load_model(model_name)
    engine = Engine(model, tokenizer, max_batch_size=1).start()
    out = []
    try:
        for i, r in enumerate([requests[0], *requests]):
            ids = render(tokenizer, r["messages"])
            tokens = max(1, math.ceil(len(r["reply"]) / chars_per_token))
            params = SamplingParams(max_new_tokens=tokens if i else 4, temperature=1.0, ignore_eos=True)
            c0, t0 = time.process_time(), time.perf_counter()
            asyncio.run(engine.generate(ids, params))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if i:  # the first is a warm-up
                out.append({"prompt_tokens": len(ids), "output_tokens": tokens, "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3})
    finally:
        engine.stop()
    return out


def main() -> None:
    args = parse_args()
    quiet_logs()
    from flywheel.privacy import load

    t0 = time.perf_counter()
    load()
    load_s = time.perf_counter() - t0
    requests = make_requests(args.requests, args.seed)
    from flywheel.privacy import Detector

    warm = Detector(cache_size=0)
    for r in requests[:3]:
        for t in request_texts(r):
            warm.find(t)  # compile every pattern once, untimed

    result: dict = {"requests": args.requests, "seed": args.seed, "machine": machine(None), "load_s": load_s}
    phases = [("cold", lambda: cold(requests)), ("next_turn", lambda: warm_turns(requests, args.seed)),
              ("breakdown", lambda: breakdown(sorted((t for r in requests for t in request_texts(r)), key=len)[-20:]))]
    if not args.no_baseline:
        phases.append(("baseline", lambda: baseline(requests[: max(10, args.requests // 4)])))
    for name, run in phases:
        quiet = wait_quiet()
        watch = CpuWatch().start()
        result[name] = run()
        result[name]["noise"] = {**watch.stop(), "waited_for_quiet": quiet}
    serve = serving_defaults(args)
    result["serving"] = serve
    # per-request cold cost again, kept per request this time, to pair each with its own reply length
    detector = Detector(cache_size=0)
    paired = [sum(timed_find(detector, t) for t in request_texts(r)) for r in requests]
    result["share"] = shares(requests, paired, serve)
    if args.engine:
        served = served_in_process(args.engine, requests[:2 if args.short else 5], args.chars_per_token)
        result["engine"] = {"model": args.engine, "requests": served}
        result["engine"]["share_of_wall"] = [p / 1e3 / s["wall_ms"] for p, s in zip(paired, served)]
        result["engine"]["share_of_cpu"] = [p / 1e3 / s["cpu_ms"] for p, s in zip(paired, served)]

    c = result["cold"]
    print(f"\nflywheel.privacy.find, default entity types ({args.requests} requests, seed {args.seed}); engine built in {load_s:.2f} s\n")
    rows = [[name, c["per_text_us"][name]["n"], c["per_text_us"][name]["median"], c["per_text_us"][name]["p90"],
             (result.get("baseline") or {}).get("per_text_us", {}).get(name, {}).get("median")] for name, _, _ in BUCKETS]
    print(table(["text length", "texts", "median us", "p90 us", "stock Presidio median us"], rows))
    pr, nt = c["per_request_us"], result["next_turn"]["per_request_us"]
    print(f"\nper request (all messages + reply, {c['chars_per_request']['median']:.0f} chars median): "
          f"cold median {pr['median']:.0f} us, p90 {pr['p90']:.0f} us; next turn with the cache median "
          f"{nt['median']:.0f} us, p90 {nt['p90']:.0f} us; {c['us_per_kchar']:.0f} us per 1,000 chars")
    if "baseline" in result:
        b = result["baseline"]["per_request_us"]
        print(f"stock Presidio parts, same texts: per request median {b['median']:.0f} us, p90 {b['p90']:.0f} us")
    s = result["share"]
    print(f"\nserving ({serve['source']}): CPU {serve['cpu_ms_per_output_token']:.2f} ms/token, "
          f"TTFT {serve['ttft_ms']:.0f} ms + TPOT {serve['tpot_ms']:.1f} ms/token")
    print(f"share of serving CPU: median {100 * s['share_of_serving_cpu']['median']:.2f} %, p90 "
          f"{100 * s['share_of_serving_cpu']['p90']:.2f} %; of latency: median {100 * s['share_of_latency']['median']:.3f} %, "
          f"p90 {100 * s['share_of_latency']['p90']:.3f} %")
    if args.engine:
        for sv, w, cp in zip(served, result["engine"]["share_of_wall"], result["engine"]["share_of_cpu"]):
            print(f"  {args.engine} in-process: {sv['prompt_tokens']} + {sv['output_tokens']} tokens in "
                  f"{sv['wall_ms']:.0f} ms ({sv['cpu_ms']:.0f} ms CPU): find is {100 * w:.2f} % of wall, {100 * cp:.2f} % of CPU")
    bd = result["breakdown"]
    print(f"\nwhere the time goes ({bd['texts']} longest texts, {bd['mean_chars']:.0f} chars, find {bd['find_mean_us']:.0f} us on average; "
          f"{bd['recognizers']} recognizers):")
    others = list(bd["parts_mean_us"].items())
    print(table(["part", "us per text"], [[k, v] for k, v in others[:8]]
                + [[f"the other {len(others) - 8} recognizers", sum(v for _, v in others[8:])],
                   ["rest (context words, de-duplication, rules)", bd["rest_mean_us (context words, de-duplication, rules)"]]]))
    path = write_result("pii_cost", result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
