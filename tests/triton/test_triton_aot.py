"""Ahead-of-time binaries and the Triton artifact: sm_90 (and sm_80) binaries built on
this CPU-only machine, the artifact's msgpack round trip and validation, and
deterministic code generation (same inputs, same key, byte-identical source)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json

import msgpack
import pytest
import torch

from dynvm.jit.backends.triton import (
    AotCompileError,
    ArtifactFormatError,
    ArtifactTargetError,
    GeneratedKernel,
    TritonArtifact,
    TritonOptions,
    artifact_key,
    build_binaries,
    compile_region,
)
from dynvm.jit.backends.triton.artifact import FORMAT, VERSION
from dynvm.jit.backends.triton.run_interpreted import InterpretedRegion
from dynvm.jit.probes import family_live_ins
from dynvm.jit.specialize import specialize

th = importlib.import_module("tests.triton._triton_helpers")

TARGETS = [("cuda", 90, 32), "cuda:80"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The demo transformer family's artifact, compiled for sm_90 and sm_80 into an empty
    Triton cache (so every binary is really compiled here)."""
    program, spec, fam, module = th.transformer_family_region()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        artifact = compile_region(spec, program.constants, program_hash=program.content_hash,
                                  family_key=fam.key, targets=TARGETS, jobs=2)
    return program, spec, fam, module, artifact


def test_sm90_binaries_are_built_without_a_gpu(built):
    # Built in a child process by triton.compile(target=GPUTarget(...)): no device is
    # involved, so this holds on a machine with or without one.
    *_, artifact = built
    assert artifact.targets == ("cuda:80", "cuda:90")
    kinds = {k.name: k.kind for k in artifact.kernels}
    for target, arch in (("cuda:90", 90), ("cuda:80", 80)):
        binaries = artifact.binaries[target]
        assert set(binaries) == set(kinds)
        for name, binary in binaries.items():
            assert binary.binary[:4] == b"\x7fELF" and len(binary.binary) > 1000
            assert binary.entry == name and binary.target == target
            assert f".target sm_{arch}" in binary.ptx
            metadata = json.loads(binary.metadata_json)
            assert metadata["target"]["arch"] == arch and metadata["name"] == name
            assert metadata["num_warps"] == binary.num_warps == 4
            assert metadata["shared"] == binary.shared
            if kinds[name] == "matmul":
                assert binary.num_stages == 3 and binary.shared > 0   # pipelined K loop


def test_artifact_round_trips_through_msgpack(built):
    *_, artifact = built
    data = artifact.to_bytes()
    assert data == artifact.to_bytes()
    envelope = msgpack.unpackb(data, raw=False)                  # plain msgpack, no pickle
    assert envelope["format"] == FORMAT and envelope["version"] == VERSION
    loaded = TritonArtifact.from_bytes(data)
    for field in dataclasses.fields(TritonArtifact):
        assert getattr(loaded, field.name) == getattr(artifact, field.name), field.name
    assert loaded.to_bytes() == data
    # The plan says which operations call the vendor library instead of a kernel.
    vendor = {call.opcode: call.reason for call in loaded.vendor_ops()}
    assert vendor["SDPA"] == "SDPA has no generated kernel"
    assert vendor["LINEAR"].startswith("vendor library")
    assert {g["kind"] for g in loaded.groups} == {"torch", "matmul", "row"}
    assert all(f"def {k.name}(" in loaded.source for k in loaded.kernels)


@pytest.mark.interpreted
def test_a_loaded_artifact_runs_without_generating_anything(built):
    program, spec, fam, module, artifact = built
    loaded = TritonArtifact.from_bytes(artifact.to_bytes())
    runner = InterpretedRegion(loaded.plan, loaded.kernels, program.constants)
    x = torch.randn(3, 11, 64)
    got = th.run_region(runner, spec, {0: x})[spec.outputs[0][0]]
    with torch.inference_mode():
        torch.testing.assert_close(got, module(x), rtol=1e-4, atol=1e-4)


def test_same_inputs_same_key_and_source():
    program, spec, fam, _ = th.transformer_family_region()
    # A second specialization from scratch, as another process would build it.
    region = program.regions[0]
    probes = [family_live_ins(spec.live_in, fam, dims) for dims in fam.probe_dims()]
    again = specialize(program, region, probes[0], tuple(probes[1:]))
    first = compile_region(spec, program.constants, program_hash=program.content_hash,
                           family_key=fam.key, targets=())
    second = compile_region(again, program.constants, program_hash=program.content_hash,
                            family_key=fam.key, targets=())
    assert first.key == second.key
    assert first.source.encode() == second.source.encode()
    assert first.to_bytes() == second.to_bytes()
    key = lambda **kw: artifact_key(**{  # noqa: E731
        "program_hash": program.content_hash, "region_index": 0, "family_key": fam.key,
        "targets": ["cuda:90"], "options": TritonOptions(), "toolchain": {"triton": "3"},
        **kw})
    assert key() == key()
    assert len({key(), key(targets=["cuda:80"]), key(family_key="other"),
                key(options=TritonOptions(matmul_precision="tf32")),
                key(toolchain={"triton": "4"})}) == 5


