"""`flywheel train` end to end, as a user runs it: the shipped `arith_tiny` config through
all four loops; its outputs; `--resume`; a used run_dir refused; and the staleness bound at
η = 0, 1 and 4: no trained sample's oldest token is ever more than η versions old."""

import json
import signal
import subprocess
from pathlib import Path

from flywheel.cli import command

from waiting import until_sync

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/arith_tiny.yaml"


def train_run(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*command("train"), "--config", CONFIG, "--refresh-s", "0.2", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_stopped_by_sigterm_keeps_its_outputs_and_resumes_within_its_staleness_bound(tmp_path):
    """η = 0 (synchronous) until SIGTERM after step 2: a clean stop, every step's metrics, a
    checkpoint of the last step and the summary. Without --resume the run_dir is refused. Resumed
    at η = 2 (the driver now runs ahead of the trainer) it goes on from the next step to
    max_steps, no trained sample more than 2 versions behind, and draws new tasks."""
    run_dir = tmp_path / "run"
    child = subprocess.Popen([*command("train"), "--config", CONFIG, "--refresh-s", "0.2", f"run_dir={run_dir}",
                              "train.max_steps=10000", "train.batch_size=8", "rollout.max_head_offpolicyness=0"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def at_step_2() -> bool:
            assert child.poll() is None, "the run ended before step 2"
            return (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().count("\n") >= 2

        until_sync(at_step_2, timeout_s=240, poll_s=0.2)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=120) == 0, child.stderr.read()[-3000:]
    finally:
        child.kill()
    lines = metrics(run_dir)
    last = lines[-1]["step"]
    assert last >= 2 and [m["step"] for m in lines] == list(range(1, last + 1))
    for key in ("version", "reward_mean", "staleness_max", "n_samples", "loss", "elapsed_s", "clip_fraction",
                "behav_weight_mean", "staleness_hist", "entropy", "grad_norm", "tokens", "lr"):
        assert key in lines[0], key
    assert all(m["staleness_max"] == 0 and m["n_samples"] == 8 for m in lines)  # η = 0: synchronous
    assert (run_dir / "checkpoints" / f"step-{last:08d}" / "state.pt").exists()  # the last step, saved on the way out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == last and summary["eta"] == 0
    drawn = json.loads((run_dir / "rollout_state.json").read_text())["tasks_drawn"]

    refused = train_run(f"run_dir={run_dir}", f"train.max_steps={last + 3}")
    assert refused.returncode == 2 and "pass --resume" in refused.stderr

    eta = 2
    resumed = train_run("--resume", f"run_dir={run_dir}", f"train.max_steps={last + 3}", "train.batch_size=8",
                        f"rollout.max_head_offpolicyness={eta}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(1, last + 4))
    for m in lines[last:]:
        assert m["staleness_max"] <= eta and all(int(staleness) <= eta for staleness in m["staleness_hist"])
    assert (run_dir / "reward_curve.png").stat().st_size > 10_000
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == last + 3
    assert json.loads((run_dir / "rollout_state.json").read_text())["tasks_drawn"] > drawn


def test_at_temperature_0_7_and_eta_0_the_trainer_reproduces_the_engine(tmp_path):
    """The digits task (partial rewards, so advantages are not all zero) through flywheel train:
    every step trains whole groups, nothing twice, recomputes the engine's log-probs to float
    noise, and the PPO clip fires. Answers of 64 tokens: at 16, a digit is so rare in the
    untrained model's answers that all four steps could go without a reward (advantages all 0,
    nothing to clip; a fresh clone failed so); at 64, 11 steps in 12 clipped."""
    run_dir = tmp_path / "run"
    done = subprocess.run([*command("train"), "--config", "configs/local.yaml", "--refresh-s", "0.2",
                           f"run_dir={run_dir}", "serve.port=0", "train.max_steps=4", "train.batch_size=8",
                           "rollout.max_head_offpolicyness=0", "rollout.sampling.temperature=0.7", "rollout.sampling.max_new_tokens=64",
                           "promotion.mode=off"],  # flywheel train's own default; tests/test_rollout.py has η = 0 under a gate
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = metrics(run_dir)
    assert len(lines) == 4
    for m in lines:
        assert m["groups_split"] == 0 and m["duplicates_dropped"] == 0 and m["n_samples"] == 8
        assert m["gap_tokens"] > 0 and m["behav_logprob_gap"] < 1e-4
    assert max(m["clip_fraction"] for m in lines) > 0
