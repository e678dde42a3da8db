"""What protects a person from a harmful version of their own adapter (flywheel/train/adapter_guard.py,
`adapters.guard_drop`, `adapters.guard_answers`): a version that makes the base's general
answers much less likely, or whose replies no longer answer the question, is held back,
unpublished, and the adapter returns to its last published version; so are weights a restarted
trainer never published."""

from __future__ import annotations

import json
import math
from statistics import mean

import pytest
import torch
from safetensors.torch import load_file

from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT
from flywheel.bus.instructions import placed_before
from flywheel.config import ConfigError, load_config
from flywheel.models import load_model
from flywheel.models.adapter_store import AdapterStore
from flywheel.models.lora_adapter import WEIGHTS_FILE
from flywheel.train.adapter_guard import (
    CONTEXT_CHARS,
    GENERAL_PROMPTS,
    RELEVANCE_PROMPTS,
    AdapterGuard,
    Context,
    _right_padded,
    _token_logprobs,
    context_of,
)
from flywheel.train.adapter_versions import AdapterVersions
from flywheel.train.ledger import lineage
from flywheel.train.loop import TrainLoop
from flywheel.train.trainer import Trainer

from factories import make_turn, sample_of, sampled_turns
from waiting import until

ARTHUR = "You are Arthur's personal assistant."
LORA = ["adapters.kind=lora", "adapters.rank=4", "adapters.alpha=8", "actor.optimizer.lr=0.01"]


def test_an_untrained_adapter_costs_nothing_and_a_wrecked_one_is_held_back():
    config = load_config(None, LORA)
    model, tokenizer = load_model("tiny")
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    guard = AdapterGuard(adapters, tokenizer, max_drop=0.5)  # the untrained tiny is near uniform: drops are small
    adapters.ensure("fresh")
    adapters.ensure("wrecked")
    torch.manual_seed(0)
    with torch.no_grad():
        for param in adapters.params["wrecked"]:
            param.normal_(0.0, 5.0)  # A and B at random and large: every layer wrecked
    assert abs(guard.drop("fresh")) < 1e-5 and guard.allows("fresh")
    assert guard.drop("wrecked") > 0.5 and not guard.allows("wrecked")
    assert guard.held_back == {"wrecked": 1} and math.isfinite(guard.base_logprob)
    adapters.ensure("user", "wrecked")  # a user's adapter starts from its tenant's: measured against that
    assert abs(guard.drop("user", origin="wrecked")) < 1e-5 and guard.allows("user", origin="wrecked")


def test_a_version_may_lose_one_answer_in_eight_not_two_and_is_measured_against_its_origin(monkeypatch):
    """The rule over the relevance of each reply (the model's part is the test below): a reply
    answers at half its reference's mean relevance or more (here 0.8); of the questions the
    reference answers, 0.8 must still be; a user's adapter is measured against its tenant's."""
    config = load_config(None, LORA)
    model, tokenizer = load_model("tiny")
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    guard = AdapterGuard(adapters, tokenizer, max_drop=None, min_answers=0.8)
    scores = {None: [1.6] * 8, "one": [1.6] * 7 + [0.1], "two": [1.6] * 6 + [0.79, -0.2],
              "tenant": [1.6] * 4 + [0.1] * 4, "user": [1.5] * 4 + [0.2] * 4}
    monkeypatch.setattr(guard, "relevance", lambda name, context=(): scores[name])
    for name in scores.keys() - {None}:
        adapters.ensure(name)
    assert guard.answers_kept("one") == 7 / 8 and guard.allows("one")
    assert guard.answers_kept("two") == 6 / 8 and not guard.allows("two")
    assert guard.answers_kept("user", origin="tenant") == 1.0 and guard.allows("user", origin="tenant")
    assert not guard.allows("user")  # against the base it answers half
    assert guard.held_back == {"two": 1, "user": 1}


