"""deploy/networkpolicy.yaml and the grace periods of deploy/rayservice.yaml (issues 28
and 35): the policies select the manifests' own pods and open only what the cluster
needs; a pod's grace period covers Ray's node drain, which covers each replica's."""

from __future__ import annotations

from pathlib import Path

import yaml

from dynvm.cluster.serving.serve_app import ModelAppArgs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _documents(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def _ray_templates() -> list[dict]:
    service = next(d for d in _documents("rayservice.yaml") if d["kind"] == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["workerGroupSpecs"]]


def test_policies_select_the_manifests_pods_and_open_only_what_is_needed():
    policies = {d["metadata"]["name"]: d for d in _documents("networkpolicy.yaml")}
    assert {d["kind"] for d in policies.values()} == {"NetworkPolicy"}
    redis = next(d for d in _documents("rayservice.yaml") if d["kind"] == "Deployment")
    ray_labels = [t["metadata"]["labels"] for t in _ray_templates()]
    ray_selector = policies["dynvm-ray"]["spec"]["podSelector"]["matchLabels"]
    assert all(ray_selector.items() <= labels.items() for labels in ray_labels)
    redis_selector = policies["dynvm-redis"]["spec"]["podSelector"]["matchLabels"]
    assert redis_selector.items() <= redis["spec"]["template"]["metadata"]["labels"].items()

    # Redis: 6379 from Ray's pods, nothing else.
    (rule,) = policies["dynvm-redis"]["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": ray_selector}}]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    # Ray: any port from Ray's pods; from elsewhere only Serve's HTTP and, for the
    # operator, the dashboard.
    from_anywhere = set()
    for rule in policies["dynvm-ray"]["spec"]["ingress"]:
        sources = rule.get("from")
        if sources == [{"podSelector": {"matchLabels": ray_selector}}]:
            continue
        ports = {p["port"] for p in rule["ports"]}
        if sources is None:
            from_anywhere |= ports
        else:
            assert ports == {8265} and all("podSelector" in s for s in sources), rule
    assert from_anywhere == {8000}


def test_grace_periods_cover_the_drains():
    service = next(d for d in _documents("rayservice.yaml") if d["kind"] == "RayService")
    apps = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    drains = [ModelAppArgs.from_args(a["args"]).serving.drain_s for a in apps
              if a["import_path"].endswith(":build_model_app")]
    assert drains
    for template in _ray_templates():
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        node_drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        assert template["spec"]["terminationGracePeriodSeconds"] > node_drain > max(drains)
