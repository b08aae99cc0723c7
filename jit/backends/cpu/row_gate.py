"""oneDNN's linear in a family kernel only on row counts where it pays: by measurement.

Note [oneDNN at a new row count]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
oneDNN builds a primitive for every input shape it meets and caches it (LRU, 1024 per
process by default). The first `mkldnn._linear_pointwise` call at a row count M it has
not run before pays that build; later calls at the same M do not. Measured on this
project's 2-core AVX-512 host, one thread, packed weight, 24 calls each (load 8):
N=64 K=64 at M=512, 0.58 ms at a new M against 0.058 ms at a repeated one (torch's
F.linear 0.066 ms); the build costs 0.4-0.5 ms at M=64 and M=512 for N, K in 64..256,
more where the GEMM is larger (M=512 N=1024 K=256: 1.4 ms, while oneDNN saves 2.4 ms per
call over torch there). The batch hint the weight was packed for changed nothing
measurable (hints 1, 512, 4096); an unpacked weight costs more, not less.

A calibration that times each form at one repeated M sees only the warm cost, so it said
yes to oneDNN on gnn's message linears (M=512: 0.037 vs 0.053 ms). gnn's family kernel
then met a new edge count on almost every call, paid a build per fused linear per call,
and measured 2.3-5x the interpreter until probation dropped it (the same kernel with
`cpu_fusion="off"`: 0.92x). A Transformer family (jitter: 64 batch sizes, each recurring)
meets the same few M again and again and keeps its gains.

So, for a GEMM whose M varies across the family's probes, the calibration (`_decide`
in fusion) asks per size class of M, at the smallest M of every class the family
covers (up to the cap): torch's pair against oneDNN at a repeated M (the question an
exact specialization asks too), and, only where oneDNN wins, oneDNN against itself at a
new M on every call (its build). Per class, the verdict is:

- torch (`None`): oneDNN at a repeated M does not beat torch by the calibrator's margin,
  or it wins so little that paying the build back would take more than
  `MAX_SIGHTINGS` calls at one M;
- `0`: oneDNN wins, or loses by less than the margin, even when it builds a primitive
  on every call;
- `r` > 0: the build pays back after `r` calls at the same M (ski rental: run torch's
  pair on the first `r` sightings of an M, then oneDNN; no worse than twice the best
  choice made in hindsight, whatever the traffic).

A size class that was not measured (below the family's lowest M) runs torch. Above the
calibration's cap (`_CALIBRATION_MAX_M`) the top measured class answers: the build's
cost is fixed while the GEMM's saving grows with M. If every class says 0 the kernel
calls oneDNN directly, as before; if every class says torch the GEMM stays on torch;
otherwise the kernel calls a `RowGate` (the generated code's callee), which counts
sightings per M and picks the form per call: its check measured 0.33 us, the whole gate
0.4-1.7 us over the plain torch pair at M=32 (load 10-14, too noisy to say closer); at
gnn's GEMMs (20-50 us each) that is 1-3%. A gate belongs to one fused
op of one kernel and lives as long as the kernel: its counts start over with a new
kernel, which costs at most `r` torch calls per M.

What it costs where M recurs: the calibration runs on the compile thread beside request
traffic, where the new-M samples are noisy (QKV at M=512: 1.5 ms alone, 7-57 ms beside
requests at load 8-10, before the views were sliced outside the timed call), so some
GEMMs that oneDNN wins at a new M get gated after 1-14 calls. jitter (64 batch sizes,
each seen about 4 times in 240 calls), in one process, interleaved, against the code
before this note: JIT 1.006x (load 0-4; 1.060x at load 8-10 with the three-form
question this replaced), 0.50x the interpreter. gnn's family kernels against the
interpreter (300 fresh calls, load 0-3): 3.09x with oneDNN forced, 1.04x measured,
1.01x with fusion off, where probation had measured 2.3-5x.
"""

