"""`dynvm precompile`: shapes in, families in the store and the index out; a replica that
may not compile starts warm from them and serves those shapes specialized."""

from __future__ import annotations

import json

import pytest
import torch

import dynvm
from dynvm.cli import main
from dynvm.cluster import StoreConfig
from dynvm.cluster.fleet._compiler import FleetCompiler
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet.compile_service import LocalServiceClient
from dynvm.cluster.fleet.precompile import (
    PrecompileError,
    ShapeSpecError,
    check_shapes,
    parse_shapes,
    precompile,
    read_trace,
    skeleton_first,
    sweep,
)
from dynvm.jit.config import JitConfig
from dynvm.shape_cluster.buckets import bucket_of
from tests.cluster._cluster_helpers import saved_recommender


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return saved_recommender(tmp_path_factory.mktemp("precompile"))


# -- shapes ---------------------------------------------------------------------------


def test_sweep_gives_every_bucket_at_least_two_members_where_it_has_room():
    points = sweep(1, 64)
    assert points == [1, 2, 3, 4, 5, 9, 16, 17, 33, 64]
    buckets = {}
    for n in points:
        buckets.setdefault(bucket_of(n), []).append(n)
    assert set(buckets) == {(1, 1), (2, 4), (5, 16), (17, 64)}
    assert all(len(v) >= 2 for b, v in buckets.items() if b[0] != b[1])
    assert sweep(20, 30) == [20, 24, 30]   # clipped to the range, inside one bucket


def test_parse_shapes_lists_ranges_and_products():
    assert parse_shapes("batch=4;seq=32") == [{"batch": 4, "seq": 32}]
    assert parse_shapes("batch=1,4 ; seq=8,2") == [
        {"batch": 1, "seq": 2}, {"batch": 1, "seq": 8},
        {"batch": 4, "seq": 2}, {"batch": 4, "seq": 8}]
    assert [s["batch"] for s in parse_shapes("batch=1..4,9")] == [1, 2, 3, 4, 9]
    for bad, words in [("batch", "expected NAME=VALUES"), ("batch=4..2", "empty range"),
                       ("batch=x", "neither a size"), ("b=1;b=2", "twice")]:
        with pytest.raises(ShapeSpecError, match=words):
            parse_shapes(bad)


def test_shapes_are_checked_against_the_program(model):
    _, program, _ = model
    assert check_shapes([{"batch": 3}, {"batch": 3}], program, "x") == [{"batch": 3}]
    with pytest.raises(ShapeSpecError, match="no dynamic dim 'seq'"):
        check_shapes([{"batch": 3, "seq": 2}], program, "x")
    with pytest.raises(ShapeSpecError, match="batch=65 is outside its declared range 1..64"):
        check_shapes([{"batch": 65}], program, "x")
    with pytest.raises(ShapeSpecError, match="does not give 'batch'"):
        check_shapes([{}], program, "x")


def test_trace_file_format(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"batch": 4, "seq": 32}\n\n{"batch": 7, "seq": 2}\n')
    assert read_trace(str(trace)) == [{"batch": 4, "seq": 32}, {"batch": 7, "seq": 2}]
    trace.write_text('{"batch": 4}\n{"batch": "4"}\n')
    with pytest.raises(ShapeSpecError, match="trace.jsonl:2: expected an object"):
        read_trace(str(trace))
    trace.write_text('{"batch": 4\n')
    with pytest.raises(ShapeSpecError, match="trace.jsonl:1: not JSON"):
        read_trace(str(trace))


def test_library_errors_are_dynvm_errors(model, tmp_path, secret, monkeypatch):
    _, program, path = model
    assert issubclass(ShapeSpecError, dynvm.DynvmError) and issubclass(ShapeSpecError,
                                                                       ValueError)
    with pytest.raises(PrecompileError, match="cannot read .*missing.jsonl"):
        read_trace(str(tmp_path / "missing.jsonl"))
    monkeypatch.setenv("DYNVM_JIT", "0")
    store = StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    with pytest.raises(PrecompileError, match="disabled by DYNVM_JIT=0"):
        precompile(program, path.read_bytes(), [{"batch": 2}], store)


# The command line's tests call its `main` in this process (what the console script and
# `python -m dynvm` run; a fresh interpreter costs ~2.5 s of imports, and `python -m
# dynvm` itself is started by the `dynvm serve` tests), with its output read at the file
# descriptors.


