"""Seeded synthetic chat requests for the PII-cost benchmark (`bench/pii_cost.py`): 2-6 messages
(an optional system prompt, then user, assistant and tool turns) of 50-2,000 characters each
(log-uniform), made of prose, code, logs, JSON tool output and, in one message in five, personal
data (e-mail, phone, card, IBAN, SSN, IP); a reply of 100-1,500 characters; the same conversation
one turn later; and the text-length buckets the benchmark reports by. The same seed gives the
same texts."""

from __future__ import annotations

import json
import math
import random

BUCKETS = [("50-200", 50, 200), ("200-500", 200, 500), ("500-1000", 500, 1000), ("1000-2000", 1000, 2001)]

WORDS = ["the", "model", "config", "training", "step", "batch", "error", "value", "file", "function", "test", "output", "request", "user", "service", "data", "cluster", "version", "tokens", "memory", "latency", "result", "server", "loop", "version", "update", "answer", "please", "could", "you", "explain", "why", "this", "fails", "after", "I", "changed", "it", "and", "what", "should", "we", "try", "next"]


def bucket(n: int) -> str:
    """The name of the length bucket a text of `n` characters falls in."""
    return next((name for name, lo, hi in BUCKETS if n < hi), BUCKETS[-1][0])


def _prose(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 30))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.choice([3, 12, 42, 256, 1024, 2048, 12000])))
    return " ".join(words).capitalize() + rng.choice([". ", "? ", ".\n"])


def _code(rng: random.Random) -> str:
    n, m = rng.randint(2, 64), rng.randint(100, 99999)
    return rng.choice([
        (f"```python\ndef step(batch, lr={rng.choice(['3e-4', '1e-5', '0.01'])}):\n"
         f"    loss = model(batch[\"input_ids\"]).loss\n"
         f"    for i in range({n}, {n + 10}):\n        x = {n} * {m} + i\n    return loss.item()\n```\n"),
        (f"```bash\n$ pip install torch=={rng.randint(1, 2)}.{rng.randint(0, 13)}.{rng.randint(0, 9)} "
         f"&& python train.py --steps {m}\n"
         f"$ curl -s http://127.0.0.1:{rng.randint(1024, 65535)}/v1/models | jq .\n```\n"),
        (f"    File \"/home/app/src/{rng.choice(['train', 'loop', 'serve'])}.py\", line {m % 900}, in run\n"
         f"RuntimeError: shape mismatch ({n}, {m}) vs ({n}, {m + 1})\n"),
    ])


def _log(rng: random.Random) -> str:
    ts = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d},{rng.randint(0, 999):03d}"
    return (f"{ts} INFO worker-{rng.randint(0, 9)} step={rng.randint(1, 99999)} loss={rng.random() * 4:.4f} "
            f"tokens/s={rng.randint(1000, 40000)} req={rng.getrandbits(40):010x} t={rng.randint(1_600_000_000, 1_800_000_000)}\n")


def _json(rng: random.Random) -> str:
    return json.dumps({"id": f"call_{rng.getrandbits(48):012x}", "status": rng.choice(["ok", "error"]),
                       "version": f"{rng.randint(0, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}",
                       "count": rng.randint(0, 5000), "ratio": round(rng.random(), 4),
                       "items": [rng.randint(1, 10**9) for _ in range(rng.randint(1, 5))]}) + "\n"


def _luhn_card(rng: random.Random) -> str:
    digits = [4] + [rng.randint(0, 9) for _ in range(14)]
    total = sum(d if i % 2 else (2 * d - 9 if 2 * d > 9 else 2 * d) for i, d in enumerate(reversed(digits)))
    digits.append((10 - total % 10) % 10)
    s = "".join(map(str, digits))
    return " ".join(s[i:i + 4] for i in range(0, 16, 4))


def _pii(rng: random.Random) -> str:
    name = rng.choice(["maria.gonzalez", "j.smith", "li.wei", "ahmed.k", "olga_petrova"])
    return rng.choice([
        f"Please send it to {name}@{rng.choice(['example.com', 'mail.example.org', 'corp.example.co.uk'])}. ",
        f"You can call me on +44 20 7946 0{rng.randint(100, 999)} or (212) 555-01{rng.randint(10, 99)}. ",
        f"My card is {_luhn_card(rng)}, expiry {rng.randint(1, 12):02d}/{rng.randint(26, 30)}. ",
        f"My SSN is {rng.randint(100, 665)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)} and IBAN DE89 3704 0044 0532 0130 00. ",
        f"The VPN gave me {rng.randint(11, 223)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)} today. ",
    ])


def _message(rng: random.Random, role: str, length: int) -> str:
    makers = {"system": [_prose], "user": [_prose, _prose, _code, _log], "assistant": [_prose, _prose, _code],
              "tool": [_json, _log, _code]}[role]
    pii_at = length * rng.random() if rng.random() < 0.2 else None
    out = ""
    while len(out) < length:
        if pii_at is not None and len(out) >= pii_at:
            out, pii_at = out + _pii(rng), None
        out += rng.choice(makers)(rng)
    return out[:length]


def _length(rng: random.Random, lo: int = 50, hi: int = 2000) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def make_requests(n: int, seed: int) -> list[dict]:
    """`n` requests, {"messages": [{"role", "content"}], "reply"}, drawn from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        roles = (["system"] if rng.random() < 0.5 else []) + ["user"]
        for _ in range(rng.randint(1, 5) - len(roles) + 1):
            roles.append(rng.choice(["assistant", "tool", "user"]))
        messages = [{"role": r, "content": _message(rng, r, _length(rng))} for r in roles]
        out.append({"messages": messages, "reply": _message(rng, "assistant", _length(rng, 100, 1500))})
    return out


def next_turn(rng: random.Random, request: dict) -> dict:
    """The same conversation one turn later: its reply and a new user message appended."""
    messages = request["messages"] + [{"role": "assistant", "content": request["reply"]},
                                      {"role": "user", "content": _message(rng, "user", _length(rng, 50, 500))}]
    return {"messages": messages, "reply": _message(rng, "assistant", _length(rng, 100, 1500))}


def request_texts(request: dict) -> list[str]:
    """Every text the gateway scans in a request: each message's, then the reply."""
    return [m["content"] for m in request["messages"]] + [request["reply"]]