from __future__ import annotations

import math

from dynvm.jit.calibration import Choice, size_class

TORCH, ONEDNN, ONEDNN_NEW_ROWS = "torch", "onednn", "onednn new rows"
# A oneDNN lead that needs more calls at one M than this to pay back its primitive build
# is not worth a gate: the JIT's promotion window is 64 calls, and so small a lead is
# within the noise of the calibration itself.
MAX_SIGHTINGS = 64


def sightings_before_onednn(choice: Choice, margin: float) -> int | None:
    """Note [oneDNN at a new row count]: calls at one M to run on torch before oneDNN
    pays (0: oneDNN at once), or None (torch always), from a three-form calibration.

    Whether oneDNN wins at all is the calibrator's rule (medians, the margin). The build
    is a difference of two forms, and the host's noise only ever adds time: the new-M
    form, whose call builds a primitive on the compile thread while requests hold the
    GIL, spread 1-45 ms where the warm call took 1 ms (M=512, load 20). So the build
    and the saving it must pay back come from each form's fastest sample."""
    t, warm = choice.seconds[TORCH], choice.seconds[ONEDNN]
    if warm >= t * (1.0 - margin):
        return None
    if ONEDNN_NEW_ROWS not in choice.seconds:
        return 0
    fastest = choice.fastest or choice.seconds
    t, warm, fresh = fastest[TORCH], fastest[ONEDNN], fastest[ONEDNN_NEW_ROWS]
    # The margin applies to the build too: oneDNN stays where its build is within noise.
    if fresh <= t * (1.0 + margin):
        return 0
    if warm >= t:
        return None
    calls = math.ceil((fresh - t) / (t - warm))
    return calls if calls <= MAX_SIGHTINGS else None


class RowGate:
    """One fused linear's choice per call (Note [oneDNN at a new row count]): oneDNN
    (`fused`) for an M once it has been seen as often as its size class asks, else
    torch's pair (`fallback(x)`, or `fallback(x, other)` for a binary post-op).

    `after[c]` is the verdict of size class c (None: torch); a class above the table
    uses its last entry. Counts are per M; races between threads only miscount. The
    subclasses spell out the fused call's operands: no argument tuples on the way."""

    __slots__ = ("after", "_by_bits", "seen", "fused", "fallback")

    def __init__(self, after: tuple, fused, fallback) -> None:
        self.after = after
        # indexed by M's bit_length (size class + 1; M=0 reads class 0)
        self._by_bits = (after[0], *after)
        self.seen: dict[int, int] = {}
        self.fused = fused
        self.fallback = fallback

    def onednn_now(self, x) -> bool:
        """Whether this call, on activation `x`, runs oneDNN (counting the sighting)."""
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        table = self._by_bits
        bits = m.bit_length()
        after = table[bits] if bits < len(table) else table[-1]
        if after is None:
            return False
        seen = self.seen.get(m, 0)
        if seen >= after:
            return True
        self.seen[m] = seen + 1
        return False

    def uses_onednn(self, m: int) -> bool:
        """Whether the next call at `m` rows runs oneDNN (tests, diagnostics)."""
        after = self.after[min(size_class(m), len(self.after) - 1)]
        return after is not None and self.seen.get(m, 0) >= after


class UnaryRowGate(RowGate):
    """A gate in front of `mkldnn._linear_pointwise` (unary post-op or none)."""

    __slots__ = ()

    def __call__(self, x, packed, bias, attr, scalars, algorithm):
        if self.onednn_now(x):
            return self.fused(x, packed, bias, attr, scalars, algorithm)
        return self.fallback(x)


class BinaryRowGate(RowGate):
    """A gate in front of `mkldnn._linear_pointwise.binary`."""

    __slots__ = ()

    def __call__(self, x, other, packed, bias, attr):
        if self.onednn_now(x):
            return self.fused(x, other, packed, bias, attr)
        return self.fallback(x, other)
