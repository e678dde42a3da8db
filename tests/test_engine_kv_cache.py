"""The engine's preallocated KV cache and incremental stop-string search, checked against what
they replace: a full forward pass over each sequence alone, and a search of the whole decoded
text."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoTokenizer

from flywheel.models import load_model, resolve_model
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.serve.engine.detokenizer import IncrementalText
from flywheel.serve.engine.kv_cache import KVBatch, _groups

from factories import prompt, recomputed_logprobs


async def test_rows_joining_leaving_and_outgrowing_the_cache_decode_like_a_full_forward(model_and_tokenizer):
    """Nine requests through four slots: rows leave out of order (their slots refilled from the
    tail), newcomers join the running batch, and one row outgrows the first 256 columns (the
    cache doubles while others are mid-generation). Every behaviour logprob equals a full
    forward pass over that sequence alone."""
    model, tokenizer = model_and_tokenizer
    engine = Engine(model, tokenizer, max_batch_size=4).start()
    try:
        rng = random.Random(5)
        texts = [" ".join(rng.choice(["add", "seven", "to", "the", "number", "please"]) for _ in range(rng.randint(1, 40)))
                 for _ in range(9)]
        lengths = [300, 5, 40, 9, 70, 3, 25, 60, 12]
        results = await asyncio.gather(*(
            engine.generate(prompt(tokenizer, text), SamplingParams(max_new_tokens=n, ignore_eos=True, sampling_seed=i))
            for i, (text, n) in enumerate(zip(texts, lengths))
        ))
        assert engine.load()["num_running_reqs"] == 0 and engine.load()["cached_tokens"] == 0
    finally:
        engine.stop()
    for result, n in zip(results, lengths):
        assert len(result.output_ids) == n
        expected = recomputed_logprobs(model, result.prompt_ids, result.output_ids)
        assert result.logprobs == pytest.approx(expected, abs=2e-4)


def test_retain_moves_only_tail_rows_into_holes(model_and_tokenizer):
    model, _ = model_and_tokenizer
    batch = KVBatch(model, max_rows=6, first_columns=8)
    with torch.inference_mode():
        batch.add(batch.prefill(model, [[5 + i] * (i + 1) for i in range(6)], pad_id=0))
        before = [batch.keys[0][row, :, : row + 1].clone() for row in range(6)]
        order = batch.retain([0, 2, 4, 5])
    assert order == [0, 4, 2, 5]  # rows 1 and 3 left: the tail rows 4 and 5 fill their slots
    assert batch.lengths.tolist() == [1, 5, 3, 6]
    for new_row, old_row in enumerate(order):
        assert torch.equal(batch.keys[0][new_row, :, : old_row + 1], before[old_row])


def test_prefill_groups_bound_padding():
    lengths = [3, 200, 40, 41, 39, 1000, 5000, 120]
    groups = _groups([[0] * n for n in lengths])
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        positions, real = longest * len(group), sum(lengths[i] for i in group)
        assert len(group) == 1 or (positions <= 4096 and positions - real <= 0.125 * positions)
    assert [5] in groups and [6] in groups and any(set(g) == {2, 3, 4} for g in groups)


@pytest.mark.parametrize("model_name", ["tiny", "smollm2-135m"])
def test_incremental_text_adds_up_to_the_whole_decode(model_name, tiny_path):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(str(tiny_path) if model_name == "tiny" else model_name))
    rng = random.Random(0)
    samples = [tokenizer.encode("naïve café — 数字 12+7=19 🙂🙃 done\n  indented", add_special_tokens=False)]
    samples += [[rng.randrange(len(tokenizer)) for _ in range(200)] for _ in range(3)]
    for ids in samples:
        for skip in (True, False):
            text = IncrementalText(tokenizer, skip)
            pieces = "".join(text.added(ids[: i + 1]) for i in range(len(ids)))
            whole = tokenizer.decode(ids, skip_special_tokens=skip)
            assert whole.startswith(pieces) and (pieces == whole or whole.endswith("\ufffd"))


async def test_stop_strings_end_where_a_search_of_the_whole_text_would(model_and_tokenizer):
    """Stop strings picked from the middle of sampled outputs (and one across two tokens' text):
    the output ends at the first place the whole decoded text holds any of them."""
    model, tokenizer = model_and_tokenizer
    engine = Engine(model, tokenizer, max_batch_size=8).start()
    try:
        ids = prompt(tokenizer, "Count to twenty, with words.")
        free = [await engine.generate(ids, SamplingParams(max_new_tokens=60, ignore_eos=True, sampling_seed=s))
                for s in range(4)]
        cases = []
        for result in free:
            text = result.text
            middle = len(text) // 2
            cases.append([text[middle:middle + 5], "never-there"])
            cases.append([text[middle + 3:middle + 4], text[-7:]])
        stopped = await asyncio.gather(*(
            engine.generate(ids, SamplingParams(max_new_tokens=60, ignore_eos=True, sampling_seed=i // 2, stop=stop))
            for i, stop in enumerate(cases)
        ))
    finally:
        engine.stop()
    for i, (stop, result) in enumerate(zip(cases, stopped)):
        whole = free[i // 2].text
        hits = sorted((whole.find(s), s) for s in stop if s and s in whole)
        at, matched = hits[0]
        assert result.finish_reason == {"type": "stop", "matched": matched}
        assert result.text == whole[:at]
        assert free[i // 2].output_ids[: len(result.output_ids)] == result.output_ids


def test_a_slot_left_with_non_finite_values_does_not_reach_its_next_row(model_and_tokenizer):
    """Masked columns still take part in attention with weight 0, and 0 x NaN is NaN: what a row
    left in its slot (here: NaN, as a model fed a broken embedding would write) is cleared for
    the next row, both in a hole filled from the tail and in a slot a newcomer takes, while a
    longer row makes the step attend over those columns."""
    model, _ = model_and_tokenizer
    long, short, newcomer, broken = [3] * 13, [4, 5, 6, 7, 8], [9, 10], [1] * 14

    def poisoned(batch: KVBatch, row: int) -> None:
        for store in (batch.keys, batch.values):
            for layer in store:
                layer[row].fill_(float("nan"))

    def after_one_step(rows: list[list[int]]) -> torch.Tensor:
        clean = KVBatch(model, max_rows=3, first_columns=16)
        clean.add(clean.prefill(model, rows, pad_id=0))
        return clean.step(model, torch.tensor([3] * len(rows)))

    with torch.inference_mode():
        hole = KVBatch(model, max_rows=3, first_columns=16)
        hole.add(hole.prefill(model, [broken, long, short], pad_id=0))
        poisoned(hole, 0)
        assert hole.retain([1, 2]) == [2, 1]  # the short row moves into the broken row's slot
        hole_logits = hole.step(model, torch.tensor([3, 3]))

        slot = KVBatch(model, max_rows=3, first_columns=16)
        slot.add(slot.prefill(model, [long, broken], pad_id=0))
        poisoned(slot, 1)
        assert slot.retain([0]) == [0]
        slot.add(slot.prefill(model, [newcomer], pad_id=0))  # takes the broken row's slot
        slot_logits = slot.step(model, torch.tensor([3, 3]))

        assert torch.allclose(hole_logits, after_one_step([short, long]), atol=1e-5)
        assert torch.allclose(slot_logits, after_one_step([long, newcomer]), atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (serve.device=cuda); none here")
async def test_the_engine_on_a_gpu_samples_what_a_cpu_forward_pass_scores(tiny_path):
    from flywheel.models import place

    cpu_model, tokenizer = load_model(str(tiny_path))
    gpu_model, _ = load_model(str(tiny_path))
    engine = Engine(place(gpu_model, "cuda"), tokenizer, max_batch_size=4).start()
    try:
        results = await asyncio.gather(*(
            engine.generate(prompt(tokenizer, text), SamplingParams(max_new_tokens=20, ignore_eos=True, sampling_seed=i))
            for i, text in enumerate(["hi", "Count to five.", "What is 2 + 2?"])
        ))
    finally:
        engine.stop()
    for result in results:
        expected = recomputed_logprobs(cpu_model, result.prompt_ids, result.output_ids)
        assert result.logprobs == pytest.approx(expected, abs=1e-3)


class CountingTokenizer:
    """The real tokenizer, counting how many token ids the engine asks it to decode."""

    def __init__(self, inner):
        self._inner = inner
        self.decoded = 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self._inner.decode(ids, **kwargs)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


async def test_a_stop_string_costs_decoding_a_few_tokens_per_step_not_the_whole_output(model_and_tokenizer):
    """Before, every step decoded the whole output to search for the stop strings: 200 tokens
    cost 20,100 decoded ids. Now a step decodes a window of a few tokens."""
    model, tokenizer = model_and_tokenizer
    counting = CountingTokenizer(tokenizer)
    engine = Engine(model, counting, max_batch_size=2).start()
    try:
        result = await engine.generate(prompt(tokenizer, "Write a long story."),
                                       SamplingParams(max_new_tokens=200, ignore_eos=True, stop=["never-there"]))
    finally:
        engine.stop()
    assert len(result.output_ids) == 200 and result.finish_reason["type"] == "length"
    assert result.text == tokenizer.decode(result.output_ids, skip_special_tokens=True)
    assert counting.decoded < 10 * 200, counting.decoded
