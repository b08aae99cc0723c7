"""The JIT tier of one Runtime: region slots, the compile queue, the CPU backend.

`Jit.attach()` installs a `RegionJit` into every region of the interpreter that is worth
watching (at least `MIN_TENSOR_OPS` tensor operations: a loop header that only compares
two scalars would pay for a signature on every iteration and never gain). Promotions
become compile tasks on the queue; a finished compile installs its specialization into
the region's slot, from whichever thread ran it.

Note [Fleet hooks]
~~~~~~~~~~~~~~~~~~
In a cluster, one compile service specializes for every replica (docs/ARCHITECTURE.md,
How a request travels).
The JIT knows nothing of Ray or Redis; it offers three seams that dynvm.cluster uses:
`connect(fleet)` lets a replica's link hear every interpreted region call (the
signature statistics it ships to the service) and decide whether promotions compile
here (not while the service is reachable, so a shape is compiled once per fleet, not
once per replica); `install_portable` installs a specialization compiled elsewhere
(Note [Portable specializations]); `add_compile_listener` lets the service publish what
its own JIT compiled. With no fleet connected, none of this costs anything.

Note [Failure accounting]
~~~~~~~~~~~~~~~~~~~~~~~~~
A compile may fail for three kinds of reasons. The program's own input checks reject
the signature (`InputRejected`: every call with it raises in the interpreter too): only
counted, `specialize_rejections`. It ran past the compile deadline: counted by the
queue (`compile_timeouts`) and logged. Anything else (the specializer's abstract
evaluation raising, a rewrite or a backend failing) is a dynvm bug, and a bug must not
hide behind a silent fallback to the interpreter: it is counted by reason in
`specialize_failures` (the reason is the root exception's type and the first line of its
message, so one bug is one entry however many regions and signatures hit it), logged
once per region and reason in the event log (`dynvm explain` prints it, `dynvm top`
shows the count), and sent as a `dynvm.specialize_failure` event on the compile span.
Tests assert zero on the demo models, the zoo on its models.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

from opentelemetry import context as otel_context

from dynvm.arena import ArenaPool
from dynvm.jit.artifact import Artifact, cache_key
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.background import checkpoint, waited_here
from dynvm.jit.config import JitConfig
from dynvm.jit.detached_regions import DetachedRegions
from dynvm.jit.engine_stats import EngineCounters, jit_stats
from dynvm.jit.engine_tracing import JitTracing
from dynvm.jit.guards import GuardStrength, describe
from dynvm.jit.policy import EXACT, FAMILY
from dynvm.jit.portable import PortableError, PortableSpecialization
from dynvm.jit.prewarm import prewarm, warm_registers
from dynvm.jit.probation import CONFIRMED, DEMOTE, ProbationCounters
from dynvm.jit.probes import abstract_live_ins, clip_to_declared, family_live_ins
from dynvm.jit.queue import CompileQueue, CompileTimeout
from dynvm.jit.region_jit import RegionJit, Specialization
from dynvm.jit.region_slot import BuiltCode
from dynvm.jit.settling import awaiting_verdict, short_of_promotion
from dynvm.jit.specialize import InputRejected, failure_reason, specialize
from dynvm.shape_cluster import Family
from dynvm.vm.isa import OpClass

MIN_TENSOR_OPS = 2
MAX_ARTIFACTS = 256   # artifacts kept for `dynvm explain` and stats (newest)


class Jit:
    """The JIT tier of one Runtime (module docstring): a RegionJit in every region
    worth watching, the compile queue, the backends, and the counters of `stats()`.
    Its regions reach it only through the `RegionHost` interface (dynvm.jit.region_jit);
    its spans and events go through the `JitTracing` it holds while tracing."""

    def __init__(self, program, interpreter, config: JitConfig | None = None,
                 telemetry=None) -> None:
        self.program = program
        self.interpreter = interpreter
        self.config = config or JitConfig()
        self.queue = CompileQueue(self.config.compile_threads, self.config.max_queue_length,
                                  self.config.sync, timeout_s=self.config.compile_timeout_s)
        self.regions: dict[int, RegionJit] = {}
        # Compiles, installs, failures by reason (Note [Failure accounting]), ...: the
        # engine's counters, under self._lock; JitStats reports them.
        self.counters = EngineCounters()
        self._failures_logged: set[tuple[int, str]] = set()   # (region, reason) logged
        self.probation_counters = ProbationCounters()   # Note [Probation]
        # Seconds per instruction of recent compiles, by kind of kernel (Note [Compile
        # cost estimate], Note [Promotion by kind]).
        self._compile_rates: dict[str, deque[float]] = {
            EXACT: deque(maxlen=16), FAMILY: deque(maxlen=16)}
        self._lock = threading.Lock()
        self.artifacts: dict[str, Artifact] = {}
        # Explained guard failures (sampled), deopts and failed compiles, newest last;
        # bounded (see _log).
        self.event_log: list[str] = []
        self._constants = [interpreter.constant(i) for i in range(len(program.constants))]
        # Input registers that no instruction overwrites: wherever a region reads one, it
        # holds the program input, so the input's declared ranges apply to it.
        written = {dst.index for instr in program.code for dst in instr.dsts}
        self._input_registers = frozenset(range(len(program.inputs))) - written
        # Note [Fleet hooks]: set by `connect` when a cluster shares this JIT's work.
        self.fleet = None
        self._compile_listeners: list = []
        # Note [Detached regions] in dynvm.jit.region_watch: the Runtime reports each
        # program call's count to `program_call_done`, which re-attaches the regions
        # whose period ended.
        self.detaching = DetachedRegions()
        self.arena_pool = (ArenaPool(interpreter.device, self.config.arena_budget_bytes)
                           if self.config.arena_budget_bytes > 0 else None)
        self._cpu_options = CpuOptions(self.arena_pool, fusion=self.config.cpu_fusion,
                                       channels_last=self.config.cpu_channels_last,
                                       arena_ops=self.config.arena_ops,
                                       column_halves={"measured": "on"}.get(
                                           self.config.cpu_column_halves, "off"),
                                       precision=self.config.precision)
        # "cpu" or "triton" (JitConfig.backend resolved for this device); it enters
        # every cache key. Triton is imported only when it is chosen.
        self.backend = self.config.backend_for(interpreter.device)
        # Note [Trace shape] in dynvm.telemetry; None: no tracing work at all.
        self.tracing = JitTracing(telemetry, program, self.backend, interpreter.device) \
            if telemetry is not None and telemetry.enabled else None
        self._options_key = self._cpu_options.as_key()
        self._triton_options = None
        if self.backend == "triton":
            from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS

            self._triton_options = DEFAULT_OPTIONS
            self._options_key = {"cpu": self._options_key,
                                 "triton": DEFAULT_OPTIONS.as_key()}

    def trace_with(self, telemetry) -> None:
        """Start tracing into `telemetry` (enabled): the application set its global
        provider after this JIT was made (Note [Global tracer provider] in
        dynvm.telemetry). One store: a thread sees no tracing or all of it."""
        self.tracing = JitTracing(telemetry, self.program, self.backend,
                                  self.interpreter.device)

    def attach(self) -> None:
        """Put a RegionJit into the slot of every region worth watching."""
        for region in self.program.regions:
            code = self.program.code[region.start:region.stop]
            tensor_ops = sum(1 for instr in code if instr.spec.opclass is OpClass.TENSOR)
            if tensor_ops >= MIN_TENSOR_OPS:
                slot = RegionJit(self, region, self.interpreter.region_steps(region.index),
                                 any(instr.spec.writes_state for instr in code))
                self.regions[region.index] = slot
                self.interpreter.install_slot(region.index, slot)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the compile workers after their compile; with `wait_s`, join them for up
        to that long (Note [Scheduler threads end before exit] in
        dynvm.cluster.serving._generate_exit)."""
        self.queue.close(wait_s)

    def packed_weight_bytes(self) -> int:
        """Bytes of the oneDNN-packed weight copies this engine's kernels hold alive
        (Note [Prepacked weights] in dynvm.jit.backends.cpu.prepack)."""
        return self._cpu_options.prepacked.nbytes()

    # -- detached regions (Note [Detached regions] in dynvm.jit.region_watch) -------------

    @property
    def detached(self) -> dict[int, int]:
        """Detached region index -> the program call that re-attaches it (read-only)."""
        return self.detaching.until

    def detach(self, region_jit: RegionJit, period: int) -> None:
        """Give `region_jit`'s region the interpreter's plain unit back for `period`
        program calls (called by the region, holding its lock)."""
        index = region_jit.region.index
        if self.regions.get(index) is not region_jit:
            return
        # One list-item store in the interpreter's plan: a call on another thread runs
        # either the old unit (the slot still works) or the plain one.
        if not self.detaching.detach(index, period,
                                     lambda: self.interpreter.install_slot(index, None)):
            return
        self._log(f"region {index} detached: no specialization can pay for its compile; "
                  f"looked at again in {period} calls")

    def program_call_done(self, calls: int) -> None:
        """The Runtime finished its `calls`-th program call: the clock of detached
        regions (Note [Detached regions]), re-attaching those whose period ended."""
        detaching = self.detaching
        detaching.program_calls = calls
        if calls >= detaching.reattach_at:
            self.reattach_due(calls)

    def reattach_due(self, program_calls: int, everything: bool = False) -> None:
        """Re-attach the detached regions whose period has ended (the Runtime calls it
        when `program_calls` reaches `reattach_at`, via `program_call_done`)."""
        def plug(index: int) -> None:
            region_jit = self.regions[index]
            region_jit.reattached()
            self.interpreter.install_slot(index, region_jit)

        for index in self.detaching.reattach_due(program_calls, plug, everything):
            self._log(f"region {index} re-attached after its detached period")

    def detached_program_calls(self, index: int) -> int:
        """Program calls that ran region `index` without its slot (its entries in them
        are counted nowhere else)."""
        return self.detaching.program_calls_of(index)

    def _reattach_all(self) -> None:
        self.reattach_due(self.detaching.program_calls, everything=True)

    # -- fleet (Note [Fleet hooks]) -----------------------------------------------------

    def connect(self, fleet) -> None:
        """Share this JIT's work with a fleet: `fleet.observed(region, signature, seconds)`
        hears every interpreted region call, and `fleet.compiles_locally()` says whether
        promotions compile here (False while a compile service does it for everyone)."""
        self.fleet = fleet
        self._reattach_all()  # the fleet hears every interpreted call (Note [Detached regions])

    def add_compile_listener(self, listener) -> None:
        """`listener(region_jit, specialization)` runs after each local compile installs
        (on the compile thread); the compile service publishes from there."""
        self._compile_listeners.append(listener)

    def settled(self) -> bool:
        """True when no compile is queued or running, no installed specialization that
        its region's calls still reach is on probation (Note [Probation]), every region
        with nothing installed has had its first cold check (Note [Cold regions]: until
        then it is profiled on every call; after it, it is watched, cold or detached for
        good reason), and no attached region has a key on its way to a promotion (Note
        [Settled]): the JIT's steady state, as far as it knows."""
        if len(self.queue):
            return False
        local = self.compiles_locally()
        for index, region_jit in list(self.regions.items()):
            installed = region_jit.installed()
            if region_jit.pending or awaiting_verdict(region_jit, installed):
                return False
            if local and not installed and not region_jit.watch.checked:
                return False
            if local and index not in self.detaching and short_of_promotion(region_jit):
                return False
        return True

    def compiles_locally(self) -> bool:
        if not self.config.online_compile:
            return False
        return self.fleet is None or self.fleet.compiles_locally()

    # -- policy inputs ---------------------------------------------------------------

    # Note [Compile cost estimate]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A compile's cost (jit.policy weighs it against the benefit) is estimated from the
    # lower median of the recent compiles' seconds per instruction (of the kernel's kind,
    # exact or family: Note [Promotion by kind]), or the config's per-instruction guess
    # before any. Not the mean: a process's first compile also pays
    # torch's one-time loading of its meta kernels (about a second here), and averaged
    # in, that one outlier kept every small region's estimated cost above any benefit for
    # the life of the process, so hot small regions were never compiled.

    def estimated_compile_seconds(self, instructions: int, kind: str) -> float:
        """Seconds a compile of a kernel of `kind` (EXACT, FAMILY) for a region of
        `instructions` instructions is expected to take, from that kind's compiles (Note
        [Compile cost estimate], Note [Promotion by kind])."""
        rates = self._compile_rates[kind]
        if rates:
            per_instruction = sorted(rates)[(len(rates) - 1) // 2]
        else:
            per_instruction = self.config.compile_seconds_per_instruction
        return self.config.compile_seconds_base + per_instruction * instructions

    # -- compile pipeline ------------------------------------------------------------

    def key_for(self, region_jit: RegionJit, target, options_key=None) -> str:
        family_key = target.key if isinstance(target, Family) else describe(target)
        return cache_key(self.program.content_hash, region_jit.region.index, family_key,
                         self.backend, str(self.interpreter.device),
                         self._options_key if options_key is None else options_key)

    def promote(self, region_jit: RegionJit, target, decision) -> None:
        """Queue the compile of a signature (exact) or a Family (family kernel)."""
        # The region marked the target pending under the key it observed; clipping may
        # change a family's key, so the bookkeeping keeps the observed one.
        pending = target.key if isinstance(target, Family) else target
        if isinstance(target, Family):
            target = self.clip_to_declared(region_jit, target)
        key = self.key_for(region_jit, target)
        tracing = self.tracing
        if tracing is None:
            future = self.queue.submit(key, decision.benefit_seconds,
                                       lambda: self._compile(region_jit, target, key))
            future.add_done_callback(lambda f: self._finished(region_jit, pending, f))
            return
        # Captured here, on the promoting call's thread: the compile and install spans
        # are its children wherever they run (Note [Trace shape]).
        index = region_jit.region.index
        parent = tracing.promote_span(index, target, key, decision)
        future = self.queue.submit(key, decision.benefit_seconds,
                                   lambda: tracing.traced_compile(
                                       lambda: self._compile(region_jit, target, key),
                                       index, target, key, parent))
        future.add_done_callback(lambda f: self._finished(region_jit, pending, f, parent))

    def clip_to_declared(self, region_jit: RegionJit, family: Family) -> Family:
        """`family` cut to the program's declared dim ranges (jit.specialize)."""
        return clip_to_declared(family, region_jit.live_in, self.program.inputs,
                                self._input_registers)

    def _compile(self, region_jit: RegionJit, target, key: str) -> Specialization:
        start = time.perf_counter()
        waited = waited_here()
        region = region_jit.region
        if isinstance(target, Family):
            probes = [family_live_ins(region_jit.live_in, target, dims)
                      for dims in target.probe_dims()]
            ir = specialize(self.program, region, probes[0], tuple(probes[1:]))
            strength, family, signature = GuardStrength.FAMILY, target, ()
        else:
            ir = specialize(self.program, region, abstract_live_ins(region_jit.live_in,
                                                                      target))
            strength = GuardStrength.STRONG if ir.assumes_shapes else GuardStrength.WEAK
            family, signature = None, target
        checkpoint()   # Note [Background work yields to calls]
        spec = self._build(ir, strength, signature, family, key, start)
        waited = waited_here() - waited
        if waited > 0:   # the compile's cost is its own work, not its waits for calls
            spec.artifact = dataclasses.replace(
                spec.artifact, compile_seconds=max(0.0, spec.artifact.compile_seconds - waited))
        with self._lock:
            if self.artifacts.get(key) is not None:
                self.artifacts[key] = spec.artifact
            counters = self.counters
            counters.compiles += 1
            counters.compile_seconds += spec.artifact.compile_seconds
            self._compile_rates[EXACT if family is None else FAMILY].append(
                spec.artifact.compile_seconds / max(1, len(region)))
            if family is not None:
                counters.family_compiles += 1
        if strength is GuardStrength.STRONG and spec.artifact.backend == "cpu":
            # Note [Prewarmed installs]: its first call here, not on a request.
            self.counters.prewarm_seconds += prewarm(spec.fn, warm_registers(
                self.program.n_regs, self._constants, region_jit.live_in, signature,
                self.interpreter.device))
        return spec

    def _build(self, ir, strength: GuardStrength, signature: tuple, family: Family | None,
               key: str, start: float, cpu_options: CpuOptions | None = None
               ) -> Specialization:
        """Generate and load the backend code of a specialized region (`cpu_options`:
        other than the engine's, for a re-plan without the arena)."""
        described = f"family {family.key}" if family is not None else describe(signature)
        notes = ir.notes
        if self.backend == "triton":
            built = self._build_triton(ir, family.key if family is not None else described,
                                       key)
            if not isinstance(built, str):
                code = BuiltCode("triton", built.kernel_name, built.source, built.fn,
                                 tuple(built.notes), built.metadata)
                return self._finish_build(key, code, ir=ir, strength=strength,
                                          signature=signature, family=family, start=start)
            notes = (*notes, built)
        kernel = compile_kernel(ir, self.program, self._constants, self.interpreter.device,
                                described, strength.value, cpu_options or self._cpu_options,
                                owner=key)
        code = BuiltCode("cpu", kernel.name, kernel.source, kernel.fn, tuple(notes),
                         arena=kernel.arena is not None)
        return self._finish_build(key, code, ir=ir, strength=strength, signature=signature,
                                  family=family, start=start)

    def _finish_build(self, key: str, code: BuiltCode, *, ir, strength: GuardStrength,
                      signature: tuple, family: Family | None, start: float
                      ) -> Specialization:
        """The Specialization of `code`, built for `key` from `ir` to serve `signature`
        or `family` at `strength`; its artifact is kept (`start`: when the build began)."""
        fn, notes, arena = code.fn, code.notes, code.arena
        if self.interpreter.device.type == "cuda" and not arena:
            # Captured here, on the building thread, never on a request (Note [CUDA graph
            # outputs]); code that takes an arena per call is never captured.
            from dynvm.jit.backends.triton.graphs import maybe_capture

            fn, note = maybe_capture(fn, strength, signature, ir, self.interpreter.device,
                                     self.config.cuda_graphs_max_batch)
            notes = (*notes, note) if note else notes
        seconds = time.perf_counter() - start
        artifact = Artifact(key, code.backend, str(self.interpreter.device), code.kernel_name,
                            code.source, strength.value, tuple(notes), seconds, code.metadata)
        with self._lock:
            self.artifacts[key] = artifact
            while len(self.artifacts) > MAX_ARTIFACTS:  # oldest first (insertion order)
                del self.artifacts[next(iter(self.artifacts))]
        return Specialization(signature, strength, fn, artifact, family, ir=ir, arena=arena)

    def _build_triton(self, ir, family_key: str, key: str):
        """The Triton build of `ir`, or (a str) why the CPU backend compiles it instead."""
        from dynvm.jit.backends.triton import TritonBackendError
        from dynvm.jit.backends.triton.compiled_region import build_specialization

        try:
            built = build_specialization(ir, self._constants, self.interpreter.device,
                                         program_hash=self.program.content_hash,
                                         family_key=family_key,
                                         options=self._triton_options)
        except TritonBackendError as exc:
            reason = (f"triton backend: compiled by the cpu backend instead "
                      f"({type(exc).__name__}: {exc})")
            with self._lock:
                self.counters.triton_fallbacks += 1
            self._log(f"region {ir.region_index} {key[:12]}: {reason}")
            return reason
        with self._lock:
            self.counters.triton_compiles += 1
        return built

    def install_portable(self, portable: PortableSpecialization,
                         key: str) -> Specialization | None:
        """Install a specialization compiled elsewhere (Note [Portable specializations]):
        code is re-emitted from its IR, nothing is specialized here. `key` is the cache key
        it was stored under; the record's guard must hash to it. Returns None when the
        region is not watched here or the key is already installed."""
        region_jit = self.regions.get(portable.region)
        if region_jit is None:
            return None
        target = portable.family if portable.family is not None else portable.signature
        if self.key_for(region_jit, target) != key:
            with self._lock:
                self.counters.install_rejections += 1
            raise PortableError(f"record for region {portable.region} does not match the "
                                f"key {key[:16]} it was stored under (another target, "
                                f"device or options)")
        if any(s.artifact.key == key for s in region_jit.installed()):
            return None
        start = time.perf_counter()
        spec = self._build(portable.ir, portable.strength, portable.signature,
                           portable.family, key, start)
        region_jit.install(spec, None)
        with self._lock:
            self.counters.installs += 1
            self.counters.install_seconds += time.perf_counter() - start
        return spec

    def install_loaded(self, portable: PortableSpecialization, key: str, fn, *,
                       backend: str, kernel_name: str, source: str, notes: tuple,
                       metadata: dict, load_seconds: float) -> Specialization | None:
        """Install a specialization compiled elsewhere whose code arrives built: a GPU
        replica's kernels loaded from an artifact's stored binaries
        (dynvm.cluster.fleet._gpu), so nothing is specialized, generated or compiled here.
        The caller has checked that `portable` is the record `key` was built from.
        Returns None when the region is not watched here or `key` is installed."""
        region_jit = self.regions.get(portable.region)
        if region_jit is None:
            return None
        if any(s.artifact.key == key for s in region_jit.installed()):
            return None
        code = BuiltCode(backend, kernel_name, source, fn, tuple(notes), metadata)
        spec = self._finish_build(key, code, ir=portable.ir, strength=portable.strength,
                                  signature=portable.signature, family=portable.family,
                                  start=time.perf_counter() - load_seconds)
        region_jit.install(spec, None)
        with self._lock:
            self.counters.installs += 1
            self.counters.install_seconds += load_seconds
        return spec

    def _finished(self, region_jit: RegionJit, pending, future, parent=None,
                  listeners: bool = True) -> None:
        """`pending`: the key the region marked pending (a signature or family key);
        `listeners`: False for a local re-plan (Note [Probation]), which no fleet needs."""
        if future.cancelled():
            region_jit.forget_pending(pending)
            return
        error = future.exception()
        if error is None:
            region_jit.install(future.result(), pending)
            if parent is not None and self.tracing is not None:
                self.tracing.install_span(region_jit.region.index, future.result(), parent)
            if listeners and self._compile_listeners:
                # Listeners (the compile service's publish) run in the promotion's trace.
                token = otel_context.attach(parent) if parent is not None else None
                try:
                    for listener in self._compile_listeners:
                        try:
                            listener(region_jit, future.result())
                        except Exception as exc:  # a listener never undoes the install
                            self._log(f"compile listener failed: {type(exc).__name__}: "
                                      f"{exc}")
                finally:
                    if token is not None:
                        otel_context.detach(token)
            return
        with self._lock:
            self.counters.compile_failures += 1
        region_jit.compile_failed(pending)
        self._account_failure(region_jit, error)

    def _account_failure(self, region_jit: RegionJit, error: BaseException) -> None:
        """Note [Failure accounting]."""
        region = region_jit.region.index
        if isinstance(error, InputRejected):
            with self._lock:
                self.counters.specialize_rejections += 1
            return
        if isinstance(error, CompileTimeout):
            self._log(f"compile of region {region} failed: {type(error).__name__}: {error}")
            return
        reason = failure_reason(error)
        with self._lock:
            failures = self.counters.specialize_failures
            failures[reason] = failures.get(reason, 0) + 1
            first = (region, reason) not in self._failures_logged
            self._failures_logged.add((region, reason))
        if first:
            self._log(f"region {region}: specialization failed (a dynvm bug, reported "
                      f"once per region and reason): {reason}")

    # -- diagnostics -------------------------------------------------------------------

    def on_guard_failure(self, region_jit: RegionJit, explanation: str | None) -> None:
        if explanation:
            self._log(f"region {region_jit.region.index} guard failed: {explanation}")
            if self.tracing is not None:
                self.tracing.event("dynvm.guard_failure", {
                    "dynvm.region": region_jit.region.index,
                    "dynvm.first_failing_check": explanation,
                    "dynvm.sample_rate": self.config.guard_failure_sample_rate})

    def on_probation(self, region_jit: RegionJit, spec: Specialization, verdict: str,
                     key=None) -> None:
        """A probation verdict (Note [Probation]); for a demotion, re-plan `spec` without
        the arena (in the background) and install it under `key` (its promoted key)."""
        counters = self.probation_counters
        with self._lock:
            if verdict == CONFIRMED:
                counters.confirmed += 1
            elif verdict == DEMOTE:
                counters.demotions += 1
            else:
                counters.drops += 1
        what = {CONFIRMED: "kept", DEMOTE: "demoted: re-planned without the arena",
                }.get(verdict, "dropped: the interpreter runs its calls, the key backs off")
        self._log(f"region {region_jit.region.index} {spec.artifact.kernel_name}: "
                  f"{spec.ratio:.3f}x the interpreter on its calls, {what}")
        if self.tracing is not None:
            self.tracing.event("dynvm.probation", {
                "dynvm.region": region_jit.region.index,
                "dynvm.kernel": spec.artifact.kernel_name,
                "dynvm.verdict": verdict, "dynvm.ratio": spec.ratio})
        if verdict == CONFIRMED:
            return
        self.on_evict(region_jit, spec)  # it left the region's tables: free its arena
        if verdict != DEMOTE:
            return
        options = dataclasses.replace(self._cpu_options, arena_pool=None)
        target = spec.family if spec.family is not None else spec.signature
        plain_key = self.key_for(region_jit, target, options.as_key())

        def replan() -> Specialization:
            return self._build(spec.ir, spec.strength, spec.signature, spec.family,
                               plain_key, time.perf_counter(), options)

        future = self.queue.submit(plain_key, 1.0, replan)
        future.add_done_callback(lambda f: self._finished(region_jit, key, f, None,
                                                          listeners=False))

    def on_evict(self, region_jit: RegionJit, spec: Specialization) -> None:
        """A specialization left its region's cache (LRU): release its arenas."""
        if self.arena_pool is not None:
            self.arena_pool.drop(spec.artifact.key)

    def on_deopt(self, region_jit: RegionJit, spec: Specialization, error: Exception) -> None:
        self._log(f"region {region_jit.region.index} deopt from {spec.artifact.kernel_name}: "
                  f"{type(error).__name__}: {error}")
        if self.tracing is not None:
            self.tracing.event("dynvm.deopt", {
                "dynvm.region": region_jit.region.index,
                "dynvm.kernel": spec.artifact.kernel_name,
                "dynvm.error": f"{type(error).__name__}: {error}"})

    def _log(self, line: str) -> None:
        log = self.event_log
        log.append(line)
        if len(log) > 100:
            del log[:50]

    def stats(self) -> dict:
        """The JIT's counters, totals and per-region figures (jit.engine_stats)."""
        return jit_stats(self)
