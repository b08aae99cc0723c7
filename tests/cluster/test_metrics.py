"""Observability of a running cluster, on a real local Ray cluster with Serve:

- ReplicaMetrics on a real Serve replica: counter increases by delta (restarts too),
  gauges, store counts, and the values as Ray's Prometheus endpoint exports them, with
  the model tag and Serve's replica tag;
- `dynvm top --once` against real ModelReplica deployments over HTTP.

One module-scoped Ray cluster (start-up dominates the run time), shut down at the end.
"""

from __future__ import annotations

import http.client
import json
import re
import time

import pytest
import torch

from tests.cluster._cluster_helpers import local_serve
from tests.cluster._redis_server import free_port
from tests.jit._jit_helpers import compiled, eager_config

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
prom_parser = pytest.importorskip("prometheus_client.parser")

import dynvm  # noqa: E402
from dynvm.cli import main  # noqa: E402
from dynvm.cluster import (  # noqa: E402
    ArtifactCache,
    BatchingOptions,
    LocalDirStore,
    serve_models,
)
from dynvm.cluster.fleet._records import store_counters  # noqa: E402
from dynvm.jit.artifact import cache_key  # noqa: E402

pytestmark = pytest.mark.slow

PROBE_MODEL = "probe-model"
TOOLCHAIN = {"dynvm": "0.1.0", "torch": "2.13.0", "python": "3.11", "triton": "none"}
EXPECT = {"target": "cpu", "toolchain": TOOLCHAIN}




def _probe_deployment():
    # Defined in a function so that Ray ships the class by value (the test module is not
    # importable on the workers).
    from dynvm.cluster.serving._metrics import ReplicaMetrics

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class MetricsProbe:
        def __init__(self, model_name: str) -> None:
            self.metrics = ReplicaMetrics(model_name)

        def update(self, stats: dict) -> dict:
            return self.metrics.update(stats)

        def observe(self, seconds: float) -> None:
            self.metrics.observe_request(seconds)

    return MetricsProbe


