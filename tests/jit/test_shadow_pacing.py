"""Note [Shadow samples beside calls] (dynvm.jit.shadow): after a shadow sample that met
a call, the process's next sample waits for SHADOW_SPACING calls, a due sample is
deferred at most MAX_DEFERRED hits, a kernel slow on every sample is still dropped, and
a sample that meets no call defers nothing."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import dynvm
from dynvm.jit import shadow
from dynvm.jit.background import serving_call, worker_task
from dynvm.jit.config import JitConfig
from dynvm.jit.guards import GuardStrength
from dynvm.jit.probation import EARLY_LOSS, EARLY_SAMPLES, MAX_DEFERRED, Probation
from dynvm.jit.region_slot import Specialization
from dynvm.jit.shadow import SHADOW_SPACING, ShadowPacing, shadow_pacing
from tests.jit import _jit_helpers as h
from tests.jit.test_families_arenas import (
    family_config,
    one_thread,  # noqa: F401 — the autouse fixture of that module, here too
    small,  # noqa: F401 — the module-scoped program fixture
    x_of,
)

PROGRAM = """
   0  %1 = RELU %0
   1  %2 = TANH %1
   2  RETURN {%2}
"""


@pytest.fixture(autouse=True)
def unspaced():
    """The process's pacing as a fresh process has it: an earlier test's colliding
    sample must not space this one's. A sample still running on a closed Runtime's
    worker (an earlier test's, on a loaded host) ends first: it would space this test's
    samples after the reset (one such failed a two-worker rehearsal)."""
    _workers_idle()
    shadow_pacing().next_at = 0
    yield
    _workers_idle()
    shadow_pacing().next_at = 0   # nor this one's the next test's


def _workers_idle(timeout_s: float = 30.0) -> None:
    """Wait until no compile worker of the process runs a task (at most `timeout_s`:
    the tests' own figures then say what a stray task did)."""
    deadline = time.monotonic() + timeout_s
    while worker_task().running and time.monotonic() < deadline:
        time.sleep(0.005)


def _never() -> bool:
    return False


def test_unspaced_a_due_sample_waits_at_most_max_deferred_hits():
    probation = Probation(every=4, samples=12, margin=0.05)
    dues = [probation.due(_never) for _ in range(1 + 2 * (MAX_DEFERRED + 1))]
    deferred = [False] * MAX_DEFERRED
    assert dues == [False, *deferred, True, *deferred, True]
    # Spaced, the early samples come from consecutive hits, as before.
    spaced = Probation(every=4, samples=12, margin=0.05)
    assert [spaced.due(lambda: True) for _ in range(4)] == [False, True, True, True]
    default = Probation(every=4, samples=12, margin=0.05)
    assert [default.due() for _ in range(4)] == [False, True, True, True]


def test_a_loser_is_decided_within_the_notes_bound_however_crowded():
    """The bound the Note states: a kernel at EARLY_LOSS or above on every sample has its
    verdict by hit 1 + EARLY_SAMPLES x (MAX_DEFERRED + 1) with every sample deferred."""
    probation = Probation(every=4, samples=12, margin=0.05)
    hits, ratio = 0, None
    while ratio is None:
        hits += 1
        assert hits <= 1000
        if probation.due(_never):
            ratio = probation.add(2.0 * EARLY_LOSS, 1.0)
    assert hits == 1 + EARLY_SAMPLES * (MAX_DEFERRED + 1) == 33
    assert not probation.passes(ratio)


def test_a_colliding_sample_spaces_the_next_by_calls_begun():
    pacing = ShadowPacing()
    assert pacing.spaced()
    pacing.sampled(collided=False)
    assert pacing.spaced() and pacing.collisions == 0
    pacing.sampled(collided=True)
    assert not pacing.spaced() and pacing.collisions == 1
    for _ in range(SHADOW_SPACING - 1):
        with serving_call():
            pass
    assert not pacing.spaced()
    with serving_call():
        pass
    assert pacing.spaced()


def _runtime_with_kernel(kernel_seconds: float):
    """A real Runtime (background compile worker, probation on) with a hand-installed
    kernel that computes the region and sleeps `kernel_seconds` on every call."""
    program = h.build(PROGRAM, regs=3, inputs=('"x" float32 [n:1..64]',))
    config = JitConfig(families=False, compile_seconds_base=1e9,
                       failed_compile_backoff_calls=10**6)
    rt = dynvm.Runtime(program, jit=config)
    region_jit = rt.jit.regions[0]
    (out,) = [r.index for r in program.regions[0].live_out]

    def kernel(regs):
        time.sleep(kernel_seconds)
        regs[out] = torch.tanh(torch.relu(regs[0]))

    x = torch.randn(8)
    regs = [None] * program.n_regs
    regs[0] = x
    spec = Specialization(signature=region_jit._sign(regs), strength=GuardStrength.STRONG,
                          fn=kernel, artifact=types.SimpleNamespace(kernel_name="k", key="k"))
    region_jit.install(spec)
    return rt, region_jit, spec, x


def _dropped(region_jit, spec) -> bool:
    return spec.probation is None and spec not in region_jit.strong.values()


def test_a_slow_kernel_is_still_dropped_while_calls_crowd_its_samples():
    """Back-to-back calls from another thread keep a call in flight or beginning through
    every sample: the samples collide and are spaced, and the kernel (far slower than
    the interpreter on every call) is still dropped, its calls back in the interpreter."""
    pacing = shadow_pacing()
    collisions = pacing.collisions
    rt, region_jit, spec, x = _runtime_with_kernel(0.004)
    stop = threading.Event()

    def crowd():   # another Runtime's calls count in flight too (they share the cores)
        with dynvm.Runtime(rt.program, jit=False) as other:
            while not stop.is_set():
                other(x)

    crowding = threading.Thread(target=crowd, daemon=True)
    crowding.start()
    try:
        deadline = time.monotonic() + 60
        while not _dropped(region_jit, spec) and time.monotonic() < deadline:
            torch.testing.assert_close(rt(x), torch.tanh(torch.relu(x)))
        assert _dropped(region_jit, spec), (spec.calls, spec.probation)
        assert rt.stats()["probation"]["drops"] == 1
        assert pacing.collisions > collisions
        assert spec.ratio is not None and spec.ratio >= EARLY_LOSS
    finally:
        stop.set()
        crowding.join(10)
        rt.close()


def _wait_samples(rt, n: int) -> None:
    """Wait until `n` shadow samples have ended (each records its collision first)."""
    deadline = time.monotonic() + 30
    while rt.stats()["probation"]["shadow_calls"] < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rt.stats()["probation"]["shadow_calls"] >= n


def test_samples_that_meet_no_call_defer_nothing():
    """Each call waits for the worker to end its sample before the next begins (as the
    zoo drains): no sample collides, the early samples come from consecutive hits."""
    pacing = shadow_pacing()
    collisions = pacing.collisions
    rt, region_jit, spec, x = _runtime_with_kernel(0.0)
    try:
        for hit in range(1 + EARLY_SAMPLES):
            rt(x)
            _wait_samples(rt, hit)   # the first hit warms up: no sample
        assert pacing.collisions == collisions
        assert rt.stats()["probation"]["shadow_calls"] == EARLY_SAMPLES
    finally:
        rt.close()


def test_the_module_is_what_region_jit_uses():
    """One pacing per process, read by every region's hits."""
    rt, region_jit, _, _ = _runtime_with_kernel(0.0)
    try:
        assert region_jit._shadow_spaced.__self__ is shadow.shadow_pacing()
    finally:
        rt.close()


def test_a_family_kernels_early_samples_are_never_deferred():
    """The region's next family waits for them (Note [Probation]: the family bet);
    its later samples are spaced like any."""
    probation = Probation(every=4, samples=12, margin=0.05, early_unspaced=True)
    dues = [probation.due(_never) for _ in range(1 + EARLY_SAMPLES)]
    assert dues == [False, True, True, True, True]
    for _ in range(EARLY_SAMPLES):
        probation.add(0.9, 1.0)
    later = [probation.due(_never) for _ in range(1 + MAX_DEFERRED)]
    assert later == [False] * MAX_DEFERRED + [True]


def test_a_family_kernel_installed_is_on_unspaced_early_samples(small):  # noqa: F811
    _, program, _ = small
    config = family_config(probation=True, probation_shadow_every=4)
    runtime = dynvm.Runtime(program, jit=config)
    try:
        for b in (20, 30, 40):
            runtime(x_of(b))
        (region_jit,) = runtime.jit.regions.values()
        for spec in region_jit.installed():
            assert spec.probation is None or \
                spec.probation.early_unspaced == (spec.family is not None)
        assert any(spec.family is not None for spec in region_jit.installed())
    finally:
        runtime.close()
