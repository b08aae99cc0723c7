"""The systems compared by `python -m bench`: one small class each, with a uniform
`__call__(*inputs)` and compile accounting.

Note [Counting compiles]
~~~~~~~~~~~~~~~~~~~~~~~~
Every system reports `setup_seconds` (work done before the first call: dynvm's
torch.export lowering) and a list of `compile_events` (call index, seconds):
- TorchScript: a call whose shape has not been traced yet traces it (torch.jit.trace);
  the event's seconds are the whole of that call (trace + first run).
- torch.compile: a call during which Dynamo's `counters["stats"]["unique_graphs"]` grew
  compiled (first compile or recompile); its seconds are the whole of that call, so
  Dynamo tracing, Inductor codegen and the C++ build all count. Before each
  torch.compile system Dynamo is reset, Inductor's in-memory code caches are cleared,
  and it gets a fresh TORCHINDUCTOR_CACHE_DIR with the FX-graph and autotune caches
  off, so no system reuses another's work.
- dynvm JIT: compiles run on a background thread and never block a call; the count and
  seconds are the JIT's own (`Runtime.stats()["compiles"/"compile_seconds"]`).
- eager PyTorch: torch.while_loop (the loop workload) compiles its body through Dynamo
  even in eager mode (backend="eager"); a call during which Dynamo made a graph counts
  as a compile, as for torch.compile. Otherwise eager and the dynvm interpreter never
  compile.
Total compile seconds = setup_seconds + the compile seconds above.

Note [Shared first use]
~~~~~~~~~~~~~~~~~~~~~~~
torch.export (dynvm's frontend) and torch.compile are both built on Dynamo, and the
first use of either in a process imports it and what it needs (torch._dynamo,
torch.export._trace, sympy: ~1,000 modules, 2.7 s by -X importtime here, 5.4 s of a
cold 12.5 s dynvm.compile under load). Whichever system came first paid it for all:
the suite's first dynvm system, built before any torch.compile pass, so a run of
jitter with dynvm's JIT alone carried it in the JIT's compile seconds (setup 13.8 s
against 0.6 s warm) while torch.compile's passes, later, found it loaded. A server
pays it once at start, not per model. So the suite imports them before any system is
built (`warm_shared_imports`) and reports that time on its own.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import torch

import dynvm
from bench.workloads import shape_key
from dynvm.models import DemoModel

SYSTEMS = ["eager", "torchscript", "compile-static", "compile-dynamic", "compile-auto",
           "compile-max-autotune", "dynvm-interp", "dynvm-interp-b", "dynvm-jit",
           "onnxruntime", "onnxruntime-int8", "openvino", "openvino-bf16"]
LABELS = {
    "eager": "eager PyTorch",
    "torchscript": "TorchScript (trace per shape)",
    "compile-static": "torch.compile(dynamic=False)",
    "compile-dynamic": "torch.compile(dynamic=True)",
    "compile-auto": "torch.compile (default)",
    "compile-max-autotune": "torch.compile(mode=\"max-autotune\")",
    "dynvm-interp": "dynvm interpreter",
    "dynvm-interp-b": "dynvm interpreter B (A/A)",
    "dynvm-jit": "dynvm JIT",
    "onnxruntime": "ONNX Runtime (fp32)",
    "onnxruntime-int8": "ONNX Runtime (int8 dynamic quantization)",
    "openvino": "OpenVINO (f32)",
    "openvino-bf16": "OpenVINO (bf16)",
}


_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def warm_shared_imports() -> float:
    """Import what torch.export and torch.compile share on first use (Note [Shared
    first use]); returns the seconds it took."""
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch.export._trace  # noqa: F401
    return time.perf_counter() - start


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class System:
    name = "system"
    interleaved = True
    """False: Dynamo's code cache is process-wide, so the system runs alone, in its
    own pass over the same input sequence, after a reset."""
    dynamo_compiles_count = False
    """True: a call during which Dynamo made a graph is a compile event (torch.compile,
    and eager PyTorch, whose torch.while_loop compiles through Dynamo)."""

    def __init__(self, demo: DemoModel) -> None:
        self.demo = demo
        self.setup_seconds = 0.0
        self.compile_events: list[tuple[int, float]] = []
        self.warnings: list[str] = []
        self.calls = 0
        self.dynamo_graphs = 0
        self.last_cpu_seconds = 0.0
        """The calling thread's CPU time in the last call (time.thread_time): what other
        processes' load does not add to (bench.report, 'JIT against the interpreter')."""

    def _run(self, inputs):
        raise NotImplementedError

    def __call__(self, *inputs):
        # Dynamo graphs are counted within this system's own calls: systems share a pass
        # (Note [Side by side] in bench.runner), and eager torch.while_loop compiles its
        # body through Dynamo (backend="eager"), which moves the same global counter.
        before = _dynamo_graphs()
        start, start_cpu = time.perf_counter(), time.thread_time()
        out = self._run(inputs)
        elapsed = time.perf_counter() - start
        self.last_cpu_seconds = time.thread_time() - start_cpu
        if (grew := _dynamo_graphs() - before) > 0:
            self.dynamo_graphs += grew
            if self.dynamo_compiles_count:
                self.compile_events.append((self.calls, elapsed))
        self.calls += 1
        return out, elapsed

    def compiles(self) -> tuple[int, float]:
        return len(self.compile_events), sum(s for _, s in self.compile_events)

    def counted_callable(self):
        """What the allocation count runs (a plain callable on the inputs)."""
        return lambda *inputs: self._run(inputs)

    def extra(self) -> dict:
        return {"dynamo_graphs": self.dynamo_graphs} if self.dynamo_graphs else {}

    def close(self) -> None:
        pass


