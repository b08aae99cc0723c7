"""Code families: signatures that one compiled kernel can serve.

Note [Code families]
~~~~~~~~~~~~~~~~~~~~
Signatures (see Note [Guard strength] in dynvm.jit.guards) that agree on everything
but a few dims form one *structure*: per tensor live-in the rank, dtype, device and
layout class, per scalar live-in its type and value. Within a structure, a dim *varies*
when two observed signatures differ in it. A family is a structure plus, per dim, bounds:
a varying dim gets the geometric bucket holding its value (Note [Geometric buckets]), a
static dim its one value. The family's kernel takes the varying dims as runtime
parameters and serves every signature of the structure whose dims lie in the bounds.

Only "contiguous" tensors join a family. A family kernel receives dims, not strides, and
derives each tensor's strides from its dims, which is right only for row-major tensors
that start at offset 0. Any other layout keeps the exact specialization its strong guard
asks for, so a view never reaches code that assumes contiguity.

Everything here is a pure function of its arguments; `dynvm.shape_cluster.index` keeps
the incremental, memoized form that the request path uses, and must agree with
`cluster` (a test checks it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dynvm.shape_cluster._keys import scalar_text, tensor_text
from dynvm.shape_cluster.buckets import bucket_of, check_ratio
from dynvm.shape_cluster.signature import entry_dims, is_tensor_entry

CONTIGUOUS = "contiguous"
STRIDED = "strided"

# Probes are abstract runs of the region; a handful covers a bucket (see probe_dims).
MAX_PROBES = 6

Signature = tuple
Bounds = tuple[tuple[int, int], ...]
TENSOR, SCALAR = "t", "s"   # the tags of a structure's parts


class TensorPart(NamedTuple):
    """A tensor live-in's part of a structure (Note [Code families]). The tag comes
    first, so that a part compares and hashes as the plain tuple it once was."""

    tag: str   # TENSOR
    rank: int
    dtype: torch.dtype
    device: torch.device
    layout: str   # layout_class: CONTIGUOUS or STRIDED


class ScalarPart(NamedTuple):
    """A scalar live-in's part of a structure: its type and value."""

    tag: str   # SCALAR
    type: type
    value: object


Part = TensorPart | ScalarPart


def layout_class(shape_dims: Sequence[int], strides: Sequence[int], offset: int) -> str:
    """"contiguous" when `strides` are the row-major strides of `shape_dims` and
    `offset` is 0, else "strided".

    Dims of size 1 are skipped: their index is always 0, so their stride is never used
    (torch calls such tensors contiguous too). Row-major strides count a dim of size 0
    as 1, as torch does (`torch.empty(2, 0, 3).stride() == (3, 3, 1)`).
    """
    if offset != 0 or len(shape_dims) != len(strides):
        return STRIDED
    expected = 1
    for dim, stride in zip(reversed(shape_dims), reversed(strides)):
        if dim != 1 and stride != expected:
            return STRIDED
        expected *= max(dim, 1)
    return CONTIGUOUS


def structure_key(signature: Signature) -> tuple:
    """What the signatures of one family share; see Note [Code families].

    Per tensor live-in a `TensorPart`, per scalar live-in a `ScalarPart`.
    """
    parts: list[Part] = []
    for entry in signature:
        if is_tensor_entry(entry):
            shape, dtype, strides, offset, device = entry
            parts.append(TensorPart(TENSOR, shape.rank, dtype, device,
                                    layout_class(shape.dims, strides, offset)))
        else:
            kind, value = entry
            parts.append(ScalarPart(SCALAR, kind, value))
    return tuple(parts)


def live_in_dims(signature: Signature) -> tuple[tuple[int, ...] | None, ...]:
    """Per live-in its dims, None for a scalar."""
    return tuple(entry_dims(entry) for entry in signature)


def differing_dims(reference: tuple[tuple[int, ...] | None, ...],
                   dims: tuple[tuple[int, ...] | None, ...]) -> set[tuple[int, int]]:
    """The (live-in position, dim) pairs where two signatures of one structure differ."""
    found = set()
    for position, (want, got) in enumerate(zip(reference, dims)):
        if want is not None and want != got:
            found.update((position, axis) for axis, (a, b) in enumerate(zip(want, got))
                         if a != b)
    return found


