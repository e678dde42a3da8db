"""Ray node drill: the loops placed on a real two-node Ray cluster by `deploy.resources`, then
kill -9 of the worker node hosting the trainer, under load (`flywheel/drills/ray_node.py` says
how; tests/test_ray_cluster.py runs the same drill).

    .venv/bin/python bench/ray_node_drill.py [--every-s 5]     # writes bench/results/ray_node_drill.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS  # noqa: E402
from flywheel.drills.ray_node import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(default_out=RESULTS / "ray_node_drill.json"))
