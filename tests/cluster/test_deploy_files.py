"""deploy/: the Serve config is what `serve run` accepts, the RayService embeds the same
applications, and the builders' args are dynvm's (checked without starting Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from dynvm.cluster.protocol._http_front import model_app_name
from dynvm.cluster.serving.serve_app import ModelAppArgs, build_server_app
from dynvm.cluster.serving.serving_config import Autoscaling, BatchingOptions, ServingConfig
from dynvm.jit.config import JitConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _serve_config() -> dict:
    return yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())


def _rayservice() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text()))


def _check_applications(config: dict) -> None:
    schema = ServeDeploySchema.model_validate(config)
    apps = {app.name: app for app in schema.applications}
    server = apps.pop("dynvm-server")
    assert server.route_prefix == "/v2"
    assert server.import_path == "dynvm.cluster.serving.serve_app:build_server_app"
    models = server.args["models"]
    assert sorted(models) == sorted(app.args["name"] for app in apps.values())
    for name, app in apps.items():
        args = ModelAppArgs.from_args(app.args)
        # ServerFront finds a model's app by this name (readiness), the proxy by prefix.
        assert name == model_app_name(args.name)
        assert app.route_prefix == f"/v2/models/{args.name}"
        assert app.import_path == "dynvm.cluster.serving.serve_app:build_model_app"
        assert isinstance(args.serving, ServingConfig)


def test_serve_config_is_a_valid_serve_deploy_schema():
    _check_applications(_serve_config())


def test_rayservice_embeds_the_same_serve_config():
    docs = _rayservice()
    kinds = [doc["kind"] for doc in docs]
    assert kinds == ["Deployment", "Service", "RayService"]
    service = docs[2]
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    _check_applications(embedded)
    assert embedded == _serve_config()
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    gpu = cluster["workerGroupSpecs"][0]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    for pod in (cluster["headGroupSpec"], gpu):
        env = {e["name"]: e for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert env["DYNVM_STORE_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "dynvm-store"
        assert env["DYNVM_REDIS_URL"]["value"].startswith("redis://dynvm-redis:6379")
        assert "secretKeyRef" in env["DYNVM_REDIS_PASSWORD"]["valueFrom"]


def test_redis_deployment_uses_deploy_redis_conf():
    deployment, redis_service, _ = _rayservice()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "/etc/redis/redis.conf"
    assert deployment["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == \
        "dynvm-redis-conf"
    assert redis_service["spec"]["ports"][0]["port"] == 6379
    conf = (DEPLOY / "redis.conf").read_text()
    assert "\nmaxmemory-policy allkeys-lru\n" in conf and "\nmaxmemory " in conf


def test_builder_args_take_the_compile_service_shards():
    args = ModelAppArgs.from_args({"name": "m", "path": "/m.dvm", "service_shards": 4})
    assert args.service_shards == 4
    assert ModelAppArgs.from_args({"name": "m", "path": "/m.dvm"}).service_shards == 1


def test_builder_args_are_checked():
    with pytest.raises(ValueError, match="unknown dynvm model app arg 'replicas'"):
        ModelAppArgs.from_args({"name": "m", "path": "/m.dvm", "replicas": 2})
    with pytest.raises(ValueError, match="need 'path'"):
        ModelAppArgs.from_args({"name": "m"})
    with pytest.raises(ValueError, match="unknown batching key 'batch_wait_timeout_s'"):
        ModelAppArgs.from_args({"name": "m", "path": "/m.dvm",
                                "batching": {"batch_wait_timeout_s": 0.01}})
    with pytest.raises(ValueError, match="unknown autoscaling key 'max'"):
        ModelAppArgs.from_args({"name": "m", "path": "/m.dvm", "autoscaling": {"max": 3}})
    with pytest.raises(ValueError, match="service_shards must be an integer >= 1"):
        ModelAppArgs.from_args({"name": "m", "path": "/m.dvm", "service_shards": 0})
    with pytest.raises(ValueError, match="need 'models'"):
        build_server_app({})
    with pytest.raises(ValueError, match="must match"):
        build_server_app({"models": ["bad name"]})


def test_the_serve_config_args_are_one_serving_config():
    app = _serve_config()["applications"][0]
    serving = ModelAppArgs.from_args(app["args"]).serving
    assert serving == ServingConfig(
        device="auto", jit=JitConfig(online_compile=True), num_cpus=1,
        batching=BatchingOptions(max_batch_size=8, max_delay_s=0.002),
        autoscaling=Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=2,
                                upscale_delay_s=3, downscale_delay_s=30))
    bare = ModelAppArgs.from_args({"name": "m", "path": "/m.dvm"})
    assert bare.serving == ServingConfig()  # the builder adds no defaults of its own
