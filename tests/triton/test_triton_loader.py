"""Loading stored binaries without compiling (dynvm.jit.backends.triton.loader): sm_90
artifacts for every kernel kind, built by the ahead-of-time worker (another process),
become Triton's launchable kernel objects while every way into Triton's compiler raises.
Without a GPU the loaded kernels are launched through the fake device boundary
(tests/triton/_fake_device.py: the same argument list, interpreted); with one, the
gpu-marked test launches the cubins and compares with eager."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from dynvm.jit.backends.triton import TritonArtifact, build_binaries, generate_region
from dynvm.jit.backends.triton.artifact import build_artifact
from dynvm.jit.backends.triton.loader import CUBIN, choose_binary, load_kernels
from dynvm.jit.backends.triton.run_binary import BinaryRegion

th = importlib.import_module("tests.triton._triton_helpers")
kernel_cases = importlib.import_module("tests.triton.test_triton_kernels")

KINDS = ["elementwise-rows", "softmax-rows", "layer-norm-affine", "matmul-linear-epilogue"]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """name -> (region spec, constants, artifact bytes): one artifact per kernel kind,
    every kernel compiled for sm_90 in one child process, into an empty Triton cache."""
    built = {}
    for name in KINDS:
        fam, ops, outputs, constants, _ = kernel_cases.CASES[name]()
        spec = th.build_region(ops, fam, (0,), outputs, constants)
        built[name] = (spec, constants, fam, generate_region(spec, constants,
                                                             kernel_cases.OPTIONS))
    kernels = {k.name: k for *_, code in built.values() for k in code.kernels}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        binaries = build_binaries(kernels.values(), [("cuda", 90, 32)], jobs=2)
    out = {}
    for name, (spec, constants, fam, code) in built.items():
        mine = {"cuda:90": {k.name: binaries["cuda:90"][k.name] for k in code.kernels}}
        artifact = build_artifact(code, program_hash="0" * 64, family_key=fam.key,
                                  binaries=mine, options=kernel_cases.OPTIONS)
        out[name] = (spec, constants, fam, artifact.to_bytes())
    return out


@pytest.fixture
def no_compiler(monkeypatch):
    """Every way into Triton's compiler raises (and is counted if anything tries)."""
    return _forbid_compiler(monkeypatch)


def _forbid_compiler(monkeypatch) -> list:
    import triton
    import triton.compiler
    import triton.compiler.compiler
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction

    from dynvm.jit.backends.triton import aot

    calls = []

    def forbidden(what):
        def raise_(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"{what} was called while loading stored binaries")
        return raise_

    monkeypatch.setattr(triton, "compile", forbidden("triton.compile"))
    monkeypatch.setattr(triton.compiler, "compile", forbidden("triton.compiler.compile"))
    monkeypatch.setattr(triton.compiler.compiler, "compile", forbidden("compiler.compile"))
    monkeypatch.setattr(CUDABackend, "add_stages", forbidden("CUDABackend.add_stages"))
    monkeypatch.setattr(JITFunction, "_do_compile", forbidden("JITFunction._do_compile"))
    monkeypatch.setattr(aot, "build_binaries", forbidden("aot.build_binaries"))
    return calls


def _load(data: bytes, arch: int):
    artifact = TritonArtifact.from_bytes(data)
    choice = choose_binary(artifact, arch)
    return artifact, choice, load_kernels(artifact, choice)


@pytest.mark.interpreted
def test_every_kernel_kind_loads_from_stored_binaries_without_compiling(stored, no_compiler):
    from triton.compiler import CompiledKernel

    from tests.triton._fake_device import InterpretedBoundary

    kinds = set()
    rng = random.Random(3)
    for spec, constants, fam, data in stored.values():
        artifact, choice, loaded = _load(data, 90)
        assert choice.target == "cuda:90" and choice.how == CUBIN
        assert set(loaded) == {s.kernel for s in artifact.plan.kernels()}
        for kernel_name, kernel in loaded.items():
            binary = artifact.binary("cuda:90", kernel_name)
            compiled = kernel.compiled
            assert isinstance(compiled, CompiledKernel)
            assert compiled.kernel == binary.binary and compiled.hash == binary.triton_hash
            assert compiled.metadata.name == binary.entry
            assert compiled.metadata.target.arch == 90
            assert compiled.packed_metadata[0] == binary.num_warps
            assert compiled.metadata.shared == binary.shared
            assert compiled.module is None            # nothing touched a device yet
            kinds.add(kernel.kernel.kind)
        device = InterpretedBoundary(arch=90)
        runner = BinaryRegion(artifact.plan, loaded, constants, device)
        runner.prepare()
        assert sorted(device.prepared) == sorted(loaded)
        for dims in th.member_dims(fam, rng, 2):
            x = torch.randn(dims[0])
            got = th.run_region(runner, spec, {0: x})
            want = th.eager(spec, {0: x}, constants)
            for reg in want:
                torch.testing.assert_close(got[reg], want[reg], rtol=1e-4, atol=1e-4)
        assert runner.launches == len(device.launched) >= 2
    assert kinds == {"elementwise", "row", "matmul"}
    assert no_compiler == []


