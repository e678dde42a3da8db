"""The trainer's adapters beyond `adapters.train_resident` (the least recently trained) wait on
disk and come back exactly as they left; a checkpoint names them by file, forgetting deletes the
files (and whatever else no checkpoint state names), and a second trainer on the same run
directory leaves a live trainer's files alone."""

import subprocess
import sys

import pytest
import torch

from flywheel.config import ConfigError, load_config
from flywheel.train.checkpoint import FILES, Checkpoints
from flywheel.train.forget_adapters import scrub
from flywheel.train.loop import TrainLoop

from adapter_training import (
    LORA,
    lora_trainer,
    one_adapters_step,
    optimizer_state,
    same,
    take_step,
)
from factories import sampled_turns


async def test_beyond_train_resident_adapters_wait_on_disk_and_come_back_exactly(tmp_path):
    """`train_resident: 1`: after each step only its adapter is in memory, the others in files;
    six steps over three adapters leave every adapter's weights, moments and schedule exactly as
    an unbounded trainer's."""
    turns = await sampled_turns(12)
    config = load_config(None, [*LORA, "adapters.train_resident=1"])
    bounded, unbounded = lora_trainer(config, adapter_dir=tmp_path / "resident"), lora_trainer(config)
    for i, name in enumerate(["alice", "bob", "carol"] * 2):
        for trainer in (bounded, unbounded):
            torch.manual_seed(i)  # a new adapter's initialisation the same in both (they share the RNG)
            take_step(trainer, one_adapters_step(turns, i, name, config), {name: 0})
        assert list(bounded.adapters.keys) == [name] and set(bounded.adapters.spilled) == set(bounded.adapters.names()) - {name}
        assert sorted(bounded.adapters.spilled.values()) == sorted((tmp_path / "resident").iterdir())
    assert len(unbounded.adapters.keys) == 3
    for name in ("alice", "bob", "carol"):
        assert same(bounded.adapters.weights(name), unbounded.adapters.weights(name))
        assert bounded.adapters.steps[name] == unbounded.adapters.steps[name] == 2
        for ours, theirs in zip(optimizer_state(bounded, name), optimizer_state(unbounded, name)):
            assert same(ours, theirs)


async def test_a_checkpoint_names_adapters_on_disk_by_file_and_forgetting_deletes_the_files(tmp_path):
    turns = await sampled_turns(4)
    config = load_config(None, [*LORA, "adapters.train_resident=1"])
    trainer = lora_trainer(config, adapter_dir=tmp_path / "a")
    for i, name in enumerate(["alice", "bob"]):
        take_step(trainer, one_adapters_step(turns, i, name, config), {name: 0})
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2)
    path = checkpoints.save(2, None, {"trainer": trainer.state(), "loop": {}})
    saved = torch.load(path / "state.pt", weights_only=False)["trainer"]["adapters"]
    assert [a["name"] for a in saved] == ["alice", "bob"] and "file" in saved[0] and "weights" in saved[1]
    kept = path / saved[0]["file"].path
    assert kept.is_file() and kept.stat().st_nlink == 2  # linked, not copied, from the trainer's own file

    again = lora_trainer(config, adapter_dir=tmp_path / "b")
    again.restore(checkpoints.load(path, None)["trainer"])
    for name in ("alice", "bob"):  # restored exactly, alice read from its file as it comes back
        assert same(again.adapters.weights(name), trainer.adapters.weights(name))

    restored = lora_trainer(config, adapter_dir=tmp_path / "c")
    restored.restore(checkpoints.load(path, None)["trainer"])
    assert set(restored.adapters.spilled) == {"alice"} and list(restored.adapters.keys) == ["bob"]
    on_disk = restored.adapters.spilled["alice"]
    restored.adapters.drop("alice")  # forgotten: its file goes, in the trainer's directory and the checkpoint's
    assert not on_disk.exists() and "alice" not in restored.adapters
    assert scrub(checkpoints, {"alice"}) == 1 and not kept.exists()


async def test_an_adapter_that_cannot_be_read_back_stays_on_disk_and_a_checkpoint_keeps_recency(tmp_path):
    turns = await sampled_turns(6)
    config = load_config(None, [*LORA, "adapters.train_resident=2"])
    trainer = lora_trainer(config, adapter_dir=tmp_path / "a")
    for i, name in enumerate(["alice", "bob", "carol"]):
        take_step(trainer, one_adapters_step(turns, i, name, config), {name: 0})
    trainer.adapters.activate("bob")  # used after carol
    trainer.adapters.state()  # a checkpoint reads every adapter: the order of use stays as it was
    assert list(trainer.adapters.keys) == ["carol", "bob"] and list(trainer.adapters.spilled) == ["alice"]
    path = trainer.adapters.spilled["alice"]
    saved = path.read_bytes()
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(Exception):
        trainer.adapters.activate("alice")
    assert list(trainer.adapters.spilled) == ["alice"] and "alice" not in trainer.adapters.keys  # not reset to zero
    path.write_bytes(saved)
    trainer.adapters.activate("alice")
    assert list(trainer.adapters.keys) == ["carol", "bob", "alice"] and not path.exists()


async def test_forgetting_sweeps_the_checkpoints_files_that_no_state_names(tmp_path):
    """Alice and bob wait on disk, carol in memory; a file a crash left sits in the checkpoint's
    files too. Forgetting alice deletes her file and the stray one; bob's stays and restores."""
    turns = await sampled_turns(6)
    config = load_config(None, [*LORA, "adapters.train_resident=1"])
    trainer = lora_trainer(config, adapter_dir=tmp_path / "a")
    for i, name in enumerate(["alice", "bob", "carol"]):
        take_step(trainer, one_adapters_step(turns, i, name, config), {name: 0})
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2)
    path = checkpoints.save(3, None, {"trainer": trainer.state(), "loop": {}})
    (path / FILES / "left-by-a-crash").write_bytes(b"x")
    assert len(list((path / FILES).iterdir())) == 3
    assert scrub(checkpoints, {"alice"}) == 1
    [bobs] = [a["file"].path.name for a in torch.load(path / "state.pt", weights_only=False)["trainer"]["adapters"] if "file" in a]
    assert [p.name for p in (path / FILES).iterdir()] == [bobs]
    restored = lora_trainer(config, adapter_dir=tmp_path / "b")
    restored.restore(checkpoints.load(path, None)["trainer"])
    assert sorted(restored.adapters.names()) == ["bob", "carol"]
    assert same(restored.adapters.weights("bob"), trainer.adapters.weights("bob"))


HOLD = "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); input()"


async def test_a_second_trainer_on_a_live_run_directory_leaves_its_adapter_files_alone(nats_url, tmp_path):
    """Another process's trainer holds the run directory: a second one refuses before it empties
    the directory where the live one keeps its adapters."""
    kept = tmp_path / "trainer_adapters" / "alice.pt"
    kept.parent.mkdir()
    kept.write_bytes(b"the live trainer's adapter")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "train.lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        refused = TrainLoop(load_config(None, [f"run_dir={tmp_path}", *LORA]), nats_url)
        with pytest.raises(ConfigError, match="one trainer per run directory"):
            await refused.start()
    finally:
        holder.kill()
        holder.wait()
    assert kept.read_bytes() == b"the live trainer's adapter"
    assert refused.bus.nc.is_closed  # no connection left behind to reconnect forever once the server goes