def _family_key(structure: tuple[Part, ...], bounds: tuple[Bounds | None, ...]) -> str | None:
    """Note [Family keys]; None when some live-in cannot be keyed."""
    if len(structure) != len(bounds):
        raise ValueError(f"a family needs bounds for each of its {len(structure)} live-ins, "
                         f"got {len(bounds)}")
    parts = []
    for part, dims in zip(structure, bounds):
        if part.tag == SCALAR:
            text = scalar_text(part.type, part.value)
            if text is None or dims is not None:
                return None
        else:
            if dims is None or len(dims) != part.rank:
                return None
            text = tensor_text(part.dtype, part.device, part.layout, dims)
        parts.append(text)
    return "|".join(parts)


@dataclass(frozen=True, slots=True)
class Family:
    """A structure plus per-dim bounds: the signatures one family kernel serves.

    Build with `family_for`; `key` is derived from `structure` and `bounds`.
    """

    structure: tuple[Part, ...]
    """The `structure_key` every member shares: per live-in a TensorPart or ScalarPart."""
    bounds: tuple[Bounds | None, ...]
    """Per live-in, per dim (low, high), low == high for a static dim; None for a scalar."""
    key: str = field(init=False)
    """Stable text naming the family across processes; see Note [Family keys]."""

    def __post_init__(self) -> None:
        key = _family_key(self.structure, self.bounds)
        if key is None:
            raise ValueError(f"no family key for structure {self.structure} with bounds "
                             f"{self.bounds}: scalars need a keyable literal and no "
                             f"bounds, tensors one (low, high) per dim")
        object.__setattr__(self, "key", key)

    @property
    def varying(self) -> tuple[tuple[int, int], ...]:
        """(live-in position, dim) pairs that the kernel takes as runtime parameters."""
        return tuple((position, axis)
                     for position, dims in enumerate(self.bounds) if dims is not None
                     for axis, (low, high) in enumerate(dims) if low != high)

    def contains(self, signature: Signature) -> bool:
        """Whether this family's kernel serves `signature`."""
        if len(signature) != len(self.bounds) or structure_key(signature) != self.structure:
            return False
        for entry, dims in zip(signature, self.bounds):
            if dims is not None and not all(low <= n <= high
                                            for n, (low, high) in zip(entry_dims(entry), dims)):
                return False
        return True

    def probe_dims(self) -> tuple[tuple[tuple[int, ...] | None, ...], ...]:
        """Concrete dims (per live-in; None for a scalar) that together exercise the bucket.

        The JIT evaluates the region abstractly at each probe and folds a value derived
        from the dims into a constant only if it is the same at every probe, so the probes
        must make everything that can vary within the bounds actually vary:

        1. every varying dim at its upper bound: the shape the arena is planned for;
        2. every varying dim at its lower bound;
        3. every varying dim at low + 1 (at high when the bucket has only two values), so
           that a value is not folded just because it agrees at the two ends;
        4. with several varying dims, mixed probes where some sit at low and others at
           high. Varying dim i goes low in probe j when bit j of i is set; the mirror
           images of those probes come next. Any two varying dims then differ in some
           probe, so no relation such as "dim a == dim b" is folded by accident. Within
           MAX_PROBES this keeps up to 8 varying dims apart.

        Static dims keep their value. Duplicates are dropped, so a family with nothing
        varying has one probe: its only shape.
        """
        varying = self.varying

        def probe(pick) -> tuple[tuple[int, ...] | None, ...]:
            return tuple(
                None if dims is None else tuple(
                    low if low == high else pick(varying.index((position, axis)), low, high)
                    for axis, (low, high) in enumerate(dims))
                for position, dims in enumerate(self.bounds))

        probes = [probe(lambda i, low, high: high),
                  probe(lambda i, low, high: low),
                  probe(lambda i, low, high: min(low + 1, high))]
        if len(varying) > 1:
            bits = (len(varying) - 1).bit_length()
            mixed = [probe(lambda i, low, high, j=j: low if i >> j & 1 else high)
                     for j in range(bits)]
            mirrors = [probe(lambda i, low, high, j=j: high if i >> j & 1 else low)
                       for j in range(bits)]
            probes += mixed + mirrors
        return tuple(dict.fromkeys(probes))[:MAX_PROBES]