class Cluster:
    def __init__(self, http_port: int, metrics_port: int, probe) -> None:
        self.url = f"http://127.0.0.1:{http_port}"
        self.http_port = http_port
        self.metrics_port = metrics_port
        self.probe = probe

    def post_json(self, path: str, doc) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=60)
        try:
            conn.request("POST", path, json.dumps(doc).encode(),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def scrape(self) -> dict[tuple[str, frozenset], float]:
        """{(sample name, frozenset of label items): value} of the dynvm series."""
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        samples = {}
        for family in prom_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("ray_dynvm_"):
                    samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return samples


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    path = str(tmp / "branchy.dvm")
    dynvm.save(compiled("branchy"), path)
    metrics_port = free_port()
    with local_serve("dynvm-test-metrics", _metrics_export_port=metrics_port,
                     _system_config={"metrics_report_interval_ms": 500}) as http_port:
        serve_models({"branchy": path}, device="cpu", jit=True,
                     batching=BatchingOptions(enabled=False),
                     num_cpus=0.5)
        probe = serve.run(_probe_deployment().bind(PROBE_MODEL), name="dynvm-metrics-probe",
                          route_prefix=None)
        yield Cluster(http_port, metrics_port, probe)


def _store_stats(tmp_path) -> dict:
    """A real ArtifactCache's counts: two publishes, one hit, one miss (an oversized
    entry), one forged entry."""
    secret = b"metrics-test-secret-0123456789"
    cache = ArtifactCache(LocalDirStore(tmp_path), secret, EXPECT)
    keys = [cache_key(f"program-{n}", 0, "family", "cpu", "cpu", toolchain=TOOLCHAIN)
            for n in range(3)]
    fields = {"key": keys[0], "backend": "cpu", "target": "cpu", "toolchain": TOOLCHAIN,
              "kernel_name": "region_0", "source": "def region_0(x):\n    return x\n",
              "guard": "strong", "notes": [], "compile_seconds": 0.1, "metadata": {}}
    assert cache.publish(keys[0], fields)
    stranger = ArtifactCache(LocalDirStore(tmp_path), b"another-secret-0123456789", EXPECT)
    assert stranger.publish(keys[2], {**fields, "key": keys[2]})
    # keys[1]: written, then over the cap of a reader with a smaller one (oversized).
    assert cache.publish(keys[1], {**fields, "key": keys[1], "source": "#" * 4096})
    cache.store.max_entry_bytes = 2048
    assert set(cache.fetch(keys)) == {keys[0]}
    return store_counters(cache)


def _series(scraped: dict, name: str, **labels) -> list[tuple[frozenset, float]]:
    return [(lbls, value) for (n, lbls), value in scraped.items()
            if n == name and set(labels.items()) <= lbls]


def test_replica_metrics_on_a_serve_replica(cluster, tmp_path):
    program = compiled("branchy")
    x = torch.randn(4, 32)
    store = _store_stats(tmp_path)
    with dynvm.Runtime(program, jit=eager_config()) as runtime:
        runtime(x)
        runtime(x)
        first = {**runtime.stats().to_dict(), "store": store, "requests": 2, "errors": 0}
        assert first["compiles"] > 0 and first["specialized_region_calls"] > 0
        recorded = cluster.probe.update.remote(first).result()
        assert recorded["dynvm_calls"] == 2
        assert recorded["dynvm_compiles"] == first["compiles"]
        assert recorded["dynvm_compile_seconds"] == pytest.approx(first["compile_seconds"])
        assert recorded["dynvm_region_calls{kind=specialized}"] == \
            first["specialized_region_calls"]
        assert "dynvm_request_errors" not in recorded  # zero: nothing to add
        assert (recorded["dynvm_store_fetches{result=hit}"],
                recorded["dynvm_store_fetches{result=miss}"],
                recorded["dynvm_store_rejections{reason=forged}"],
                recorded["dynvm_store_publishes"],
                recorded["dynvm_store_dropped{reason=oversized}"]) == (1, 1, 1, 2, 1)
        assert "dynvm_store_dropped{reason=evicted}" not in recorded   # zero: nothing added
        ratio = first["specialized_region_calls"] / (first["specialized_region_calls"]
                                                     + first["interpreted_region_calls"])
        assert recorded["dynvm_specialized_ratio"] == pytest.approx(ratio)
        assert recorded["dynvm_compile_queue_length"] == 0

        for _ in range(3):
            runtime(x)
        second = {**runtime.stats().to_dict(), "store": store, "requests": 5, "errors": 0}
        recorded = cluster.probe.update.remote(second).result()
        assert recorded["dynvm_calls"] == 3 and recorded["dynvm_requests"] == 3
        assert "dynvm_compiles" not in recorded  # no new compile, no increase
        assert recorded["dynvm_region_calls{kind=specialized}"] == \
            second["specialized_region_calls"] - first["specialized_region_calls"]
        assert "dynvm_store_fetches{result=hit}" not in recorded

    restarted = dynvm.Runtime(program, jit=False)
    restarted(x)
    recorded = cluster.probe.update.remote({**restarted.stats().to_dict(), "requests": 1}).result()
    # A lower value is a restarted source: its whole value is added, never subtracted.
    assert recorded["dynvm_calls"] == 1 and recorded["dynvm_requests"] == 1
    assert "dynvm_compiles" not in recorded  # JIT off: no such key, nothing recorded
    cluster.probe.observe.remote(0.004).result()
    cluster.probe.observe.remote(0.3).result()

    expected_calls = 2 + 3 + 1
    deadline = time.monotonic() + 30
    while True:  # Ray's agent exports what the replica recorded every half second
        scraped = cluster.scrape()
        calls = _series(scraped, "ray_dynvm_calls_total", model=PROBE_MODEL)
        histogram = _series(scraped, "ray_dynvm_request_seconds_count", model=PROBE_MODEL)
        if calls and calls[0][1] == expected_calls and histogram and histogram[0][1] == 2:
            break
        assert time.monotonic() < deadline, f"not exported in 30 s: {calls} {histogram}"
        time.sleep(0.5)
    ((labels, _),) = calls
    labels = dict(labels)
    assert labels["deployment"] == "MetricsProbe" and labels["replica"]
    assert labels["application"] == "dynvm-metrics-probe"
    (compiles,) = _series(scraped, "ray_dynvm_compiles_total", model=PROBE_MODEL)
    assert compiles[1] == first["compiles"]
    (forged,) = _series(scraped, "ray_dynvm_store_rejections_total", reason="forged")
    assert forged[1] == 1
    (requests,) = _series(scraped, "ray_dynvm_requests_total", model=PROBE_MODEL)
    assert requests[1] == 6
    (gauge,) = _series(scraped, "ray_dynvm_specialized_ratio", model=PROBE_MODEL)
    assert gauge[1] == pytest.approx(second["specialized_region_calls"] / (
        second["specialized_region_calls"] + second["interpreted_region_calls"]))


def _top_rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] in ("branchy", "nope"):
            rows[cells[0]] = cells
    return rows


