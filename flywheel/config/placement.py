"""Where Ray places an actor: a resources mapping from the configuration as Ray actor options.

The same mapping serves every placement setting (`deploy.resources.<loop>`,
`rollout.env_worker_resources`): `CPU` and `GPU` are Ray's own resources, reserved only when
named (the loops are long-lived services; a reservation on a small machine can starve Ray's own
tasks), and every other key is a custom resource that only the nodes started with it advertise
(`ray start --resources '{"trainer": 1}'`), which is how a loop is pinned to a kind of node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def ray_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """`{CPU: 1, trainer: 1}` -> `{num_cpus: 1, num_gpus: 0, resources: {trainer: 1}}`."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0), "resources": custom}