def family_for(signature: Signature, varying: Collection[tuple[int, int]],
               ratio: int = 4) -> Family | None:
    """The family of `signature` when the (live-in position, dim) pairs in `varying` vary.

    None when the signature cannot share code: a tensor live-in that is not contiguous
    (see Note [Code families]) or a scalar that has no stable key (Note [Family keys]);
    such signatures only get exact specializations.
    """
    structure = structure_key(signature)
    bounds = family_bounds(signature, structure, varying, check_ratio(ratio))
    return None if bounds is None else Family(structure, bounds)


def family_bounds(signature: Signature, structure: tuple[Part, ...],
                  varying: Collection[tuple[int, int]], ratio: int
                  ) -> tuple[Bounds | None, ...] | None:
    """The bounds `family_for` gives `signature` (its `structure_key` and a checked ratio
    given), or None; the request path's index builds each distinct Family once."""
    bounds: list[Bounds | None] = []
    for position, (entry, part) in enumerate(zip(signature, structure)):
        if part.tag == SCALAR:
            if scalar_text(part.type, part.value) is None:
                return None
            bounds.append(None)
        elif part.layout != CONTIGUOUS:
            return None
        else:
            bounds.append(tuple(bucket_of(n, ratio) if (position, axis) in varying else (n, n)
                                for axis, n in enumerate(entry_dims(entry))))
    return tuple(bounds)


def varying_dims(signatures: Iterable[Signature]) -> frozenset[tuple[int, int]]:
    """(live-in position, dim) pairs that take more than one value among signatures of the
    same structure.

    Meant for the signatures of one structure (as `cluster` calls it); given several
    structures it returns the union of what varies within each of them.
    """
    references: dict[tuple, tuple] = {}
    found: set[tuple[int, int]] = set()
    for signature in signatures:
        dims = live_in_dims(signature)
        reference = references.setdefault(structure_key(signature), dims)
        if reference is not dims:
            found |= differing_dims(reference, dims)
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class FamilyStats:
    """What a family's members cost: the input to tier-1 promotion."""

    family: Family
    members: tuple
    """The distinct observed signatures in the family, in order of first observation."""
    count: int
    """Calls summed over the members."""
    seconds: float
    """Time summed over the members."""


def cluster(observed: Sequence[tuple[Signature, int, float]],
            ratio: int = 4) -> tuple[FamilyStats, ...]:
    """Group observed (signature, calls, seconds) into families, costliest first.

    Signatures are grouped by structure; the dims that vary within each group are
    bucketed (`family_for`). Signatures with no family (strided tensors, unkeyable
    scalars) are left out: they only get exact specializations. Ties in seconds are
    broken by key, so the order is the same in every process.
    """
    ratio = check_ratio(ratio)
    structures = [structure_key(signature) for signature, _, _ in observed]
    groups: dict[tuple, list[Signature]] = {}
    for structure, (signature, _, _) in zip(structures, observed):
        groups.setdefault(structure, []).append(signature)
    varying = {structure: varying_dims(members) for structure, members in groups.items()}

    families: dict[str, Family] = {}
    members: dict[str, dict[Signature, None]] = {}
    counts: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for structure, (signature, calls, elapsed) in zip(structures, observed):
        family = family_for(signature, varying[structure], ratio)
        if family is None:
            continue
        key = family.key
        families.setdefault(key, family)
        members.setdefault(key, {})[signature] = None
        counts[key] = counts.get(key, 0) + calls
        seconds[key] = seconds.get(key, 0.0) + elapsed
    stats = [FamilyStats(families[key], tuple(members[key]), counts[key], seconds[key])
             for key in families]
    return tuple(sorted(stats, key=lambda s: (-s.seconds, s.family.key)))
