"""Note [Settled] (dynvm.jit.settling): `Jit.settled` is false while a recurring shape of
a watched region is short of its promotion (or of its next tier-2 check) and would pay;
a shape seen once, or one that recurs too rarely to reach K within the window, never
holds it back."""

from __future__ import annotations

import dynvm
from tests.jit._jit_helpers import eager_config
from tests.jit.test_families_arenas import (
    family_config,
    one_thread,  # noqa: F401 — the autouse fixture of that module, here too
    region,
    small,  # noqa: F401 — the module-scoped program fixture
    strong_dims,
    warm_family,
    x_of,
)

K = 4


def _exact_config(window: int = 64):
    return eager_config(min_recurrence=K, max_recurrence=K, window=window)


def test_a_shape_short_of_k_is_not_settled(small):  # noqa: F811
    """Shape A has its kernel; shape B has recurred twice of the K it needs, and would
    pay: not settled (before, settled: nothing queued, pending or on probation, the
    region has a kernel). Once B is promoted, settled; a storm of shapes each seen once
    leaves it settled."""
    _, program, _ = small
    rt = dynvm.Runtime(program, jit=_exact_config())
    for _ in range(K + 1):
        rt(x_of(20))
    assert set(strong_dims(rt)) and rt.jit.settled()
    for _ in range(2):
        rt(x_of(30))
    assert not rt.jit.settled()
    for _ in range(K - 2):
        rt(x_of(30))
    assert len(strong_dims(rt)) == 2 and rt.jit.settled()
    for batch in range(41, 51):   # each seen once
        rt(x_of(batch))
        assert rt.jit.settled(), batch
    rt.close()


def test_a_shape_that_recurs_below_k_in_a_full_window_settles(small):  # noqa: F811
    """B comes once every 8 calls between new shapes: 2 in a window of 16, where K is 4.
    It never reaches K, so it must not keep the JIT unsettled for good."""
    _, program, _ = small
    rt = dynvm.Runtime(program, jit=_exact_config(window=16))
    fresh = iter([b for b in range(1, 65) if b not in (20, 30)])
    for _ in range(K + 1):
        rt(x_of(20))
    for _ in range(4):
        rt(x_of(30))
        for _ in range(7):
            rt(x_of(next(fresh)))
    rj = region(rt)
    (signature,) = [s for s in rj.profile.table if s[0][0].dims[0] == 30]
    assert rj.profile.recurrence(signature) == 2 and signature not in rj.strong
    assert rt.jit.settled()
    rt.close()


def test_a_family_member_short_of_its_tier_check_is_not_settled(small):  # noqa: F811
    """A member of an installed family has hit it once of the K hits its first tier-2
    check comes at, and its exact kernel would pay: not settled (before: settled, with
    the member on its family kernel); at its K-th hit it is promoted, and settled."""
    _, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1.0))
    warm_family(rt)
    assert rt.jit.settled()
    k = region(rt).threshold
    x = x_of(50, seed=50)
    for _ in range(k - 1):
        rt(x)
        assert not rt.jit.settled()
    rt(x)
    assert (50, *x.shape[1:]) in strong_dims(rt)
    assert rt.jit.settled()
    rt.close()
