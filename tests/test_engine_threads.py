"""How many torch threads the embedded engine computes on: every core a gateway alone may use,
one for each serve loop of a deployment (its loops share the machine), what the user sets either
way (`serve.torch_threads`)."""

import os

import torch

from flywheel.config import load_config
from flywheel.deploy.deployment import Deployment
from flywheel.serve.engine import cpu_threads as threads
from flywheel.serve.engine.cpu_threads import torch_threads
from flywheel.serve.loop import ServeLoop


def test_unset_means_every_core_this_process_may_use_within_its_cgroup_quota(tmp_path, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    assert torch_threads(3) == 3
    monkeypatch.setattr(threads, "CPU_MAX", tmp_path / "absent")
    assert torch_threads(None) == cores
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "CPU_MAX", quota)
    quota.write_text("max 100000\n")
    assert torch_threads(None) == cores
    quota.write_text("50000 100000\n")  # half a core: one thread
    assert torch_threads(None) == 1
    quota.write_text(f"{100000 * cores + 1} 100000\n")  # more than the affinity allows
    assert torch_threads(None) == cores


async def test_a_gateway_alone_computes_on_every_core_unless_told(nats_url, tmp_path):
    before = torch.get_num_threads()
    try:
        for overrides, expected in (([], torch_threads(None)), (["serve.torch_threads=1"], 1)):
            torch.set_num_threads(7)  # neither
            loop = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "model=tiny", *overrides]), nats_url)
            await loop.start()
            try:
                assert torch.get_num_threads() == expected
            finally:
                await loop.stop()
    finally:
        torch.set_num_threads(before)


def test_a_deployments_serve_loops_share_the_machine_unless_told(tmp_path):
    shared = Deployment(load_config(None, [f"run_dir={tmp_path}"]))
    assert shared.config.serve.torch_threads == 1
    told = Deployment(load_config(None, [f"run_dir={tmp_path}", "serve.torch_threads=2"]))
    assert told.config.serve.torch_threads == 2
    assert load_config(None, []).serve.torch_threads is None