class Eager(System):
    name = "eager"
    dynamo_compiles_count = True

    def _run(self, inputs):
        with torch.inference_mode():
            return self.demo.module(*inputs)


class TorchScript(System):
    name = "torchscript"

    def __init__(self, demo: DemoModel) -> None:
        super().__init__(demo)
        self.traced: dict = {}

    def _run(self, inputs):
        key = shape_key(inputs)
        fn = self.traced.get(key)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if fn is None:
                start = time.perf_counter()
                with torch.no_grad():
                    fn = torch.jit.trace(self.demo.module, inputs, check_trace=False)
                    out = fn(*inputs)
                self.traced[key] = fn
                self.compile_events.append((self.calls, time.perf_counter() - start))
            else:
                with torch.no_grad():
                    out = fn(*inputs)
        for w in caught:
            text = f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}"
            if text not in self.warnings:
                self.warnings.append(text)
        return out


class TorchCompile(System):
    interleaved = False
    dynamo_compiles_count = True

    def __init__(self, demo: DemoModel, name: str, dynamic: bool | None,
                 mode: str | None = None) -> None:
        super().__init__(demo)
        self.name = name
        torch._dynamo.reset()
        import torch._inductor.config as inductor_config
        from torch._inductor import codecache  # noqa: F401 - registers the in-memory caches
        from torch._inductor.utils import clear_caches

        self._clear_caches = clear_caches
        self._cache_dir = tempfile.TemporaryDirectory(prefix=f"bench-{name}-")
        self._saved_env = {k: os.environ.get(k) for k in _CACHE_ENV}
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self._cache_dir.name
        os.environ["TRITON_CACHE_DIR"] = os.path.join(self._cache_dir.name, "triton")
        # Inductor also keeps loaded kernels in memory keyed by their source hash
        # (PyCodeCache, CppCodeCache, ...): dynamo.reset() leaves them, and a later
        # system compiling the same graph would load the earlier one's kernels for free.
        clear_caches()
        self._config = inductor_config.patch(fx_graph_cache=False,
                                             autotune_local_cache=False)
        self._config.__enter__()
        self.fn = torch.compile(demo.module, dynamic=dynamic, mode=mode)
        self.recompile_limit = torch._dynamo.config.recompile_limit

    def _run(self, inputs):
        with torch.inference_mode():
            return self.fn(*inputs)

    def extra(self) -> dict:
        # Past recompile_limit graphs for one frame, Dynamo stops compiling that frame
        # and runs it eagerly: the latency columns then show eager speed.
        return {"dynamo_graphs": self.dynamo_graphs,
                "recompile_limit": self.recompile_limit}

    def close(self) -> None:
        torch._dynamo.reset()
        self._clear_caches()
        self._config.__exit__(None, None, None)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._cache_dir.cleanup()