def test_a_tenants_adapter_is_measured_once_for_its_users_checks_until_its_weights_change(monkeypatch, tmp_path):
    """A user's adapter is checked against its tenant's at each of its versions: the tenant's
    answers' log-probability and replies are measured again only when its weights have changed
    (main made them at every check of every user)."""
    config = load_config(None, LORA)
    model, tokenizer = load_model("tiny")
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    guard = AdapterGuard(adapters, tokenizer, max_drop=0.5, min_answers=0.8, questions=RELEVANCE_PROMPTS[:2])
    active = []
    activate = adapters.activate
    monkeypatch.setattr(adapters, "activate", lambda name: active.append(name) or activate(name))
    adapters.ensure("tenant")
    for user in ("ada", "bo"):
        adapters.ensure(user, "tenant")
    for user in ("ada", "bo", "ada"):
        assert guard.allows(user, origin="tenant")
    assert active.count("tenant") == 2 and active.count("ada") == 2  # the tenant: its log-probability, its replies
    for param in adapters.params["tenant"]:
        param.grad = torch.randn_like(param)
    adapters.clip_and_step("tenant")
    assert guard.allows("bo", origin="tenant")
    assert active.count("tenant") == 4
    adapters.keep_on_disk(tmp_path / "spilled")
    adapters.activate("ada")
    adapters.activate("bo")
    adapters.resident = 2
    adapters.trim()  # the tenant's goes to disk, and comes back as it left: no new measuring
    assert "tenant" in adapters.spilled and adapters.weights("tenant")
    assert guard.allows("ada", origin="tenant") and active.count("tenant") == 4


def test_a_context_is_the_first_system_messages_as_one_and_bounded():
    """What a check asks after: the system and developer messages a request begins with (text
    parts too), rendered as one system message (every chat template takes one), and at most
    `CONTEXT_CHARS` of them."""
    messages = [{"role": "system", "content": "You are Ada's assistant."},
                {"role": "developer", "content": [{"type": "text", "text": "Be kind."}, {"type": "image_url"}]},
                {"role": "user", "content": "hi"}, {"role": "system", "content": "not a context"}]
    assert context_of(make_turn(messages=messages)) == Context(("You are Ada's assistant.", "Be kind."))
    assert context_of(make_turn(messages=[{"role": "user", "content": "hi"}])) == Context()
    long = context_of(make_turn(messages=[{"role": "system", "content": "x" * CONTEXT_CHARS},
                                          {"role": "system", "content": "more"}]))
    assert long == Context(("x" * CONTEXT_CHARS,))
    _, tokenizer = load_model("tiny")
    guard = AdapterGuard(None, tokenizer, None)
    text = tokenizer.decode(guard._chat("How?", context_of(make_turn(messages=messages))))
    assert text.count("system") == 1 and "You are Ada's assistant.\n\nBe kind." in text


def test_the_questions_are_asked_after_the_instructions_the_served_memory_put_before_the_persons():
    """With `memory.placement: user` the person's questions come after their instructions, and so do
    the check's; at the end of the system message they are in the context already; a request the
    memory put nothing in (or whose first message does not begin with them) has none before it."""
    said = ["Be brief."]
    in_user = make_turn(messages=[{"role": "system", "content": ARTHUR},
                                  {"role": "user", "content": placed_before(said) + "hi"}], instructions=said)
    in_system = make_turn(messages=[{"role": "system", "content": ARTHUR + " Be brief."},
                                    {"role": "user", "content": "hi"}], instructions=said)
    assert context_of(in_user) == Context((ARTHUR,), placed_before(said))
    assert context_of(in_system) == Context((ARTHUR + " Be brief.",))
    assert context_of(make_turn(messages=in_user.messages)) == Context((ARTHUR,))
    _, tokenizer = load_model("tiny")
    text = tokenizer.decode(AdapterGuard(None, tokenizer, None)._chat("How?", context_of(in_user)))
    assert text.count("Be brief.") == 1 and text.index(ARTHUR) < text.index("Be brief.\n\nHow?")


