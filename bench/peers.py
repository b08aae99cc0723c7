"""ONNX Runtime and OpenVINO as peers of the benchmarks (`dynvm bench`, `dynvm bench
zoo`, bench.full_width): a model is exported once to ONNX with dynamic axes, then run by
each runtime on the CPU with the thread count torch uses. Installed by the `bench` extra
(`pip install -c constraints -e '.[bench]'`), never a dependency of dynvm itself.

Note [ONNX peers]
~~~~~~~~~~~~~~~~~
What a user of these runtimes would deploy, set up for interleaved timing:
- Export: torch.onnx.export with the dynamo exporter (torch.export, the same front end as
  dynvm's) and the model's own dynamic_shapes; where it fails, the TorchScript exporter
  with the same dims as dynamic_axes. The exporter used is reported.
- ONNX Runtime: CPUExecutionProvider, every graph optimization, intra_op_num_threads =
  torch's threads, inter-op 1, sequential execution, and
  `session.intra_op.allow_spinning = 0`: its pool otherwise spins after each call and
  takes the cores from the system that runs next (call by call interleaving). int8: the
  exported file through onnxruntime.quantization.quantize_dynamic (weights int8,
  activations quantized per call, MatMul and Gemm only), ORT's own recipe for CPU.
- OpenVINO: the ONNX file read by ov.Core, compiled for "CPU" with INFERENCE_NUM_THREADS
  = torch's threads, PERFORMANCE_HINT = LATENCY (one stream), and INFERENCE_PRECISION_HINT
  f32 or bf16 (bf16 only where the CPU has it; OpenVINO otherwise runs f32 silently, so
  the system refuses to start instead).
A runtime that is not installed, or a model that does not export, makes the system fail
at setup with `PeerUnavailable` and its reason; the benchmarks report the reason in the
system's row and go on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings

import torch

PEER_SYSTEMS = ("onnxruntime", "onnxruntime-int8", "openvino", "openvino-bf16")
INSTALL_HINT = ("pip install -c <constraints holding torch> -e '.[bench]' "
                "(see pyproject.toml's bench extra)")


class PeerUnavailable(RuntimeError):
    """A peer cannot run here: its runtime is not installed, the CPU lacks the
    precision asked for, or the model does not export to ONNX (the message says which)."""


def _dim_name(dim, axis: int) -> str:
    return getattr(dim, "__name__", None) or f"dim{axis}"


def export_onnx(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes,
                path: str) -> str:
    """Write `module` as ONNX to `path` with the dims of `dynamic_shapes` (one {axis: Dim}
    or None per positional input) dynamic; returns the exporter that worked ("dynamo"
    or "torchscript"). Raises PeerUnavailable when neither exports it."""
    try:
        import onnx  # noqa: F401 - both exporters write through it
    except ImportError:
        raise PeerUnavailable(f"onnx is not installed: {INSTALL_HINT}") from None
    names = [f"x{i}" for i in range(len(example_inputs))]
    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(module, tuple(example_inputs), dynamo=True,
                                        dynamic_shapes=tuple(dynamic_shapes),
                                        input_names=names, verbose=False)
            program.save(path)
            return "dynamo"
        except Exception as exc:  # noqa: BLE001 - the exporter's errors have no common base
            errors.append(f"dynamo: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        axes = {name: {axis: _dim_name(d, axis) for axis, d in (spec or {}).items()}
                for name, spec in zip(names, dynamic_shapes)}
        try:
            torch.onnx.export(module, tuple(example_inputs), path, dynamo=False,
                              input_names=names, dynamic_axes=axes, opset_version=17)
            return "torchscript"
        except Exception as exc:  # noqa: BLE001
            errors.append(f"torchscript: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200]}")
    raise PeerUnavailable("the model does not export to ONNX (" + "; ".join(errors) + ")")


def _numpy(tensors) -> list:
    return [t.detach().contiguous().numpy() for t in tensors]


class Exported:
    """One model's ONNX file in a temporary folder, removed by close(). Peers of one
    model may share it (`Peer(..., exported=)`): the export is most of a peer's setup
    (30-90 s at bert-base width on a loaded host), and every peer reads the same file."""

    def __init__(self, module, example_inputs, dynamic_shapes, kept: str | None = None) -> None:
        """`kept`: a path where the export is kept across runs (bench.full_width --cache):
        read from there if it exists (exporter "kept", 0 export seconds), else written."""
        self._folder = tempfile.TemporaryDirectory(prefix="dynvm-onnx-")
        self.path = os.path.join(self._folder.name, "model.onnx")
        if kept is not None and os.path.exists(kept):
            shutil.copyfile(kept, self.path)
            self.exporter, self.export_seconds = "kept", 0.0
            return
        start = time.perf_counter()
        self.exporter = export_onnx(module, example_inputs, dynamic_shapes, self.path)
        self.export_seconds = time.perf_counter() - start
        if kept is not None:
            shutil.copyfile(self.path, kept)

    def close(self) -> None:
        self._folder.cleanup()


def ort_session_options(ort, threads: int):
    """The SessionOptions of every ONNX Runtime session the benchmarks time (Note [ONNX
    peers]): `threads` intra-op threads, one inter-op, sequential, every graph
    optimization, spinning off, warnings and above only."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3
    return options