def test_command_line_maps_a_bad_shape_spec_to_a_usage_error(model, capfd):
    _, _, path = model
    assert main(["precompile", str(path), "--shapes", "batch=x"]) == 2
    assert "dynvm: error: bad shape spec part 'batch=x'" in capfd.readouterr().err


def test_skeleton_first_makes_every_dim_vary_early():
    shapes = [{"a": 1, "b": 1}, {"a": 1, "b": 2}, {"a": 2, "b": 2}, {"a": 1, "b": 3},
              {"a": 3, "b": 1}]
    ordered = skeleton_first(shapes)
    assert ordered[:3] == [{"a": 1, "b": 1}, {"a": 1, "b": 2}, {"a": 2, "b": 2}]
    assert sorted(map(str, ordered)) == sorted(map(str, shapes))


# -- precompile, then a replica that may not compile -------------------------------------


def _inputs(demo, batch: int, seed: int):
    import random

    rng = random.Random(seed)
    inputs = demo.sample_inputs(rng)
    return tuple(t[:batch].contiguous() if t.shape[0] >= batch
                 else t.repeat((batch + t.shape[0] - 1) // t.shape[0],
                               *[1] * (t.dim() - 1))[:batch].contiguous()
                 for t in inputs)


def _warm_replica(program, path, store: StoreConfig):
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(online_compile=False))
    compiler = FleetCompiler(store)  # a real service; it has nothing to do here
    link = FleetLink(runtime, path.read_bytes(), FleetOptions(store),
                     LocalServiceClient(compiler)).start()
    return runtime, link, compiler


def test_precompiled_families_serve_a_replica_that_never_compiles(model, tmp_path, secret):
    demo, program, path = model
    store = StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    shapes = check_shapes(parse_shapes("batch=1..64"), program, "test")
    outcome = precompile(program, path.read_bytes(), shapes, store)
    kinds = [row["kind"] for row in outcome.compiled]
    # One kernel per bucket: [1,1] exact, [2,4], [5,16], [17,64] families.
    assert kinds.count("family") == 3 and kinds.count("exact") == 1, outcome.compiled
    assert outcome.misses == 0 and outcome.region_calls == len(shapes)

    runtime, link, compiler = _warm_replica(program, path, store)
    try:
        assert link.stats()["warm_start_installs"] == 4
        reference = dynvm.Runtime(program, "cpu", jit=False)
        # Shapes precompile never saw, inside the buckets it compiled.
        for i, batch in enumerate([1, 3, 7, 12, 20, 50, 64]):
            inputs = _inputs(demo, batch, i)
            torch.testing.assert_close(runtime(*inputs), reference(*inputs))
        stats = runtime.stats()
        assert stats["compiles"] == 0
        assert stats["interpreted_region_calls"] == 0
        assert stats["specialized_region_calls"] == 7
    finally:
        link.close()
        runtime.close()
        compiler.close()

    # Again: everything is already indexed, nothing is compiled twice.
    again = precompile(program, path.read_bytes(), shapes, store)
    assert again.compiled == [] and again.already_indexed == 4 and again.rounds == 1


def test_command_line_with_a_trace_file(model, tmp_path, secret, capfd, monkeypatch):
    _, program, path = model
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"batch": b}) + "\n" for b in (2, 3, 2, 40, 60)))
    store_dir = tmp_path / "kernels"
    monkeypatch.setenv("DYNVM_STORE_SECRET", secret.decode())
    monkeypatch.delenv("DYNVM_REDIS_URL", raising=False)
    code = main(["precompile", str(path), "--trace-file", str(trace),
                 "--store-dir", str(store_dir)])
    done = capfd.readouterr()
    assert code == 0, done.err
    assert "4 shapes" in done.out
    assert "compiled 2 (2 families, 0 exact)" in done.out, done.out
    assert secret.decode() not in done.out + done.err
    # What the command wrote is what a replica installs.
    runtime, link, compiler = _warm_replica(program, path,
                                            StoreConfig(secret=secret,
                                                        local_dir=str(store_dir)))
    try:
        assert link.stats()["warm_start_installs"] == 2
    finally:
        link.close()
        runtime.close()
        compiler.close()