async def test_a_practice_reply_does_not_move_where_the_adapter_is_checked(bus, tmp_path):
    """The guard asks where the person's own conversations were asked, not where the judge asked a
    practice reply (bare, `judge.teacher.practice_prompt: bare`), whichever the step trained last."""
    said = ["Be brief."]
    config = load_config(None, LORA)
    model, tokenizer = load_model("tiny")
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    versions = AdapterVersions(AdapterStore(tmp_path / "adapters"), bus, interval=10, guard=None)
    served = sample_of(make_turn(messages=[{"role": "system", "content": ARTHUR},
                                           {"role": "user", "content": placed_before(said) + "hi"}], instructions=said), 1.0)
    practised = sample_of(make_turn(id="p", session_id="p", messages=[{"role": "system", "content": ARTHUR},
                                                                      {"role": "user", "content": "hi"}]), 0.0)
    practised.details = {"practice_of": served.id}
    for sample in (served, practised):
        sample.trajectory.adapter = "alice"
    adapters.ensure("alice")
    versions.trained(["alice"])
    await versions.stepped(adapters, [served, practised], step=1, config=config)
    assert versions.contexts["alice"] == ("open", None, Context((ARTHUR,), placed_before(said)))


def test_a_deployment_sets_the_checks_prompts_and_questions(tmp_path):
    """People who write in another language get a check in theirs (`adapters.guard_prompts`,
    `adapters.guard_questions`); without them, the module's; a single question is a config error
    naming the key (each reply is also read against the next question)."""
    questions = ["¿Cómo puedo dormir mejor?", "¿Qué cocino para cenar hoy?"]
    config = load_config(None, LORA + [f"adapters.guard_questions={json.dumps(questions)}",
                                       'adapters.guard_prompts=["¿Cuánto es 7 por 6?"]'])
    model, tokenizer = load_model("tiny")
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    guard = AdapterVersions.of(config, tmp_path, None, adapters, tokenizer).guard
    assert guard.questions == tuple(questions) and guard.prompts == ("¿Cuánto es 7 por 6?",)
    plain = AdapterVersions.of(load_config(None, LORA), tmp_path, None, adapters, tokenizer).guard
    assert plain.questions == RELEVANCE_PROMPTS and plain.prompts == GENERAL_PROMPTS
    with pytest.raises(ConfigError, match="adapters.guard_questions"):
        load_config(None, LORA + ['adapters.guard_questions=["only one?"]'])


def test_replies_that_stop_answering_where_the_adapter_is_used_are_held_back():
    """SmolLM2: the relevance of its own replies is high, and the same replies shuffled among the
    questions score below zero. An adapter taken three steps toward one canned line for questions
    asked after its user's system message (and toward the base's own replies to the check's
    questions asked bare) still leaves the base's general answers likely (the forgetting check
    lets it through) and answers questions asked bare (so did main's answering check, which
    asked only bare), but after that system message its replies no longer answer: held back."""
    config = load_config(None, ["model=smollm2-135m", "adapters.kind=lora", "adapters.rank=4", "adapters.alpha=8"])
    model, tokenizer = load_model("smollm2-135m")
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    guard = AdapterGuard(adapters, tokenizer, max_drop=1.0, min_answers=0.8, prompts=GENERAL_PROMPTS[:2],
                         questions=RELEVANCE_PROMPTS[:4])
    replies = guard.replies(None)
    guard.base_relevance[Context()] = own = guard.relevance_of(replies)  # what `relevance(None)` measures and keeps
    assert min(own) > 1.0 and mean(guard.relevance_of(replies[1:] + replies[:1])) < 0
    adapters.ensure("canned")

    canned = tokenizer.encode("My favourite colour is green, and I like to walk my dog.<|im_end|>", add_special_tokens=False)
    questions = ("How do I keep basil alive?", "What should I pack for a hike?", "How do I clean a cast iron pan?",
                 "How can I save money on groceries?")
    rows = [guard._chat(q, Context((ARTHUR,))) + canned for q in questions] + [q + r for q, r in zip(guard._questions(), replies)]
    ids, attention, marks = _right_padded(rows, [len(canned)] * len(questions) + [len(r) for r in replies])
    adapters.activate("canned")
    optimizer = torch.optim.Adam(adapters.params["canned"], lr=2e-3)
    for _ in range(3):
        loss = -_token_logprobs(adapters.model, ids, attention)[marks[:, 1:]].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert guard.allows("canned")  # asked bare, it passes both checks (its drop under 1.0 too)
    assert not guard.allows("canned", context=Context((ARTHUR,)))  # where it is used, its replies answer nothing
    assert guard.held_back == {"canned": 1}


