"""Tests for flywheel/models/weight_store.py: versions published, listed, pruned and loaded; partial
writes ignored and cleaned; state dicts that load into a fresh model, tied embeddings or not; weights
loaded in place into a serving model."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from flywheel.models import WeightStore, load_model, load_weights
from flywheel.models.weight_store import STALE_TMP_S

from factories import assert_same_parameters


@pytest.fixture
def tiny_model(tiny_path: Path) -> torch.nn.Module:
    return load_model(tiny_path)[0]


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


def test_weight_store_publishes_tokenizer(tiny_path: Path, tmp_path: Path) -> None:
    model, tok = load_model(tiny_path)
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
def test_weight_store_state_dict_loads_into_fresh_model(tiny_path: Path, tmp_path: Path, tied: bool) -> None:
    config = AutoConfig.from_pretrained(tiny_path, tie_word_embeddings=tied)
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


def test_load_weights_in_place(tiny_path: Path, tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_path)
    trained = AutoModelForCausalLM.from_config(config)
    train_a_little(trained, config.vocab_size)
    path = WeightStore(tmp_path).publish(trained, 0)

    serving, _ = load_model(tiny_path)
    embedding = serving.model.embed_tokens.weight
    load_weights(serving, str(path))
    assert_same_parameters(trained, serving)
    assert serving.model.embed_tokens.weight is embedding
    assert serving.lm_head.weight.data_ptr() == embedding.data_ptr()

    other = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_path, intermediate_size=256))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="wrong shape.*mlp"):
        load_weights(other, path)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(FileNotFoundError):
        load_weights(serving, tmp_path)


