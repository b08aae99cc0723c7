"""`JitConfig`: every knob of the JIT tier, in one frozen dataclass.

Defaults follow the design article's measured experience (Note [Promotion] in
dynvm.jit.policy): promote a shape only after it recurs within a window, adapt the
recurrence threshold to region size, keep at most 16 specializations per region, compile
on one background thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvm.vm.errors import ConfigError

BACKENDS = ("auto", "cpu", "triton")
PRECISIONS = ("fp32", "bf16", "int8-dynamic")   # Note [Lower-precision GEMMs]


@dataclass(frozen=True)
class JitConfig:
    """The JIT's knobs (promotion, families, arena, compile threads and deadline,
    backend), one documented field each; `Runtime(program, jit=JitConfig(...))`."""

    min_recurrence: int = 2
    """K for the smallest regions: a signature must be seen this many times within the
    window before it may be promoted."""

    max_recurrence: int = 8
    """K for the largest regions (K grows with region size: compiling them costs more,
    so they must prove their shape is stable for longer)."""

    instructions_per_recurrence_step: int = 24
    """K rises by one from `min_recurrence` per this many instructions in the region."""

    window: int = 64
    """W: the sliding window, in calls of the region, in which recurrences are counted."""

    expected_speedup: float = 0.3
    """Fraction of a region's interpreted time a specialization is expected to save
    before any of its kind has been measured; replaced by the measured saving of its kind
    (exact or family, Note [Promotion by kind]) once one has run. 0.3 is what kernels
    save where they are measured: the zoo's 72 kernels at one thread 0.29 on average,
    the 23 transformers' first kernels 0.25 (quartiles 0.19-0.30; 2-core AMD EPYC Zen 5,
    2026-12-06). At 0.15, with the sample unbiased (Note [Sampling a rotation]), 20 of
    the 23 paid only at ~1,300-2,100 calls and ran interpreted through `dynvm bench
    zoo`'s 1,024 seasoning calls; at 0.3 all 23 were fully specialized there."""

    horizon_calls: int = 1000
    """Calls over which a specialization must pay back its compile: the benefit is the
    expected saving per call x the signature's frequency in the window x the horizon,
    which is this or the region's calls so far, whichever is more (Note [Rent or buy]
    in dynvm.jit.policy): a young region needs a compile to pay within this many calls,
    an old one within as many calls as it has run."""

    compile_seconds_base: float = 0.002
    """Estimated compile cost of a region of no instructions (seconds)."""

    compile_seconds_per_instruction: float = 0.0003
    """Estimated compile cost per instruction, before any compile has been measured."""

    max_specializations_per_region: int = 16
    """Per-region LRU capacity; the least recently used specialization is evicted."""

    compile_threads: int = 1
    """Background compile threads (more than 2 rarely helps: compiles hold the GIL)."""

    max_queue_length: int = 32
    """Beyond this many waiting tasks, the lowest-benefit ones are dropped."""

    sync: bool = False
    """Compile on the calling thread as soon as a signature is promoted (tests and
    debugging only: a call then waits for its compile)."""

    guard_failure_sample_rate: int = 64
    """Explain (compute the first failing check of) one guard failure in this many; the
    rest are only counted, so a shape storm costs no diagnostics work."""

    failed_compile_backoff_calls: int = 256
    """After a compile fails, the signature is not retried for this many region calls
    (doubling on each further failure)."""

    families: bool = True
    """Group signatures into code families served by one kernel (Note [Tiering]); off:
    every promoted signature gets an exact specialization."""

    bucket_ratio: int = 4
    """Geometric bucket ratio of family dims (Note [Geometric buckets])."""

    exact_over_family_gain: float = 0.08
    """Fraction of a family kernel's time an exact specialization of one of its members
    is expected to save (all shapes folded, arena planned for its exact sizes): the tier-2
    benefit factor."""

    arena_budget_bytes: int = 1 << 30
    """Per-device budget of the arenas that specializations plan their intermediates in
    (Note [Arena layout]); past it, a call runs without an arena. 0 turns arenas off."""

    arena_ops: str = "measured"
    """Which results go to the arena: "measured" (an op's out= form only where it
    measures faster on this device, Note [Arena by measurement] in
    dynvm.jit.backends.cpu.arena_choice) or "all" (wherever an out= form applies)."""

    cpu_fusion: str = "measured"
    """CPU backend: GEMM and convolution chains with their epilogues as one oneDNN call
    (Note [CPU fusion] in dynvm.jit.backends.cpu.fusion): "measured" where that measures
    faster on this device, "always" wherever it applies (debugging), "dense" without a
    packed copy of any weight (dynvm's small-M kernel and torch only: Note [Dense weights
    only]), "off" never."""

    cpu_channels_last: str = "measured"
    """CPU backend: chains of convolutions run channels-last, converted once into the
    chain and back where a value leaves it (Note [Channels-last chains] in
    dynvm.jit.backends.cpu.channels_last): "measured" where the region measures faster so on
    this device, "always" wherever a chain has a convolution (debugging), "off" never."""

    cpu_column_halves: str = "measured"
    """CPU backend: linears of exact kernels at a few rows also as column pieces shared
    with a helper thread of dynvm's own, run or not as each kernel's calls measure (Note
    [Column halves where the team's wake is the cost] in
    dynvm.jit.backends.cpu.column_halves): "measured", or "off" (the OpenMP team alone;
    no pieces' copies of those weights and no pieces' buffers: a Generator's runtimes,
    whose memory is stated to the byte, Note [Dense weights only])."""

    precision: str = "fp32"
    """CPU backend: the precision of GEMMs with a constant weight (linear, addmm, mm,
    matmul; Note [Lower-precision GEMMs] in dynvm.jit.backends.cpu.precision): "fp32";
    "bf16" (weights packed in bf16 once, activations cast at the GEMM's boundary, the
    result back to fp32 where a reader needs it; needs AVX512-BF16 or AMX); or
    "int8-dynamic" (weights int8 per channel, activations quantized per call, fp32 out).
    The interpreter, and so probation's reference, stays fp32; the Triton backend
    ignores it."""

    compile_timeout_s: float = 120.0
    """A compile running longer is abandoned and counts as failed (Note [Compile
    deadline] in dynvm.jit.queue); its region backs off as after any failure."""

    online_compile: bool = True
    """Compile promoted shapes in this process. False: never compile here; only install
    specializations compiled elsewhere (the cluster's compile service, `dynvm
    precompile`) and interpret the rest; `stats()["interpreted_region_calls"]` counts
    the region calls that missed."""

    backend: str = "auto"
    """Code generator of specializations: "cpu" (generated Python over torch ops, with
    an arena), "triton" (fused Triton kernels, dynvm.jit.backends.triton; on a CPU device
    they run in Triton's interpreter, which needs TRITON_INTERPRET=1 before triton is
    imported: for tests), or "auto": triton on CUDA devices, cpu otherwise. A region the
    Triton backend cannot handle is compiled by the CPU backend, with a note saying why."""

    probation: bool = True
    """Measure every installed specialization against the interpreter on its own calls
    and keep it only if it is faster (Note [Probation] in dynvm.jit.probation): else
    re-plan it without the arena, then drop it. Off: installed means kept."""

    probation_shadow_every: int = 4
    """While on probation, one hit in this many is a shadow call (the interpreter and
    the specialization both run the call, each timed)."""

    probation_samples: int = 12
    """Shadow calls before the verdict (the median of their paired ratios)."""

    probation_margin: float = 0.05
    """A specialization stays only if its measured time over the interpreter's is at
    most 1 - this: faster by more than the noise of a median of paired ratios. Measured
    (bench loop's body, the interpreter against itself, 12 paired ratios per median, 300
    medians, 2-core host at load 36): p5 0.970, p95 1.047; 9% of medians at <= 0.98 (the
    old margin let a kernel no faster than the interpreter stay that often), 2% at
    <= 0.95."""

    cuda_graphs_max_batch: int = 16
    """On a CUDA device, an exact specialization whose batch (first dim of its first
    tensor live-in) is at most this is captured into a CUDA graph where it is built and
    replayed per call (Note [CUDA graph outputs] in dynvm.jit.backends.triton.graphs).
    0 turns CUDA graphs off."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"JitConfig.backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}")
        positive = ("min_recurrence", "max_recurrence", "window", "horizon_calls",
                    "max_specializations_per_region", "compile_threads",
                    "max_queue_length", "instructions_per_recurrence_step",
                    "guard_failure_sample_rate", "failed_compile_backoff_calls",
                    "probation_shadow_every", "probation_samples")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"JitConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ConfigError(f"JitConfig.compile_timeout_s must be > 0, "
                             f"got {self.compile_timeout_s}")
        if self.arena_ops not in ("measured", "all"):
            raise ConfigError(f"JitConfig.arena_ops must be 'measured' or 'all', "
                             f"got {self.arena_ops!r}")
        if self.cpu_fusion not in ("measured", "always", "dense", "off"):
            raise ConfigError(f"JitConfig.cpu_fusion must be 'measured', 'always', 'dense' "
                              f"or 'off', got {self.cpu_fusion!r}")
        if self.cpu_channels_last not in ("measured", "always", "off"):
            raise ConfigError(f"JitConfig.cpu_channels_last must be 'measured', 'always' or "
                             f"'off', got {self.cpu_channels_last!r}")
        if self.cpu_column_halves not in ("measured", "off"):
            raise ConfigError(f"JitConfig.cpu_column_halves must be 'measured' or 'off', "
                             f"got {self.cpu_column_halves!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"JitConfig.precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if not 0.0 <= self.probation_margin < 1.0:
            raise ConfigError(f"JitConfig.probation_margin must be in [0, 1), "
                             f"got {self.probation_margin}")
        if self.cuda_graphs_max_batch < 0:
            raise ConfigError(f"JitConfig.cuda_graphs_max_batch must be >= 0, "
                             f"got {self.cuda_graphs_max_batch}")
        if self.min_recurrence > self.max_recurrence:
            raise ConfigError("JitConfig.min_recurrence must not exceed max_recurrence")
        if self.max_recurrence > self.window:
            raise ConfigError("JitConfig.max_recurrence must not exceed window")

    def backend_for(self, device) -> str:
        """The backend this config selects on `device` ("auto" resolved)."""
        if self.backend != "auto":
            return self.backend
        return "triton" if getattr(device, "type", str(device).split(":")[0]) == "cuda" \
            else "cpu"