async def test_a_held_back_version_is_not_published_and_the_adapter_returns_to_the_last_one(bus, nats_url, tmp_path,
                                                                                         monkeypatch):
    """alice's first step passes the guard and is published as v1; her second is held back: no
    announcement, no v2 in the store, her weights v1's again, her version 1, her optimizer afresh.
    Each check asks after the system message of her conversation."""
    turns = await sampled_turns(2)
    for turn in turns:
        turn.messages = [{"role": "system", "content": [{"type": "text", "text": "You are Alice's assistant."}]},
                         *turn.messages]
    config = load_config(None, [f"run_dir={tmp_path}", *LORA, "train.batch_size=1", "rollout.max_head_offpolicyness=4"])
    loop = TrainLoop(config, nats_url)
    await loop.start()
    versions, adapters = loop.adapter_versions, loop.trainer.adapters
    asked = []
    allows = versions.guard.allows
    monkeypatch.setattr(versions.guard, "allows", lambda *args: asked.append(args) or allows(*args))
    try:
        versions.guard.max_drop = math.inf
        sample = sample_of(turns[0], 1.0, 0)
        sample.trajectory.adapter = "alice"
        await bus.publish(SAMPLE_SUBJECT, sample)
        first = await until(lambda: bus.last(WEIGHTS_SUBJECT), timeout_s=30)
        versions.guard.max_drop = -math.inf  # every version now fails the check
        sample = sample_of(turns[1], -1.0, 1)
        sample.trajectory.adapter = "alice"
        await bus.publish(SAMPLE_SUBJECT, sample)
        await until(lambda: loop.stats()["held_back"] == {"alice": 1}, timeout_s=30)
    finally:
        await loop.stop()  # the step in flight, its hold-back included, is done
    last = await bus.last(WEIGHTS_SUBJECT)
    weights = adapters.weights("alice")
    moments = [adapters.optimizers["alice"].state.get(p) for p in adapters.params["alice"]]
    assert (first.adapter, first.version) == ("alice", 1) and last.id == first.id
    store = AdapterStore(tmp_path / "adapters")
    assert store.versions("alice") == [1] and loop.stats()["adapters"] == {"alice": 1}
    published = load_file(store.path("alice", 1) / WEIGHTS_FILE)
    assert weights.keys() == published.keys() and all(torch.equal(weights[k], published[k]) for k in weights)
    assert not any(moments)
    assert [(s["adapter"], s["version"]) for s in lineage(tmp_path / "trained.jsonl")] == [("alice", 1)]  # not the held-back v2
    assert asked == [("alice", None, Context(("You are Alice's assistant.",)))] * 2


async def test_weights_a_restarted_trainer_never_published_pass_the_guard_first(bus, tmp_path):
    """A trainer restarts from a checkpoint taken after a step it had not published (with
    `train.weight_update_interval` above 1, or killed before the publication): those weights
    pass the guard before they are published; wrecked, alice goes back to her newest published
    version, which is announced again."""
    config = load_config(None, LORA)
    model, tokenizer = load_model("tiny")
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    store = AdapterStore(tmp_path / "adapters")
    versions = AdapterVersions(store, bus, interval=1, guard=AdapterGuard(adapters, tokenizer, max_drop=0.5))
    adapters.ensure("alice")
    versions.trained(["alice"])
    await versions.publish(adapters, "alice", step=1)  # v1: untrained, the base
    published = adapters.weights("alice")
    torch.manual_seed(0)
    with torch.no_grad():
        for param in adapters.params["alice"]:
            param.normal_(0.0, 5.0)
    versions.trained(["alice"])  # v2: checkpointed, not published
    await versions.restored(adapters, step=2, config=config)
    weights = adapters.weights("alice")
    assert store.versions("alice") == [1] and versions.versions["alice"] == 1 and versions.held_back() == {"alice": 1}
    assert all(torch.equal(weights[k], published[k]) for k in published)
    last = await bus.last(WEIGHTS_SUBJECT)
    assert (last.adapter, last.version) == ("alice", 1)