def _repack(data: bytes, edit) -> bytes:
    envelope = msgpack.unpackb(data, raw=False)
    body = msgpack.unpackb(envelope["body"], raw=False, strict_map_key=False)
    edit(body)
    packed = msgpack.packb(body, use_bin_type=True)
    envelope.update(body=packed, sha256=hashlib.sha256(packed).hexdigest())
    return msgpack.packb(envelope, use_bin_type=True)


def _envelope(data: bytes, **changes) -> bytes:
    envelope = msgpack.unpackb(data, raw=False)
    envelope.update(changes)
    return msgpack.packb(envelope, use_bin_type=True)


def _flip_body_byte(data: bytes) -> bytes:
    envelope = msgpack.unpackb(data, raw=False)
    body = bytearray(envelope["body"])
    body[len(body) // 2] ^= 0xFF
    return _envelope(data, body=bytes(body))


def _first_kernel_step(body: dict) -> dict:
    return next(s for s in body["plan"]["steps"] if s["step"] == "kernel")


BAD = {
    "not msgpack": (lambda d: b"\xc1garbage", "not msgpack"),
    "other format": (lambda d: _envelope(d, format="something-else"), "envelope.format"),
    "newer version": (lambda d: _envelope(d, version=VERSION + 1),
                      f"reads version {VERSION}, the artifact is version {VERSION + 1}"),
    "corrupt body": (_flip_body_byte, "checksum mismatch"),
    "missing plan": (lambda d: _repack(d, lambda b: b.pop("plan")),
                     "body: missing field 'plan'"),
    "mistyped field": (lambda d: _repack(d, lambda b: b.update(region_index="0")),
                       "body.region_index: expected int, got str"),
    "kernel without source": (lambda d: _repack(d, lambda b: b.update(kernels=[])),
                              "launches kernels with no source"),
    "bad plan step": (lambda d: _repack(d, lambda b: b["plan"]["steps"][0].pop("opcode")),
                      "torch step: missing field 'opcode'"),
    "plan disagrees with its kernel": (
        lambda d: _repack(d, lambda b: _first_kernel_step(b)["stores"].append(999)),
        "do not match the plan's"),
    "bad dim rule": (
        lambda d: _repack(d, lambda b: _first_kernel_step(b)["dims"][0].__setitem__(
            1, ["dim", 99, 0])), "has a bad rule"),
    "unknown binary": (lambda d: _repack(d, lambda b: b["binaries"]["cuda:90"].update(
        kernel_x=b["binaries"]["cuda:90"][next(iter(b["binaries"]["cuda:90"]))])),
        "binaries for unknown kernels"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_from_bytes_rejects_bad_input_with_a_specific_error(built, case):
    *_, artifact = built
    corrupt, message = BAD[case]
    with pytest.raises(ArtifactFormatError, match=message.replace("(", r"\(")):
        TritonArtifact.from_bytes(corrupt(artifact.to_bytes()))


def test_binaries_are_looked_up_per_target_and_toolchain(built):
    *_, artifact = built
    name = artifact.kernels[0].name
    assert artifact.binary("cuda:90", name).target == "cuda:90"
    with pytest.raises(ArtifactTargetError, match="no binaries for target 'cuda:75'"):
        artifact.binary("cuda:75", name)
    artifact.check_toolchain()
    with pytest.raises(ArtifactTargetError, match="built with triton"):
        artifact.check_toolchain({**artifact.toolchain, "triton": "0.0.1"})


def test_compile_errors_name_the_kernel():
    broken = GeneratedKernel("kernel_broken_0", "elementwise",
                             "@triton.jit\ndef kernel_broken_0(x_ptr):\n    tl.nope(x_ptr)\n",
                             ("x_ptr",), {"x_ptr": "*fp32"}, {}, 4, 1)
    with pytest.raises(AotCompileError, match="nope"):
        build_binaries([broken])


def test_each_gpu_loads_the_binary_that_fits_it(built):
    """Note [Stored binaries on other GPUs]: its own cubin, else a portable PTX of an
    older target through the driver, else nothing (compile locally)."""
    from dynvm.jit.backends.triton.loader import choose_binary, load_kernels, portable_ptx

    *_, artifact = built
    sm80 = artifact.binaries["cuda:80"].values()
    sm90 = artifact.binaries["cuda:90"].values()
    assert all(portable_ptx(b.ptx) for b in sm80)
    assert not any(portable_ptx(b.ptx) for b in sm90)          # sm_90a: Hopper only
    choices = {arch: choose_binary(artifact, arch) for arch in (90, 80, 100, 89, 75)}
    assert [(c.target, c.how) for c in choices.values()] == [
        ("cuda:90", "cubin"), ("cuda:80", "cubin"), ("cuda:80", "ptx"),
        ("cuda:80", "ptx"), (None, "local-compile")]
    loaded = load_kernels(artifact, choices[100])
    for name, kernel in loaded.items():
        ptx = artifact.binary("cuda:80", name).ptx
        assert kernel.how == "ptx" and kernel.compiled.kernel == ptx.encode() + b"\0"
    with pytest.raises(ArtifactTargetError, match="no binary an sm_75 GPU can load"):
        load_kernels(artifact, choices[75])
