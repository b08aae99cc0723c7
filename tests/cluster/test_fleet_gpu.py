"""GPU replicas in the fleet (Note [GPU replicas in the fleet] in dynvm.cluster.fleet._gpu):
a real redis-server, the real FleetCompiler building sm_90 Triton binaries, real pub/sub.
One replica is a CPU replica; the others are configured as CUDA replicas whose device is
faked only at the launch boundary (tests/triton/_fake_device.py: the stored cubins are
loaded as Triton's kernel objects, and the launch runs the same kernel interpreted on the
CPU). On a machine with a GPU, the gpu-marked test uses the real device."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

import dynvm
from dynvm.cluster import StoreConfig
from dynvm.cluster.fleet._compiler import FleetCompiler
from dynvm.cluster.fleet._link import FleetLink, FleetOptions
from dynvm.cluster.fleet.compile_service import LocalServiceClient
from dynvm.jit.config import JitConfig
from dynvm.jit.portable import PortableError
from dynvm.telemetry import Telemetry
from tests.cluster._cluster_helpers import saved_recommender, wait_until
from tests.cluster._redis_server import redis_config

if "triton" not in sys.modules and not torch.cuda.is_available():
    # The fake device interprets kernels; Triton chooses at its first import (Note
    # [Loading generated kernels]). Compiles run in child processes without it.
    os.environ["TRITON_INTERPRET"] = "1"

FAST = {"flush_interval_s": 0.02, "poll_interval_s": 0.2}
CONFIG = JitConfig(min_recurrence=2, max_recurrence=2, families=False, horizon_calls=10**7)
TARGETS = (("cuda", 90, 32),)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    demo, program, path = saved_recommender(tmp_path_factory.mktemp("fleet-gpu"))
    return demo, program, path.read_bytes()


def _link(program, dvm_bytes, store, compiler, device="cpu", boundary=None,
          telemetry=None) -> FleetLink:
    runtime = dynvm.Runtime(program, device, jit=CONFIG, telemetry=telemetry)
    options = FleetOptions(store, gpu_targets=TARGETS, **FAST)
    return FleetLink(runtime, dvm_bytes, options, LocalServiceClient(compiler),
                     gpu_boundary=boundary).start()


@pytest.fixture
def in_process_compiler_forbidden(monkeypatch):
    """Triton's compiler raises in this process (the service's ahead-of-time compiles run
    in child processes, untouched)."""
    import triton
    import triton.compiler.compiler
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction

    def forbidden(*args, **kwargs):
        raise AssertionError("Triton's compiler ran in the replica's process")

    monkeypatch.setattr(triton, "compile", forbidden)
    monkeypatch.setattr(triton.compiler.compiler, "compile", forbidden)
    monkeypatch.setattr(CUDABackend, "add_stages", forbidden)
    monkeypatch.setattr(JITFunction, "_do_compile", forbidden)


def test_a_cuda_replica_installs_the_services_triton_binaries_with_no_compile(
        model, redis_server, secret, in_process_compiler_forbidden):
    from dynvm.jit.backends.triton._loading import interpreter_ready
    from tests.triton._fake_device import InterpretedBoundary

    if not interpreter_ready():
        pytest.skip("the fake device needs Triton's interpreter (no GPU here)")
    demo, program, dvm_bytes = model
    store = StoreConfig(secret=secret, redis=redis_config(redis_server))
    compiler = FleetCompiler(store, CONFIG, gpu_targets=TARGETS)
    cpu = _link(program, dvm_bytes, store, compiler)
    sm90 = InterpretedBoundary(arch=90)
    telemetry, spans = Telemetry.in_memory()
    old_telemetry, old_spans = Telemetry.in_memory()
    gpu = _link(program, dvm_bytes, store, compiler, boundary=sm90, telemetry=telemetry)
    old = _link(program, dvm_bytes, store, compiler, boundary=InterpretedBoundary(arch=75),
                telemetry=old_telemetry)
    links = [cpu, gpu, old]
    try:
        assert gpu.shared and gpu.target == "cuda:90" and not gpu.compiles_locally()
        inputs = demo.sample_inputs(random.Random(11))
        for _ in range(3):                       # traffic on the CPU replica only
            cpu.runtime(*inputs)
            cpu.flush()
        assert compiler.wait_idle(180)
        assert compiler.stats()["gpu_published"] >= 1, compiler.stats()
        # Announced (or polled): the CUDA replica loads the cubins, the CPU one installs
        # its own record; the sm_75 replica has no binary and compiles locally instead.
        assert wait_until(lambda: gpu.stats()["gpu_cubin"] >= 1, 60) is not None
        assert wait_until(lambda: cpu.runtime.stats()["installs"] >= 1) is not None
        assert wait_until(lambda: old.stats()["gpu_local_compile"] >= 1) is not None
        stats = gpu.stats()
        assert stats["gpu_local_compile"] == stats["gpu_load_failures"] == 0
        assert stats["announcements"] >= 1 and stats["install_rejected"] == 0
        assert sorted(sm90.prepared)                      # modules loaded at install
        assert old.compiles_locally() and old.stats()["gpu_compiles_locally"]
        # Which way each went is on the install spans too.
        for recorded, how in ((spans, "cubin"), (old_spans, "local-compile")):
            installs = [s for s in recorded.get_finished_spans()
                        if s.name == "dynvm.gpu_install"]
            assert installs and installs[0].attributes["dynvm.gpu_load"] == how
        # The CUDA replica's first request on the hot shape runs specialized: the loaded
        # kernels launch, nothing was compiled here.
        launched = len(sm90.launched)
        expected = dynvm.Runtime(program, "cpu", jit=False)(*inputs)
        torch.testing.assert_close(gpu.runtime(*inputs), expected)
        runtime = gpu.runtime.stats()
        assert runtime["specialized_region_calls"] >= 1 and len(sm90.launched) > launched
        assert runtime["compiles"] == 0 and runtime["triton_compiles"] == 0
        loaded = [a for a in gpu.runtime.jit.artifacts.values() if a.backend == "triton"]
        assert loaded and all(a.metadata["gpu_load"] == "cubin" for a in loaded)
        # A CUDA replica started now installs it before its first request (warm start).
        late_device = InterpretedBoundary(arch=90)
        late = _link(program, dvm_bytes, store, compiler, boundary=late_device)
        links.append(late)
        assert late.stats()["warm_start_installs"] >= 1
        torch.testing.assert_close(late.runtime(*inputs), expected)
        assert late.runtime.stats()["specialized_region_calls"] >= 1
        assert late.runtime.stats()["compiles"] == 0 and late_device.launched
        # A restarted service resumes the GPU index with the CPU one (nothing rebuilt).
        restarted = FleetCompiler(store, CONFIG, gpu_targets=TARGETS)
        try:
            restarted.register(program.content_hash, dvm_bytes)
            assert restarted.stats()["gpu_indexed"] == compiler.stats()["gpu_indexed"] >= 1
            assert restarted.stats()["gpu_published"] == 0
        finally:
            restarted.close()
        # An entry whose binaries are not the ones its record describes is refused.
        key = sorted(gpu._installed)[0]
        fields = gpu.cache.fetch([key])[key]
        with pytest.raises(PortableError, match=r"does not match its record \(key differ"):
            gpu.gpu.install("f" * 64, fields)
        with pytest.raises(PortableError, match="Triton artifact: .*checksum|not msgpack"):
            data = bytearray(fields["triton_artifact"])
            data[len(data) // 2] ^= 0xFF
            gpu.gpu.install(key, {**fields, "triton_artifact": bytes(data)})
    finally:
        for link in links:
            link.close()
        compiler.close()


def test_family_kernels_reach_a_cuda_replica_too(model, tmp_path, secret,
                                                 in_process_compiler_forbidden):
    """With code families on, the service's family kernels (runtime dims) are loaded
    under the family's guard: every member the CPU replica's traffic covered runs
    specialized on the CUDA replica, none compiled there."""
    from dynvm.jit.backends.triton._loading import interpreter_ready
    from tests.triton._fake_device import InterpretedBoundary

    if not interpreter_ready():
        pytest.skip("the fake device needs Triton's interpreter (no GPU here)")
    demo, program, dvm_bytes = model
    # Probation off: on the fake device a kernel runs in Triton's interpreter, whose
    # patching of triton.language is process-wide, and probation's shadow samples run on
    # the compile worker beside the calls (Note [Probation]): a call interpreted at the
    # same time deopted with "InterpreterError: ... `_semantic` argument must be provided
    # outside of JIT functions". A real device's launches have no such state.
    config = JitConfig(min_recurrence=2, max_recurrence=2, horizon_calls=10**7,
                       probation=False)
    store = StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    compiler = FleetCompiler(store, config, gpu_targets=TARGETS)
    options = FleetOptions(store, gpu_targets=TARGETS, **FAST)
    cpu = FleetLink(dynvm.Runtime(program, "cpu", jit=config), dvm_bytes, options,
                    LocalServiceClient(compiler)).start()
    gpu = FleetLink(dynvm.Runtime(program, "cpu", jit=config), dvm_bytes, options,
                    LocalServiceClient(compiler),
                    gpu_boundary=InterpretedBoundary(arch=90)).start()
    try:
        draws = [demo.sample_inputs(random.Random(i)) for i in range(4)]
        for _ in range(6):
            for inputs in draws:
                cpu.runtime(*inputs)
            cpu.flush()
        assert compiler.wait_idle(180)
        # Every Triton entry the service indexed is installed (one family's arrival alone
        # left a draw of another family's bucket interpreted now and then).
        published = compiler.stats()["gpu_indexed"]
        assert published >= 1
        assert wait_until(lambda: gpu.stats()["gpu_cubin"] >= published, 60) is not None
        assert any(s.family is not None for rj in gpu.runtime.jit.regions.values()
                   for s in rj.installed())
        reference = dynvm.Runtime(program, "cpu", jit=False)
        for inputs in draws:
            torch.testing.assert_close(gpu.runtime(*inputs), reference(*inputs))
        stats = gpu.runtime.stats()
        assert stats["interpreted_region_calls"] == 0 and stats["compiles"] == 0, stats
        assert stats["specialized_region_calls"] == len(draws)
        # The store evicts the GPU index alone: the service lists its entries again, and
        # a CUDA replica that starts afterwards still warm-starts from them.
        from dynvm.cluster.fleet._records import index_key

        (tmp_path / "kernels" / index_key(program.content_hash, "cuda:90")).unlink()
        compiler.repair_store()
        late = FleetLink(dynvm.Runtime(program, "cpu", jit=config), dvm_bytes, options,
                         LocalServiceClient(compiler),
                         gpu_boundary=InterpretedBoundary(arch=90)).start()
        try:
            assert late.stats()["warm_start_installs"] == gpu.stats()["gpu_cubin"]
        finally:
            late.close()
    finally:
        gpu.close()
        cpu.close()
        compiler.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_replica_launches_the_stored_binaries(model, tmp_path, secret,
                                                          in_process_compiler_forbidden):
    demo, program, dvm_bytes = model
    major, minor = torch.cuda.get_device_capability()
    targets = (("cuda", major * 10 + minor, 32),)
    store = StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
    compiler = FleetCompiler(store, CONFIG, gpu_targets=targets)
    cpu = _link(program, dvm_bytes, store, compiler)
    runtime = dynvm.Runtime(program, "cuda", jit=CONFIG)
    gpu = FleetLink(runtime, dvm_bytes, FleetOptions(store, gpu_targets=targets, **FAST),
                    LocalServiceClient(compiler)).start()
    try:
        inputs = demo.sample_inputs(random.Random(11))
        for _ in range(3):
            cpu.runtime(*inputs)
            cpu.flush()
        assert compiler.wait_idle(180)
        assert wait_until(lambda: gpu.stats()["gpu_cubin"] >= 1, 60) is not None
        on_gpu = [x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs]
        expected = dynvm.Runtime(program, "cpu", jit=False)(*inputs)
        torch.testing.assert_close(gpu.runtime(*on_gpu).cpu(), expected, rtol=1e-4,
                                   atol=1e-4)
        assert gpu.runtime.stats()["specialized_region_calls"] >= 1
        assert gpu.runtime.stats()["compiles"] == 0
    finally:
        gpu.close()
        cpu.close()
        compiler.close()


def test_a_record_is_retargeted_to_the_replicas_device():
    """The service specializes on its CPU; a GPU replica guards on its own device, with
    every shape, dtype, stride and bound unchanged (portable.retarget)."""
    from dynvm.jit.guards import GuardStrength, strong_signer
    from dynvm.jit.portable import PortableSpecialization, retarget
    from dynvm.shape_cluster import family_for

    regs = [torch.empty(4, 8), torch.empty(8, 3).t(), 5]
    signature = strong_signer((0, 1, 2))(regs)
    contiguous = strong_signer((0, 1))([torch.empty(4, 8), torch.empty(8, 3)])
    family = family_for(contiguous, {(0, 0)}, 4)
    cuda = torch.device("cuda", 0)
    exact = retarget(PortableSpecialization(0, GuardStrength.STRONG, signature, None, None),
                     cuda)
    assert [e[4] for e in exact.signature[:2]] == [cuda, cuda]
    assert [e[:4] for e in exact.signature[:2]] == [e[:4] for e in signature[:2]]
    assert exact.signature[2] == signature[2]
    grouped = retarget(PortableSpecialization(0, GuardStrength.FAMILY, (), family, None), cuda)
    assert grouped.family.bounds == family.bounds
    assert [p[3] for p in grouped.family.structure if p[0] == "t"] == [cuda, cuda]
    assert [p[:3] + p[4:] for p in grouped.family.structure] == \
        [p[:3] + p[4:] for p in family.structure]
