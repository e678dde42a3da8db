"""Config: YAML plus overrides, and errors that name the key."""

import pytest

from flywheel.config import ConfigError, dump_config, load_config, parse_overrides


def test_defaults_yaml_and_overrides_compose(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny\ntrain:\n  batch_size: 8\nactor:\n  optimizer:\n    lr: 0.01\n")
    config = load_config(path, ["train.batch_size=16", "rollout.max_head_offpolicyness=0", "deploy.ray_address=null"])
    assert config.train.batch_size == 16
    assert config.actor.optimizer.lr == 0.01
    assert config.rollout.max_head_offpolicyness == 0
    assert config.deploy.ray_address is None
    assert config.serve.port == 8000  # untouched default
    assert load_config(None, []).model == "tiny"


def test_dumped_config_loads_back_identically(tmp_path):
    config = load_config(None, ["train.batch_size=7", "actor.behav_imp_weight_cap=null"])
    path = tmp_path / "dump.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_every_shipped_config_loads():
    from pathlib import Path

    paths = sorted(Path("configs").glob("*.yaml"))
    assert len(paths) >= 9
    for path in paths:
        load_config(path)


def test_configs_readme_says_what_each_shipped_config_is_for():
    from pathlib import Path

    readme = Path("configs/README.md").read_text()
    assert [p.name for p in sorted(Path("configs").glob("*.yaml")) if f"`{p.name}`" not in readme] == []


def test_promotion_defaults_offline_off_local_gate_live_canary():
    assert load_config("configs/arith_tiny.yaml").promotion.mode == "off"
    assert load_config(None).promotion.mode == "off"
    assert load_config(None, ["promotion.mode=off"]).promotion.mode == "off"  # YAML's `off` is false
    assert load_config("configs/local.yaml").promotion.mode == "gate"
    assert load_config("configs/live.yaml").promotion.mode == "canary"


@pytest.mark.parametrize("interval, eta, enabled", [(1, 0, "true"), (2, 1, "true"), (5, 4, "true"), (2, 0, "false")])
def test_weight_update_intervals_that_reach_the_next_announcement_are_accepted(interval, eta, enabled):
    """The driver admits up to η + 1 steps' samples past the newest announced version; an
    interval of at most η + 1 steps announces the next one within them. Without rollouts
    (live traffic only) nothing is admitted, so nothing waits."""
    config = load_config(None, [f"train.weight_update_interval={interval}", f"rollout.max_head_offpolicyness={eta}",
                                f"rollout.enabled={enabled}"])
    assert (config.train.weight_update_interval, config.rollout.max_head_offpolicyness) == (interval, eta)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.use_decoupled_loss=true", "actor.recompute_logprobs=false"],
         "actor.use_decoupled_loss=true requires actor.recompute_logprobs=true"),
        (["actor.eps_clip=-1"], "actor.eps_clip: "),
        (["serve.prot=1"], "serve.prot: unknown key"),
        (["train.batch_size=many"], "train.batch_size: "),
        (["rollout.max_head_offpolicyness=-1"], "rollout.max_head_offpolicyness: "),
        (["nosuchsection.x=1"], "nosuchsection: unknown key"),
        (["train=3"], "train: "),
        (["novalue"], "expected key=value"),
        (["bus.replicas=3"], "bus.replicas=3 needs a JetStream cluster"),
        (['deploy.resources={trainer: {GPU: 1}}'], "deploy.resources: 'trainer' is not a loop"),
        (["deploy.loops=[collect, judge, train]"], "set rollout.endpoint to the gateways' URL"),
        (["bus.replicas=0"], "bus.replicas: "),
        (["promotion.mode=canary"], "promotion.gate.suites: the gate needs at least one suite"),
        (["promotion.mode=gate", "promotion.gate.suites=[{name: x, env: digits, items: 1}]"], "promotion.gate.suites.0.items"),
        (["promotion.mode=sometimes"], "promotion.mode: "),
        (["promotion.gate.suites=[{name: x}]"], "promotion.gate.suites.0: env: an env suite needs the environment"),
        (["promotion.gate.suites=[{name: x, env: digits, window: 9}]"], "promotion.gate.suites.0: window: only for source: traffic"),
        (["promotion.gate.suites=[{name: x, source: traffic, env: digits}]"], "promotion.gate.suites.0: env: a traffic suite's items"),
        (["promotion.gate.suites=[{name: x, source: traffic, items: 4}]"], "promotion.gate.suites.0: min_items: 8 is more than items"),
        (["promotion.gate.suites=[{name: x, source: traffic, max_invalid: 2}]"], "promotion.gate.suites.0.max_invalid: "),
        (["promotion.mode=canary", "promotion.gate.suites=[{name: x, env: digits}]"], "the rollout driver waits for the trainer"),
        (["bus.url=nats://a:4222,http://b:4222"], "bus.url: 'http://b:4222' is not a NATS URL"),
        (["bus.url=nats://a:4222,"], "bus.url: '' is not a NATS URL"),
        (["serve.device=gpu"], "serve.device: "),
        (["serve.dtype=float16"], "serve.dtype: Input should be 'float32' or 'bfloat16'"),
        (["serve.chunked_prefill_size=0"], "serve.chunked_prefill_size: "),
        (["serve.max_stall_s=-0.1"], "serve.max_stall_s: Input should be greater than or equal to 0"),
        (["serve.swap_weights=false"], "serve.swap_weights=false needs serve.engine_urls"),
        (["train.weight_update_interval=2", "rollout.max_head_offpolicyness=0"],
         "train.weight_update_interval=2 with rollout.max_head_offpolicyness=0 can deadlock"),
        (["train.weight_update_interval=5", "rollout.max_head_offpolicyness=3"],
         "train.weight_update_interval=5 with rollout.max_head_offpolicyness=3 can deadlock"),
        (["adapters.kind=lora", "promotion.mode=gate", "promotion.gate.suites=[{name: x, env: digits}]"],
         "adapters.kind=lora with promotion.mode on and rollout.enabled=true"),
        (["promotion.mode=gate", "promotion.gate.suites=[{name: x, env: digits}]", "tenants={acme: {keys: [k]}}"],
         "promotion.mode on with tenants' keys needs serve.admin_key"),
        (["adapters.kind=lora", "train.fsdp=true"], "adapters.kind=lora with train.fsdp"),
        (["adapters.scope=everyone"], "adapters.scope: "),
        (["adapters.rank=0"], "adapters.rank: "),
        (["tenants={acme: {adapter_scope: family}}"], "tenants.acme.adapter_scope: "),
        (["tenants={shared: {keys: [k]}}"], "tenants: 'shared' is reserved"),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_no_tenant_may_take_the_shared_adapters_name():
    from flywheel.config.tenants import RESERVED_NAMES
    from flywheel.models.adapter_names import SHARED

    assert SHARED in RESERVED_NAMES


def test_file_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    bad.write_text("train: {batch_size: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_override_values_parse_as_yaml():
    assert parse_overrides(["a.b=1", "a.c=true", "d=0.5", "e=[1, 2]", "f=text", "g="]) == {
        "a": {"b": 1, "c": True}, "d": 0.5, "e": [1, 2], "f": "text", "g": ""
    }


def test_exponent_floats_coerce_for_float_keys():
    assert load_config(None, ["actor.optimizer.lr=3e-4"]).actor.optimizer.lr == 3e-4


def test_a_moved_key_is_refused_saying_where_it_went():
    with pytest.raises(ConfigError, match=r"gconfig: moved to rollout.sampling; train.opd_coef: moved to actor.opd_coef"):
        load_config(None, ["gconfig.n_samples=2", "train.opd_coef=0.5"])


def test_the_hint_teacher_runs_exactly_when_the_judge_reads_words():
    assert not load_config(None, ["judge.kind=rule"]).judge.teaches()
    assert load_config(None, ["judge.kind=next_state"]).judge.teaches()
    assert not load_config(None, ["judge.kind=next_state", "judge.teacher.enabled=false"]).judge.teaches()
    assert load_config(None, ["judge.kind=rule", "judge.teacher.enabled=true"]).judge.teaches()