class OrtRunner:
    """An ONNX Runtime session over an exported file (Note [ONNX peers]); calling it
    with torch tensors returns a tuple of torch tensors."""

    def __init__(self, path: str, threads: int, int8: bool = False) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise PeerUnavailable(f"onnxruntime is not installed: {INSTALL_HINT}") from None
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantized = path[:-len(".onnx")] + ".int8.onnx"
            quantize_dynamic(path, quantized, weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul", "Gemm"])
            path = quantized
        options = ort_session_options(ort, threads)
        self.session = ort.InferenceSession(path, options,
                                            providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.version = ort.__version__

    def __call__(self, *inputs) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise PeerUnavailable(f"the exported graph takes {len(self.input_names)} inputs "
                                  f"({', '.join(self.input_names)}), the call gave "
                                  f"{len(inputs)}")
        outs = self.session.run(None, dict(zip(self.input_names, _numpy(inputs))))
        return tuple(torch.from_numpy(o) for o in outs)


def cpu_has_bf16() -> bool:
    """The CPU computes in bf16 natively (avx512_bf16 or amx_bf16 in /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class OpenvinoRunner:
    """An OpenVINO CPU compiled model over an exported file (Note [ONNX peers])."""

    def __init__(self, path: str, threads: int, bf16: bool = False,
                 perf_count: bool = False) -> None:
        try:
            import openvino as ov
        except ImportError:
            raise PeerUnavailable(f"openvino is not installed: {INSTALL_HINT}") from None
        if bf16 and not cpu_has_bf16():
            raise PeerUnavailable("openvino-bf16: this CPU has neither avx512_bf16 nor "
                                  "amx_bf16 (OpenVINO would run f32 under the bf16 name)")
        core = ov.Core()
        model = core.read_model(path)
        self.compiled = core.compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32",
            # per-node timers (bench.width_profile); off for timing
            "PERF_COUNT": perf_count})
        self.request = self.compiled.create_infer_request()
        self.outputs = len(self.compiled.outputs)
        self.version = ov.__version__.split("-")[0]

    def __call__(self, *inputs) -> tuple[torch.Tensor, ...]:
        self.request.infer(_numpy(inputs))
        # The request reuses its output buffers: copy out, as any caller must.
        return tuple(torch.from_numpy(self.request.get_output_tensor(i).data.copy())
                     for i in range(self.outputs))


class Peer:
    """One peer system on one model: export, then the runtime (Note [ONNX peers]).
    `setup_seconds` is the export plus the runtime's own build (session, compile)."""

    def __init__(self, name: str, module, example_inputs, dynamic_shapes,
                 threads: int | None = None, exported: Exported | None = None) -> None:
        if name not in PEER_SYSTEMS:
            raise KeyError(f"unknown peer {name!r}; known: {', '.join(PEER_SYSTEMS)}")
        self.name = name
        threads = threads or torch.get_num_threads()
        self._check_installed(name)
        start = time.perf_counter()
        # A shared export is its owner's to close; its seconds count for every peer.
        self._owns_export = exported is None
        self._exported = exported or Exported(module, example_inputs, dynamic_shapes)
        try:
            if name.startswith("onnxruntime"):
                self.runner = OrtRunner(self._exported.path, threads,
                                        int8=name.endswith("int8"))
            else:
                self.runner = OpenvinoRunner(self._exported.path, threads,
                                             bf16=name.endswith("bf16"))
        except BaseException:
            if self._owns_export:
                self._exported.close()
            raise
        self.setup_seconds = time.perf_counter() - start + (
            0.0 if self._owns_export else self._exported.export_seconds)
        self.exporter = self._exported.exporter
        self.version = self.runner.version

    @staticmethod
    def _check_installed(name: str) -> None:
        import importlib.util

        module = "onnxruntime" if name.startswith("onnxruntime") else "openvino"
        for needed in (module, "onnx", "onnxscript"):
            if importlib.util.find_spec(needed) is None:
                raise PeerUnavailable(f"{name}: {needed} is not installed: {INSTALL_HINT}")

    @property
    def path(self) -> str:
        """The exported ONNX file (removed by close())."""
        return self._exported.path

    def __call__(self, *inputs) -> tuple[torch.Tensor, ...]:
        return self.runner(*inputs)

    def close(self) -> None:
        self.runner = None
        if self._owns_export:
            self._exported.close()