class Dynvm(System):
    def __init__(self, demo: DemoModel, name: str, jit: bool) -> None:
        super().__init__(demo)
        self.name = name
        start = time.perf_counter()
        program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes,
                                name=demo.name)
        self.setup_seconds = time.perf_counter() - start
        self.runtime = dynvm.Runtime(program, jit=jit)

    def _run(self, inputs):
        return self.runtime(*inputs)

    def compiles(self) -> tuple[int, float]:
        stats = self.runtime.stats()
        if not stats["jit"]:
            return 0, 0.0
        return stats["compiles"], stats["compile_seconds"]

    def counted_callable(self):
        return None  # measured with Runtime.measure_allocations instead

    def extra(self) -> dict:
        stats = self.runtime.stats()
        keep = ("compiles", "family_compiles", "compile_seconds", "compile_failures",
                "specialized_region_calls", "interpreted_region_calls", "guard_failures",
                "deopts", "evictions", "dropped_tasks")
        return {k: stats[k] for k in keep if k in stats}

    def close(self) -> None:
        self.runtime.close()


class OnnxPeer(System):
    """ONNX Runtime or OpenVINO on the model exported to ONNX (Note [ONNX peers] in
    bench.peers): the export and the runtime's build are its setup seconds; it never
    compiles during calls. Not installed: setup fails with PeerUnavailable, which the
    runner reports as the system's row."""

    def __init__(self, demo: DemoModel, name: str) -> None:
        from bench.peers import Peer

        super().__init__(demo)
        self.name = name
        self.peer = Peer(name, demo.module, demo.example_inputs, demo.dynamic_shapes)
        self.setup_seconds = self.peer.setup_seconds

    def _run(self, inputs):
        out = self.peer(*inputs)
        return out[0] if len(out) == 1 else out

    def extra(self) -> dict:
        return {"exporter": self.peer.exporter, "version": self.peer.version}

    def close(self) -> None:
        self.peer.close()


def make(name: str, demo: DemoModel) -> System:
    if name == "eager":
        return Eager(demo)
    if name == "torchscript":
        return TorchScript(demo)
    if name == "compile-static":
        return TorchCompile(demo, name, dynamic=False)
    if name == "compile-dynamic":
        return TorchCompile(demo, name, dynamic=True)
    if name == "compile-auto":
        return TorchCompile(demo, name, dynamic=None)
    if name == "compile-max-autotune":
        # Inductor benchmarks its GEMM choices (ATen, and on a CPU its C++ GEMM templates)
        # at each compile. "reduce-overhead" is not offered here: its CUDA graphs skip
        # CPU graphs, so on a CPU it compiles what the default mode does.
        return TorchCompile(demo, name, dynamic=None, mode="max-autotune")
    if name == "dynvm-interp":
        return Dynvm(demo, name, jit=False)
    if name == "dynvm-interp-b":
        # The A/A: a second interpreter Runtime of the same program in the same rotation;
        # its distance from the first states the margin of "JIT <= interpreter".
        return Dynvm(demo, name, jit=False)
    if name == "dynvm-jit":
        return Dynvm(demo, name, jit=True)
    if name in ("onnxruntime", "onnxruntime-int8", "openvino", "openvino-bf16"):
        return OnnxPeer(demo, name)
    raise KeyError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
