"""How often the checks of practice replies (flywheel/formats/wish_checks.py) rank two replies as a
careful reader would, on pairs their author did not write.

Set: bench/data/wish_pairs_heldout.jsonl, written by a helper from a brief (/work/notes/
wish_pairs_brief.md, quoted in docs/experiments/learning-from-use.md) without opening any file of
the project; the checks' author never read it (this bench prints no item). Each item: a wish
(`shorter`, `longer`, `list`, `prose`, `formal`, `name`), a system message and a question, two
replies, and which does more of the wish (`a`, `b` or `tie`).

Numbers, per wish and over all:
    - **said**: of the pairs where one reply does more, the share where the checks rank them at all
      (they give no rewards where the two do not differ in what they measure);
    - **right | said**: of those, the share ranked the reader's way: what a practice group's
      advantage gets right;
    - **wrong**: the share of those pairs ranked the other way: an advantage pushing the wrong way
      (a pair not ranked only leaves the group to the teacher);
    - **ties kept**: of the reader's ties, the share the checks leave unranked.

    .venv/bin/python bench/judge_wish_checks.py        # bench/results/judge_wish_checks.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, table, write_result  # noqa: E402
from flywheel.formats.wish_checks import rewards  # noqa: E402

HEADERS = ["wish", "pairs", "said", "right | said", "wrong", "ties", "ties kept"]


def verdict(item: dict) -> str:
    """The checks' answer for an item: `a`, `b` or `tie` (no rewards)."""
    messages = [*([{"role": "system", "content": item["system"]}] if item.get("system") else []),
                {"role": "user", "content": item["user"]}]
    ranked = rewards([item["wish"]], [item["a"], item["b"]], messages)
    return "tie" if ranked is None else "a" if ranked[0] > ranked[1] else "b"


def row(wish: str, items: list[dict]) -> dict:
    pairs = [i for i in items if i["better"] != "tie"]
    ties = [i for i in items if i["better"] == "tie"]
    said = [i for i in pairs if i["verdict"] != "tie"]
    right = sum(i["verdict"] == i["better"] for i in said)
    return {"wish": wish, "pairs": len(pairs), "said": len(said) / len(pairs) if pairs else None,
            "right_given_said": right / len(said) if said else None,
            "wrong": (len(said) - right) / len(pairs) if pairs else None,
            "ties": len(ties), "ties_kept": sum(i["verdict"] == "tie" for i in ties) / len(ties) if ties else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default=str(ROOT / "bench/data/wish_pairs_heldout.jsonl"))
    parser.add_argument("--name", default="judge_wish_checks")
    args = parser.parse_args()
    items = [json.loads(line) for line in Path(args.set).read_text(encoding="utf-8").splitlines() if line.strip()]
    for item in items:
        item["verdict"] = verdict(item)
    wishes = sorted({i["wish"] for i in items})
    rows = [row(w, [i for i in items if i["wish"] == w]) for w in wishes] + [row("all", items)]
    keys = ["wish", "pairs", "said", "right_given_said", "wrong", "ties", "ties_kept"]
    print(table(HEADERS, [[r[k] for k in keys] for r in rows]))
    path = write_result(args.name, {"args": vars(args), "items": len(items), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
