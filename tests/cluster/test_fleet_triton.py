"""Triton artifacts for GPU targets, built by the compile service from a specialization's
IR on a machine without a GPU: sealed, stored, opened and decoded back to the binaries."""

from __future__ import annotations

import importlib

import pytest

import dynvm
from dynvm.cluster import LocalDirStore
from dynvm.cluster.fleet._triton import triton_fields
from dynvm.cluster.store._signed import ForgedArtifact, IncompatibleArtifact, open_sealed, seal
from dynvm.jit.artifact import toolchain_versions
from dynvm.jit.backends.triton import TritonArtifact
from dynvm.jit.portable import decode

h = importlib.import_module("tests.jit._jit_helpers")


@pytest.fixture(scope="module")
def compiled_spec():
    """A specialization compiled by the CPU backend, as the compile service has them."""
    program = h.compiled("recommender")
    runtime = dynvm.Runtime(program, jit=h.eager_config(backend="cpu"))
    runtime(*h.make_demo_inputs("recommender"))
    specs = [s for rj in runtime.jit.regions.values() for s in rj.installed()]
    assert specs and all(s.artifact.backend == "cpu" for s in specs)
    return program, specs[0]


@pytest.mark.slow
def test_triton_fields_seal_open_and_decode_to_sm90_binaries(compiled_spec, tmp_path, secret):
    program, spec = compiled_spec
    key, fields = triton_fields(spec, program, [("cuda", 90, 32)])
    assert key != spec.artifact.key          # another backend and target: another key
    assert fields["backend"] == "triton" and fields["target"] == "cuda:90"
    store = LocalDirStore(tmp_path / "kernels")
    store.put(key, seal(key, fields, secret))
    data = store.get([key])[key]
    expect = {"target": "cuda:90", "toolchain": toolchain_versions(), "backend": "triton"}
    opened = open_sealed(key, data, secret, expect)
    assert opened["triton_artifact"] == fields["triton_artifact"]
    artifact = TritonArtifact.from_bytes(opened["triton_artifact"])
    assert artifact.key == key and artifact.targets == ("cuda:90",)
    assert artifact.source == opened["source"]
    kernels = opened["metadata"]["kernels"]
    assert kernels and sorted(artifact.binaries["cuda:90"]) == sorted(kernels)
    for name in kernels:
        assert artifact.binary("cuda:90", name).binary   # a real cubin, non-empty
    assert [v["opcode"] for v in opened["metadata"]["vendor_ops"]] == [
        s.opcode for s in artifact.vendor_ops()]
    portable = decode(opened["metadata"]["portable"], program)
    assert portable.region == spec.ir.region_index and portable.signature == spec.signature
    # Built for cuda:90 only: a CPU replica, or another key, refuses it.
    with pytest.raises(IncompatibleArtifact, match="target"):
        open_sealed(key, data, secret, expect | {"target": "cpu"})
    with pytest.raises(ForgedArtifact):
        open_sealed(spec.artifact.key, seal(key, fields, secret)
                    .replace(key.encode(), spec.artifact.key.encode()), secret, expect)

