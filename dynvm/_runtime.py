"""`Runtime`: a program bound to a device, callable like the module it came from."""

from __future__ import annotations

import threading

import torch
from torch.utils import _pytree as pytree

from dynvm._env import JIT as JIT_VARIABLE
from dynvm._env import runtime_settings
from dynvm._runtime_stats import RuntimeStats
from dynvm.arena import count_allocations
from dynvm.jit.background import serving_call
from dynvm.jit.config import JitConfig
from dynvm.jit.engine import Jit
from dynvm.jit.engine_stats import JitStats
from dynvm.telemetry import GlobalProviderWatch, Telemetry
from dynvm.vm.budget import CallBudget
from dynvm.vm.errors import ConfigTypeError, InputError, ShapeError
from dynvm.vm.interpreter import Interpreter


class Runtime:
    """Runs a `Program` on one device.

    `runtime(*inputs)` validates the inputs against the program's signature and returns
    outputs with the structure of the original module's outputs. `jit=True` (the
    default) or a `JitConfig` attaches the JIT tier through the VM's region cache slots
    (`dynvm.vm.slots`); `jit=False` always runs the pure interpreter. Calls may come
    from several threads at once.

    `telemetry` (a `dynvm.telemetry.Telemetry`) traces each call, promotion, compile and
    guard failure (Note [Trace shape]); a disabled one: no tracing work at all. None (the
    default): the application's global OpenTelemetry provider once it sets one, and no
    tracing work until then (Note [Global tracer provider]).

    `budget` (a `dynvm.CallBudget`: seconds and loop iterations, finite by default)
    bounds every call; a call past it raises `dynvm.CallBudgetError` naming the loop
    (Note [Call budget]). `runtime(*inputs, budget=...)` overrides it for one call.

    `kernel_store` (a `dynvm.cluster.StoreConfig`, e.g. a local directory and a secret)
    keeps the JIT's kernels across restarts: what the store holds for this program is
    installed now, without compiling, and what the JIT compiles from now on is kept
    there (Note [Kept kernels] in dynvm.cluster.fleet._kernel_keeper).

    DYNVM_JIT=0 in the environment (dynvm._env) turns the JIT off for every Runtime,
    whatever `jit` says, for debugging; stats()["jit_disabled_by"] then says so.
    """

    def __init__(self, program, device: str | torch.device = "cpu",
                 jit: bool | JitConfig = True, telemetry: Telemetry | None = None,
                 budget: CallBudget | None = None, kernel_store=None) -> None:
        self.program = program
        self.interpreter = Interpreter(program, device, budget)
        self.budget = self.interpreter.budget
        self.device = self.interpreter.device
        # Note [Global tracer provider]: without an explicit Telemetry, follow the global
        # one; `_global_watch` stays only while that is still the no-op proxy.
        self._global_watch: GlobalProviderWatch | None = None
        if telemetry is None:
            telemetry = Telemetry.from_global()
            self._global_watch = GlobalProviderWatch() if telemetry is None else None
        self.telemetry = telemetry if telemetry is not None and telemetry.enabled else None
        self.jit: Jit | None = None
        wants_jit = jit is True or isinstance(jit, JitConfig)
        if not wants_jit and jit not in (False, None):
            raise ConfigTypeError(f"jit must be True, False or a JitConfig, got {jit!r}")
        settings = runtime_settings() if wants_jit else None
        self.jit_disabled_by: str | None = (
            f"{JIT_VARIABLE}={settings.jit_text}" if settings and not settings.jit else None)
        if wants_jit and self.jit_disabled_by is None:
            self.jit = Jit(program, self.interpreter, jit if jit is not True else None,
                           self.telemetry)
            self.jit.attach()
        # A StoreConfig: kernels kept there install now, new ones are kept (Note [Kept
        # kernels] in dynvm.cluster.fleet._kernel_keeper); nothing to keep without the JIT.
        self.kernel_keeper = None
        if kernel_store is not None and self.jit is not None:
            from dynvm.cluster.fleet._kernel_keeper import keep_kernels

            self.kernel_keeper = keep_kernels(self, kernel_store)
        self._in_spec = pytree.treespec_loads(program.in_spec)
        self._out_spec = pytree.treespec_loads(program.out_spec)
        self._n_inputs = len(program.inputs)
        self._flat_inputs = self._in_spec == pytree.tree_flatten((None,) * self._n_inputs)[1]
        self._lock = threading.Lock()
        self._calls = 0
        self._last_allocations: int | None = None

    def __call__(self, *inputs, budget: CallBudget | None = None):
        if self.telemetry is None and (self._global_watch is None
                                       or not self._follow_global()):
            return self._call(inputs, budget)
        with self.telemetry.tracer.start_as_current_span(
                "dynvm.call", attributes={"dynvm.program": self.program.name}) as span:
            outputs = self._call(inputs, budget)
            span.set_attribute("dynvm.input_shapes", [
                str(tuple(t.shape)) for t in pytree.tree_leaves(inputs)
                if isinstance(t, torch.Tensor)])
            return outputs

    def _follow_global(self) -> bool:
        """True when the application has just set its global provider: from now on this
        runtime (and its JIT) trace into it (Note [Global tracer provider])."""
        watch = self._global_watch  # another thread may drop it meanwhile (below)
        telemetry = watch.check() if watch is not None else None
        if telemetry is None:
            return self.telemetry is not None
        with self._lock:
            if self.telemetry is None:
                if self.jit is not None:
                    self.jit.trace_with(telemetry)
                self.telemetry = telemetry
            self._global_watch = None
        return True

    def _call(self, inputs: tuple, budget: CallBudget | None):
        flat = inputs if self._flat_inputs else self._flatten(inputs)
        if len(flat) != self._n_inputs:
            names = ", ".join(spec.name for spec in self.program.inputs)
            raise InputError(f"{self.program.name} takes {self._n_inputs} inputs ({names}), "
                             f"got {len(flat)}")
        for position, value in enumerate(flat):
            if not isinstance(value, torch.Tensor):
                # Checked here, before any region's guard hashes the inputs.
                raise ShapeError(f"input {self.program.inputs[position].name!r}: expected a "
                                 f"tensor, got {type(value).__name__}")
        # Counted in flight, with or without a JIT: compiles wait for it (Note
        # [Background work yields to calls] in dynvm.jit.background).
        with serving_call(), torch.inference_mode():
            outputs = self.interpreter.run(flat, budget)
        with self._lock:
            self._calls += 1
            calls = self._calls
        jit = self.jit
        if jit is not None:  # Note [Detached regions] in dynvm.jit.region_watch
            jit.program_call_done(calls)
        return pytree.tree_unflatten(outputs, self._out_spec)

    def _flatten(self, inputs: tuple) -> list:
        flat, spec = pytree.tree_flatten(inputs)
        if spec != self._in_spec:
            raise InputError(f"{self.program.name}: inputs have structure {spec}, "
                             f"expected {self._in_spec}")
        return flat

    def region_calls(self) -> tuple[int, int]:
        """(specialized, interpreted) region calls so far, from the JIT's per-region
        counters: a few reads, cheap enough to take around every call (a serving replica
        learns from it which batch sizes run specialized). Without the JIT: (0, calls)."""
        if self.jit is None:
            return 0, self._calls
        specialized = interpreted = 0
        for region in list(self.jit.regions.values()):
            specialized += region.counters.specialized
            interpreted += region.counters.interpreted
        if self.jit.detached:
            # A detached region's calls are counted nowhere (Note [Detached regions] in
            # dynvm.jit.region_jit); each program call counts as one of its interpreted
            # calls, so that no call looks entirely specialized while one is detached.
            interpreted += self._calls
        return specialized, interpreted

    def settled(self) -> bool:
        """True when the JIT has no compile queued or running and no specialization on
        probation (always True without the JIT): its steady state, e.g. for benchmarks."""
        return self.jit is None or self.jit.settled()

    def measure_allocations(self, *inputs) -> int:
        """Run one call counting the fresh tensor storages its ATen ops create (a
        dispatch mode: slow, so only on request); the count also appears in stats()."""
        _, count = count_allocations(self, *inputs)
        self._last_allocations = count
        return count

    def stats(self) -> RuntimeStats:
        """Counters since the runtime was made, the JIT's too when it is on (per-region
        figures in `regions`, by region index); `to_dict()` gives the JSON form."""
        own = {"calls": self._calls,
               "instructions_executed": self.interpreter.instructions_executed,
               "region_count": len(self.program.regions),
               "instructions": len(self.program.code), "device": str(self.device),
               "jit": self.jit is not None, "jit_disabled_by": self.jit_disabled_by or None,
               "allocations_per_forward": self._last_allocations}
        if self.jit is None:
            return RuntimeStats.of(None, **own)
        tracing = self.jit.tracing
        limiter = tracing.event_limiter if tracing is not None else None
        # The engine's typed counters, taken field by field (dynvm.jit.engine_stats).
        return RuntimeStats.of(JitStats.from_engine(self.jit), **own,
                               telemetry_events_dropped=None if limiter is None
                               else limiter.dropped)

    def close(self) -> None:
        """Stop background compiles; the runtime keeps working (interpreted)."""
        if self.jit is not None:
            self.jit.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
