"""The container image and Kubernetes manifests (packaging/container, packaging/kubernetes):
core kinds validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict),
and every number they share with qvld checked against qvld itself: the container's
config through qvld's own schema, ports, probes, the metric names the endpoint picker
and KEDA are told. (No image builder or cluster runs here; the CRD kinds, InferencePool,
HTTPRoute and ScaledObject, have no schema here and are checked for what they name.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from qvld.config_loading import load_config
from qvld.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "packaging/kubernetes"
CONTAINERFILE = (ROOT / "packaging/container/Containerfile").read_text()
CONFIG = load_config(ROOT / "packaging/container/qvld.yaml")
CORE = ("Deployment", "Service", "PodDisruptionBudget")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base() -> dict[str, dict[str, Any]]:
    """The base's resources by kind, as its kustomization lists them."""
    kustomization = yaml.safe_load((K8S / "base/kustomization.yaml").read_text())
    out = {}
    for name in kustomization["resources"]:
        for doc in documents(K8S / "base" / name):
            out[doc["kind"]] = doc
    return out


def port(listen: str | None) -> int:
    assert listen
    return int(listen.rpartition(":")[2])


@pytest.mark.parametrize("version", ["1.37.0", "1.29.0"])
@pytest.mark.parametrize("path", sorted(K8S.rglob("*.yaml")), ids=lambda p: p.name)
def test_core_kinds_validate_strictly(path: Path, version: str) -> None:
    for doc in documents(path):
        if doc["kind"] in CORE:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_base_is_what_its_kustomization_lists() -> None:
    resources = base()
    assert set(resources) == set(CORE)
    kustomization = yaml.safe_load((K8S / "base/kustomization.yaml").read_text())
    container = resources["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert [i["name"] for i in kustomization["images"]] == [container["image"]]
    labels = resources["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for selector in (resources["Deployment"]["spec"]["selector"]["matchLabels"],
                     resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                     resources["Service"]["spec"]["selector"]):
        assert selector.items() <= labels.items()


def test_ports_probes_and_user_agree_with_qvlds_config() -> None:
    http, metrics = port(CONFIG.http.listen), port(CONFIG.metrics.listen)
    deployment = base()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": http, "metrics": metrics}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # drain on SIGTERM fits in the grace period, after the preStop pause
    assert pod["terminationGracePeriodSeconds"] > CONFIG.server.drain_timeout_s + 5
    # the model is mounted read-only where the config looks; the cache is writable
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert CONFIG.model.path is not None and CONFIG.model.cache_dir is not None
    assert mounts[str(CONFIG.model.path.parent)]["readOnly"] is True
    assert not mounts[str(CONFIG.model.cache_dir)].get("readOnly")
    assert CONFIG.http.api_keys_file is not None
    assert mounts[str(CONFIG.http.api_keys_file.parent)]["readOnly"] is True
    assert str(CONFIG.server.socket.parent) in mounts
    # the image: the same ports, a numeric non-root user, /health as its health check
    assert re.search(rf"^EXPOSE {http} {metrics}$", CONTAINERFILE, re.M)
    user = re.search(r"^USER (\d+):(\d+)$", CONTAINERFILE, re.M)
    assert user and int(user[1]) == pod["securityContext"]["runAsUser"] != 0
    assert f"http://127.0.0.1:{http}/health" in CONTAINERFILE
    # one lock file for the .deb, the installer and the image, hash-checked
    assert "--require-hashes -r /src/requirements.lock" in CONTAINERFILE
    service = {p["name"]: p["port"] for p in base()["Service"]["spec"]["ports"]}
    assert service == ports


def metric_names() -> set[str]:
    names = set()
    for family in Metrics(CollectorRegistry()).registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_the_endpoint_picker_and_keda_are_told_metrics_that_exist() -> None:
    pool, epp, _, route = documents(K8S / "examples/inferencepool.yaml")
    known = metric_names()
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(a[2:].split("=", 1) for a in args)
    for flag in ("total-queued-requests-metric", "total-running-requests-metric",
                 "kv-cache-usage-percentage-metric", "cache-info-metric"):
        assert flags[flag] in known, flag
    assert int(flags["model-server-metrics-port"]) == port(CONFIG.metrics.listen)
    assert pool["spec"]["targetPorts"] == [{"number": port(CONFIG.http.listen)}]
    assert pool["spec"]["selector"]["matchLabels"].items() <= base()["Deployment"][
        "spec"]["template"]["metadata"]["labels"].items()
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]
    (scaled,) = documents(K8S / "examples/keda-scaledobject.yaml")
    assert scaled["spec"]["scaleTargetRef"]["name"] == base()["Deployment"]["metadata"]["name"]
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert re.match(r"sum\((\w+)\{", query)[1] in known  # type: ignore[index]
