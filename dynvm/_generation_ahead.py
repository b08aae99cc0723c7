"""Family kernels for the decode step's growing cache length, asked for ahead of need.

Note [Compiling the next length bucket]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A decode step's cache length L grows by one every call, so no exact shape recurs and
the JIT's recurrence rule (Note [Rent or buy] in dynvm.jit.policy) promotes a family
only after K of its members were interpreted, then compiles it in the background: on a
Llama-style decoder (768 wide, 4 layers) the first generation of 127 steps from L=32
ran 88 steps specialized, and the family of 65..160 was compiled once L had reached 65.
The growth is predictable, so the generator asks instead of waiting:

- as soon as the region's family index knows which dims vary (two decode steps of
  different L), the family of L's current bucket is promoted, K or not;
- as soon as that family's kernel is installed, or queued, the family of the next
  bucket (Note [Geometric buckets] in dynvm.shape_cluster.buckets) is promoted, with
  the same structure and every dim that lies in L's bucket moved to the next one, so
  it is ready before L gets there. The engine clips it to the program's declared range
  (Jit.clip_to_declared), so nothing past max_length is compiled.

Both go through the engine's own promotion (`Jit.promote`, the queue, the install, and
probation where it is on): the generator only picks the target. A batch whose size lies
in L's bucket is left to the ordinary rule (moving "every dim in L's bucket" would move
the batch too). This reads the region's family index and its last profiled signature
(RegionJit.families, .profile): an interface of the JIT's internals, kept to this file.
"""

from __future__ import annotations

from dynvm.jit.policy import EXACT, FAMILY, Decision
from dynvm.shape_cluster.buckets import bucket_of
from dynvm.shape_cluster.families import Family


class LengthBucketsAhead:
    """Promotes the decode program's family kernels for the growing length ahead of need
    (Note [Compiling the next length bucket]); `after_step(L, batch)` after each step."""

    def __init__(self, runtime) -> None:
        self.jit = runtime.jit
        self.requested = 0          # families promoted by this object
        self._last: tuple | None = None

    def after_step(self, length: int, batch: int) -> None:
        """Called with the cache length L the step just ran at and its batch size."""
        jit = self.jit
        if jit is None or not jit.config.families or not jit.compiles_locally():
            return
        ratio = jit.config.bucket_ratio
        bucket = bucket_of(length, ratio)
        if bucket_of(batch, ratio) == bucket:
            return
        for region_jit in list(jit.regions.values()):
            state = (region_jit.region.index, bucket, len(region_jit.pending),
                     len(region_jit.family_kernels))
            if state == self._last:
                continue
            family = self._current_family(region_jit)
            if family is None or not family.varying:
                continue   # not a family yet: asked again after the next step
            self._last = state
            self._promote(region_jit, family)
            ahead = _moved(family, bucket, bucket_of(bucket[1] + 1, ratio))
            if ahead is not None:
                self._promote(region_jit, ahead)

    def _current_family(self, region_jit) -> Family | None:
        with region_jit._lock:
            recent = region_jit.profile._recent
            if not recent:
                return None
            return region_jit.families.observe(recent[-1])

    def _promote(self, region_jit, family: Family) -> None:
        clipped = self.jit.clip_to_declared(region_jit, family)
        if any(low > high for dims in clipped.bounds if dims is not None
               for low, high in dims):
            return   # past the program's declared lengths: nothing to compile
        with region_jit._lock:
            if family.key in region_jit.pending or \
                    region_jit._clipped_key(family) in region_jit.family_kernels:
                return
            region_jit.pending.add(family.key)
            region_jit.counters.promotions += 1
        cost = self.jit.estimated_compile_seconds(len(region_jit.region), FAMILY)
        self.requested += 1
        # The benefit only orders the queue: ahead of need, the next bucket is certain.
        self.jit.promote(region_jit, family, Decision(True, 0, region_jit.threshold,
                                                      2 * cost, cost))


class StepAhead:
    """The decode step over the KV cache as state has no growing dim: its signature at a
    batch size recurs every step, so it is promoted exactly, at once, after its first
    call instead of after K of them (the rest of Note [Compiling the next length bucket]
    holds as is); `after_step()` after each step."""

    def __init__(self, runtime) -> None:
        self.jit = runtime.jit
        self.requested = 0
        self._seen: set[tuple] = set()

    def after_step(self) -> None:
        """Promote the last profiled signature of each region, once per signature."""
        jit = self.jit
        if jit is None or not jit.compiles_locally():
            return
        for region_jit in list(jit.regions.values()):
            with region_jit._lock:
                recent = region_jit.profile._recent
                if not recent or (region_jit.region.index, recent[-1]) in self._seen:
                    continue
                signature = recent[-1]
                self._seen.add((region_jit.region.index, signature))
                if signature in region_jit.pending or signature in region_jit.strong:
                    continue
                region_jit.pending.add(signature)
                region_jit.counters.promotions += 1
            cost = jit.estimated_compile_seconds(len(region_jit.region), EXACT)
            self.requested += 1
            jit.promote(region_jit, signature, Decision(True, 0, region_jit.threshold,
                                                        2 * cost, cost))


def _moved(family: Family, bucket: tuple[int, int], to: tuple[int, int]) -> Family | None:
    """`family` with every varying dim whose bounds are `bucket` moved to `to`; None when
    no dim moved."""
    bounds, moved = [], False
    for dims in family.bounds:
        if dims is None:
            bounds.append(None)
            continue
        row = []
        for low, high in dims:
            if low != high and (low, high) == bucket:
                row.append(to)
                moved = True
            else:
                row.append((low, high))
        bounds.append(tuple(row))
    return Family(family.structure, tuple(bounds)) if moved else None
