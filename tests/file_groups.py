"""How `make test` spreads the suite over its xdist workers: each test file whole in one worker
(as `--dist loadfile`), and the files that start Ray clusters of their own in two groups, each
whole in one worker, its files one after another: so at most two Ray clusters run at once. Side
by side on two cores, three Ray clusters and their loops left a raylet unregistered past Ray's
fixed 30 s ("The current node timed out during startup"). One group (about ten minutes of
tests) left the two other workers the rest: the one fresh clone so took 916 s against 775 an
hour before without, the host's drift not told apart (odd things 15).

xdist's own `--dist loadgroup` would say this with `xdist_group` marks, but it carries the group
by rewriting each test's node id, which pytest 9.2 no longer lets it do (pytest-xdist#1386): the
marks are then ignored and a file's tests run in several workers at once (two `test_sft.py`
tests built their module's SWE demonstrations in the same sandbox slot at once, and each removed
the other's working copy). A scheduler of our own groups by the node id's file instead, which
both versions agree on.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from xdist.scheduler import LoadScopeScheduling

RAY_CLUSTERS = {"test_deploy_loop.py": "ray-clusters-1", "test_deploy_gate.py": "ray-clusters-1",
                "test_deploy.py": "ray-clusters-2", "test_episodes.py": "ray-clusters-2",
                "test_ray_cluster.py": "ray-clusters-2"}
"""The files whose tests start Ray clusters (`flywheel up`, `ray_session`, `ray start`), and
their group: two of about five minutes each (one fresh clone's test durations)."""


class FileGroupScheduling(LoadScopeScheduling):
    """`loadfile` scheduling where the files of one group (`groups`: file name -> group) share a
    unit."""

    def __init__(self, config, log=None, groups: dict[str, str] = RAY_CLUSTERS):
        super().__init__(config, log)
        self.groups = groups

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return self.groups.get(PurePosixPath(path).name, path)
