"""The loops on a real two-node Ray cluster (two `ray start` processes on this machine), placed
by `deploy.resources`; kill -9 of the node hosting the trainer under load, a new node joins, and
Ray restarts the trainer there: nothing lost, duplicated or trained twice (bench/ray_node_drill.py,
run as its own process so that it owns its Ray connection)."""

import json
import subprocess
import sys


def test_loops_land_where_placed_and_the_trainer_survives_the_loss_of_its_node(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "flywheel.drills.ray_node", "--every-s", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {"serve": ["head"], "collect": ["head"], "judge": ["head"], "train": ["trainer"]}
    assert report["placement"] == expected and report["placement_after"] == expected, report
    answered = report["sessions_answered"]
    assert answered > 0 and report["sessions_failed"] == 0 and report["server_errors"] == 0, report
    assert report["complete"] == answered and report["lost"] == report["truncated"] == 0, report
    assert report["trained"] == answered and report["trained_twice"] == 0 and report["duplicated_samples"] == 0, report
    assert report["versions_increasing"], report
    assert done.returncode == 0, done.stderr[-3000:]