def test_top_once_shows_the_served_models(cluster, capsys):
    for batch in (1, 2, 2, 3, 2):
        status, _ = cluster.post_json("/v2/models/branchy/infer", {"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [batch, 32],
             "data": [0.1 * i for i in range(batch * 32)]}]})
        assert status == 200
    status, _ = cluster.post_json("/v2/models/branchy/infer", {"inputs": []})
    assert status == 400

    assert main(["top", cluster.url, "--once", "--model", "branchy", "--model", "nope"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dynvm top  {cluster.url}  ")
    rows = _top_rows(out)
    header = re.split(r"\s{2,}", next(line for line in out.splitlines()
                                      if line.startswith("MODEL")).strip())
    branchy = dict(zip(header, rows["branchy"], strict=True))
    assert re.fullmatch(r"\w+", branchy["REPLICA"])  # Serve's id of the one replica
    assert branchy["REQS"] == "6"  # 5 answered, 1 rejected: both are requests
    # 5 calls, plus the 2 the replica makes at start-up to learn its output shapes
    assert branchy["CALLS"] == "7"
    p50, p99 = float(branchy["P50 ms"]), float(branchy["P99 ms"])
    assert 0 < p50 <= p99  # the replica's recent request latencies
    assert re.fullmatch(r"\d+\.\d", branchy["SPEC%"])
    assert all(branchy[c].isdigit() for c in ("COMPILES", "FAMILIES", "GUARD FAIL",
                                               "DEOPTS", "QUEUE"))
    assert rows["nope"][1] == "-" and "HTTP 404: unknown model 'nope'" in rows["nope"][2]
    assert "sample: the stats carry no replica id" not in out
    assert "do not report latency percentiles" not in out


def test_top_finds_models_or_asks_for_them(cluster, capsys):
    code = main(["top", cluster.url, "--once"])
    out, err = capsys.readouterr()
    if code == 0:  # the server has a repository index
        assert "branchy" in _top_rows(out)
    else:
        assert code == 2 and out == ""
        assert "does not list its models (POST /v2/repository/index: HTTP 404" in err
        assert "name them with --model NAME" in err


def test_top_refuses_what_is_not_a_dynvm_server(cluster, capsys):
    # Ray's metrics endpoint is a real HTTP server, but not a dynvm one.
    code = main(["top", f"http://127.0.0.1:{cluster.metrics_port}", "--once",
                 "--model", "branchy"])
    assert code == 1
    assert "is not a dynvm server (GET /v2: HTTP 200 but not dynvm's server metadata)" in \
        capsys.readouterr().err
