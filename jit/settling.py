"""Whether a region's JIT is settled (`Jit.settled`): nothing it would still promote
is on its way. Read-only over a region's tables, under the region's lock.

Note [Settled]
~~~~~~~~~~~~~~
`Jit.settled` is what a seasoning loop waits for before it times anything (bench.zoo,
bench.full_width, the profiles): no compile queued or running, nothing on probation, every
region with nothing installed past its first cold check (Note [Cold regions]). That
said nothing of signatures still recurring toward a promotion: with the two-sample
probation rule (3609690, reverted) BERT-base width's bf16 seasoning ended settled after 3
rounds while 8 of its 16 shapes had recurred fewer than K times, and those shapes ran
the interpreter in the timed calls (jit-bf16 / OpenVINO bf16 2.1-4.0 there, 2026-12-05
23:49 UTC). So a region is not settled while, in its watched, attached slot
(in a cold period or detached a region profiles nothing, so promotes nothing; a
sampled one, Note [Sampled watching], profiles a sample of its misses: its window is in
profiled calls),

- a signature or family the policy would promote from the interpreter is short of it:
  recurring (seen twice in the window), not installed, pending or served by a kernel,
  its benefit at K recurrences over the policy's horizon (Note [Promotion]) beats its
  kind's compile cost, and at its rate so far it reaches K within the window: seen r
  times in the window, over the s profiled calls since its first (at most W), r x W / s
  >= K. A key seen since before the window holds its steady rate there (s = W), so a
  key short of K then stays short, and a shape storm (every signature seen once, gnn; a
  bucket of the loop body a fraction of the window) never holds a region back. A key
  backing off after its first drop or failed compile (Note [One noisy verdict] in
  jit.savings: the retry) counts the same way until its back-off ends; after a second,
  its back-off doubles and it does not count;
- a family member whose exact kernel would pay now (benefit over compile cost, as its
  tier-2 check weighs it: Note [Tier-2 checks] in jit.tiering) has hit its family
  kernel within the region's last W kernel hits: its next check promotes it.

The window moves only with profiled misses: where every call has hit a kernel for the
last W x `sample_every` region calls, what it holds is old (a family key whose family
has since grown under another key, say, recurs there for good), so the first rule
then holds nothing back. Without this, llama's zoo seasoning (100% specialized) ran to
its cap once (2026-12-06 02:14 UTC; what it held was not recorded).

Nor does a region wait for the verdict of a kernel on probation that its calls no
longer reach (not hit within the region's last W kernel hits): its samples come only
with its hits. In the zoo (2026-12-06 02:44 UTC) albert's and llama's seasonings ran
to their cap, 2,048 calls, with nothing short of a promotion but a fifth kernel (of
four shapes) on probation, its verdict never due; efficientnet's did before this
change (02:13 and 02:43).

Nothing here waits for the horizon's growth (Note [Rent or buy]): a key that pays
only later is bench.zoo's SEASON_CALLS business. A region called no more keeps what
it had; every seasoning loop also has a cap of rounds or seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynvm.jit.guards import weak_of
from dynvm.jit.policy import EXACT, FAMILY, benefit_seconds
from dynvm.jit.region_jit import _MANY
from dynvm.jit.tiering import exact_benefit

if TYPE_CHECKING:
    from dynvm.jit.region_jit import RegionJit

RECURRING = 2   # seen this often in the window: a key that recurs (Note [Settled])


def awaiting_verdict(region_jit: RegionJit, installed) -> bool:
    """Whether a specialization of `installed` is on probation and still hit: hit within
    the region's last W kernel hits (Note [Settled]); one its region no longer sends calls
    to (a family whose shapes all have exact kernels now) would wait for ever."""
    window, clock = region_jit.engine.config.window, region_jit._clock
    return any(spec.probation is not None and clock - spec.last_used <= window
               for spec in installed)


def short_of_promotion(region_jit: RegionJit) -> bool:
    """Whether a key of `region_jit` is on its way to a promotion (Note [Settled]):
    the region is not settled."""
    watch = region_jit.watch
    if (watch.cold and watch.judged_cold) or not region_jit.compiles_locally():
        return False
    with region_jit._lock:
        return _recurring_key(region_jit) or _tier_check_ahead(region_jit)


def _recurring_key(region_jit: RegionJit) -> bool:
    config, watch = region_jit.engine.config, region_jit.watch
    if region_jit.region_calls() - watch.profiled_at > config.window * watch.sample_every:
        return False   # no miss profiled lately: the window holds nothing current
    inputs = region_jit.refresh_policy_inputs()
    k, age = region_jit.threshold, region_jit.age()
    for profile, kind in ((region_jit.profile, EXACT), (region_jit.family_profile, FAMILY)):
        for key, stats in list(profile.table.items()):
            seen = profile.recurrence(key)
            span = min(profile.window, profile.calls - stats.first_seen)
            if seen < RECURRING or seen * profile.window < k * span:
                continue
            if key in region_jit.pending or _served(region_jit, key, kind):
                continue
            failed = region_jit.counters.failed.get(key)
            if failed is not None and region_jit.region_calls() < failed[0] \
                    and failed[1] > 1:
                continue   # backing off after a second failure: not soon
            benefit = benefit_seconds(config, max(k, seen), stats.mean_seconds,
                                      inputs.speedup(kind), age)
            if benefit > inputs.cost(kind):
                return True
    return False


def _served(region_jit: RegionJit, key, kind: str) -> bool:
    """Whether `key` (a signature, or a family's key) has a kernel now, or is not what
    the policy promotes (a signature whose family has several members: the family is)."""
    if kind == FAMILY:   # a family of one member is promoted as that signature
        return region_jit._members.get(key) is not _MANY or \
            region_jit._clipped.get(key, key) in region_jit.family_kernels
    if key in region_jit.strong or (region_jit.weak and weak_of(key) in region_jit.weak):
        return True
    if any(spec.family.contains(key) for spec in region_jit.family_kernels.values()):
        return True
    if region_jit.engine.config.families:
        family = region_jit.families.family_of(key)
        member = None if family is None else region_jit._members.get(family.key)
        return member is _MANY or (member is not None and member != key)
    return False


def _tier_check_ahead(region_jit: RegionJit) -> bool:
    window = region_jit.engine.config.window
    clock = region_jit._clock
    kernels = list(region_jit.family_kernels.values())
    for signature, (hits, last) in list(region_jit._family_hits.items()):
        if clock - last > window or signature in region_jit.pending \
                or signature in region_jit.strong or region_jit._backing_off(signature):
            continue
        spec = next((s for s in kernels if s.family.contains(signature)), None)
        if spec is None:
            continue
        benefit, cost = exact_benefit(region_jit, hits, spec)
        if benefit > cost:
            return True
    return False


def best_waiting(region_jit: RegionJit) -> dict | None:
    """The key of `region_jit` that the policy (Note [Promotion]) is nearest to promoting
    and has not: recurring in the window (seen twice), neither installed, pending nor
    served by a kernel; its figures as the policy weighs them now, or None when there is
    none. What `dynvm bench zoo` states for a model whose calls run interpreted (a
    benchmark's window may end before a key pays for its compile: Note [Rent or buy])."""
    config = region_jit.engine.config
    with region_jit._lock:
        inputs = region_jit.refresh_policy_inputs()
        k, age = region_jit.threshold, region_jit.age()
        best = None
        for profile, kind in ((region_jit.profile, EXACT), (region_jit.family_profile, FAMILY)):
            for key, stats in list(profile.table.items()):
                seen = profile.recurrence(key)
                if seen < RECURRING or key in region_jit.pending \
                        or _served(region_jit, key, kind):
                    continue
                speedup, cost = inputs.speedup(kind), inputs.cost(kind)
                benefit = benefit_seconds(config, seen, stats.mean_seconds, speedup, age)
                if best is None or benefit / cost > best["benefit_seconds"] / best["cost_seconds"]:
                    per_call = seen / profile.window * stats.mean_seconds * speedup
                    best = {"kind": kind, "seen": seen, "window": profile.window,
                            "threshold": k, "mean_seconds": stats.mean_seconds,
                            "speedup": speedup, "benefit_seconds": benefit,
                            "cost_seconds": cost, "age": age,
                            # the region's calls at which the benefit reaches the cost
                            "pays_at_calls": int(cost / per_call) + 1 if per_call > 0 else None}
    return best
