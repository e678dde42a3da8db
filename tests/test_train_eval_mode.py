"""Every forward pass of the trainer (π_prox, π_θ, the KL reference) runs with dropout off, as the
engine samples: on `tiny` with attention dropout 0.5, the first minibatch of a step has
π_θ = π_prox exactly (no clipping), π_prox = π_behav up to float noise, and a zero KL."""

import pytest
import torch

from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.train.packing import micro_batches
from flywheel.train.trainer import Trainer

from factories import rows_of, sample_of, sampled_turns


def with_attention_dropout(p: float) -> torch.nn.Module:
    """`tiny` whose attention drops out with probability `p` in train mode (Qwen2's attention
    reads `self.attention_dropout`, set from the config when it was built)."""
    model, _ = load_model("tiny")
    model.config.attention_dropout = p
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = p
    return model


async def test_dropout_is_off_in_every_forward_of_a_step():
    samples = [sample_of(turn, float(i % 2)) for i, turn in enumerate(await sampled_turns(4))]
    batches = micro_batches(rows_of(samples, [1.0, -1.0, 1.0, -1.0]), budget=10_000, pad_id=0)
    model = with_attention_dropout(0.5)
    ids = batches[0].input_ids
    with torch.no_grad():
        model.train()
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # dropout is real
        model.eval()
    config = load_config(None, ["actor.ppo_n_minibatches=1", "actor.kl_coef=0.1"])
    trainer = Trainer(model, config.actor, config.train)
    computed, recompute = [], trainer.token_logprobs

    def recording(*args, **kw):
        out = recompute(*args, **kw)
        computed.append(out[0])
        return out

    trainer.token_logprobs = recording
    metrics = trainer.step([batches], version=0)
    prox, theta, reference = computed  # one micro-batch: π_prox, then π_θ and the reference
    assert torch.equal(theta.detach(), prox) and torch.equal(reference, prox)
    assert metrics["clip_fraction"] == 0.0 and metrics["kl"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["gap_tokens"] > 0 and metrics["behav_logprob_gap"] < 1e-4