def test_launch_arguments_follow_the_kernel_parameters(stored):
    from dynvm.jit.backends.triton import LaunchError
    from dynvm.jit.backends.triton.launch import PreparedLaunch

    spec, constants, fam, data = stored["matmul-linear-epilogue"]
    _, _, loaded = _load(data, 90)
    kernel = next(iter(loaded.values()))
    k = kernel.kernel
    pointers = [n for n in k.arg_names if k.signature[n].startswith("*")]
    runtime = [n for n in k.arg_names if k.signature[n] == "i32"]
    prepared = PreparedLaunch((1,), tuple(range(7, 7 + len(runtime))), dict(k.constexprs),
                              ())
    tensors = [object() for _ in pointers]
    args = kernel.args(tensors[:1], tensors[1:], prepared)
    assert len(args) == len(k.arg_names)
    assert list(args[len(pointers):len(pointers) + len(runtime)]) == list(prepared.runtime_args)
    assert dict(zip(k.arg_names[-len(k.constexprs):], args[-len(k.constexprs):])) == \
        dict(k.constexprs)
    wrong = dict(k.constexprs)
    wrong[next(iter(wrong))] += 16
    with pytest.raises(LaunchError, match="binary was built for"):
        kernel.args(tensors[:1], tensors[1:], PreparedLaunch((1,), prepared.runtime_args,
                                                             wrong, ()))


@pytest.mark.gpu
def test_stored_binaries_launch_on_the_gpu_and_match_eager(stored, no_compiler):
    from dynvm.jit.backends.triton.run_binary import CudaBoundary

    torch.backends.cuda.matmul.allow_tf32 = False
    device = CudaBoundary("cuda")
    rng = random.Random(5)
    for name, (spec, constants, fam, data) in stored.items():
        artifact, choice, loaded = _load(data, device.arch)
        on_device = [c.to(device.device) for c in constants]
        runner = BinaryRegion(artifact.plan, loaded, on_device, device)
        runner.prepare()
        for dims in th.member_dims(fam, rng, 3):
            x = torch.randn(dims[0], device=device.device)
            got = th.run_region(runner, spec, {0: x})
            want = th.eager(spec, {0: x}, on_device)
            for reg in want:
                torch.testing.assert_close(got[reg], want[reg], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, n=name: f"{n}: {m}")
        assert runner.launches >= 3, (name, choice)
    assert no_compiler == []


@pytest.mark.gpu
def test_an_older_targets_ptx_is_compiled_by_the_driver_on_a_newer_gpu(stored, monkeypatch):
    """Note [Stored binaries on other GPUs]: sm_80 binaries only, on a newer GPU, load
    through the driver's PTX compiler and match eager."""
    from dynvm.jit.backends.triton.run_binary import CudaBoundary

    device = CudaBoundary("cuda")
    if device.arch <= 80:
        pytest.skip(f"needs a GPU newer than sm_80, this one is sm_{device.arch}")
    spec, constants, fam, data = stored["matmul-linear-epilogue"]
    artifact = TritonArtifact.from_bytes(data)
    sm80 = build_binaries(artifact.kernels, [("cuda", 80, 32)])    # a child process
    calls = _forbid_compiler(monkeypatch)
    older = build_artifact(generate_region(spec, constants, kernel_cases.OPTIONS),
                           program_hash="0" * 64, family_key=fam.key, binaries=sm80,
                           options=kernel_cases.OPTIONS)
    choice = choose_binary(older, device.arch)
    assert (choice.target, choice.how) == ("cuda:80", "ptx")
    on_device = [c.to(device.device) for c in constants]
    runner = BinaryRegion(older.plan, load_kernels(older, choice), on_device, device)
    runner.prepare()
    x = torch.randn(3, 7, 32, device=device.device)
    got = th.run_region(runner, spec, {0: x})
    want = th.eager(spec, {0: x}, on_device)
    for reg in want:
        torch.testing.assert_close(got[reg], want[reg], rtol=1e-4, atol=1e-4)
    assert calls == []


def test_one_loaded_object_per_binary_across_artifacts(stored):
    spec, constants, fam, data = stored["softmax-rows"]
    artifact = TritonArtifact.from_bytes(data)
    choice = choose_binary(artifact, 90)
    cache = {}
    first = load_kernels(artifact, choice, cache)
    again = load_kernels(TritonArtifact.from_bytes(data), choice, cache)
    assert first and all(again[name] is first[name] for name in first)
    assert len(cache) == len(first)
    fresh = load_kernels(artifact, choice)
    assert all(fresh[name] is not first[name] for name in first)
