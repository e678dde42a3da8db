"""How `make test` spreads the suite over its xdist workers: each test file whole in one worker
(as `--dist loadfile`), and the files that start Ray clusters of their own together in one, one
after another: side by side on two cores, three Ray clusters and their loops left a raylet
unregistered past Ray's fixed 30 s ("The current node timed out during startup").

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

RAY_CLUSTERS = frozenset({"test_deploy.py", "test_deploy_gate.py", "test_deploy_loop.py",
                          "test_episodes.py", "test_ray_cluster.py"})
"""The files whose tests start Ray clusters (`flywheel up`, `ray_session`, `ray start`)."""


class FileGroupScheduling(LoadScopeScheduling):
    """`loadfile` scheduling where the files named in `groups` (file name -> group) share a unit."""

    def __init__(self, config, log=None, groups: dict[str, str] | None = None):
        super().__init__(config, log)
        self.groups = {name: "ray-clusters" for name in RAY_CLUSTERS} if groups is None else groups

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return self.groups.get(PurePosixPath(path).name, path)
