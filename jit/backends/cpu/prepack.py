"""Weights in oneDNN's own layout, built once per engine and shared by its kernels.

Note [Prepacked weights]
~~~~~~~~~~~~~~~~~~~~~~~~
oneDNN's GEMM reads its weight in a blocked layout of its own. Handed a plain [N, K]
tensor, `mkldnn._linear_pointwise` reorders it on every call; handed the result of
`mkldnn._reorder_linear_weight` once, it reads it as is (an opaque `_mkldnn` tensor).
The reorder takes a batch-size hint that picks the blocking; on this project's 2-core
AVX-512 machine the hint changed nothing measurable (M=32..2048, N=1024, K=256: all
hints within noise of each other), so a weight is packed once per engine, with the
planning probe's M (the family's upper bound, Note [Probes]) of the first kernel that
needs it, and every later kernel of any M shares that copy (any M runs on it correctly):
the hint is not part of the cache key, and jitter's three family compiles pack each
weight once, not three times.

Where packed weights live:
- built in this process, from the program's constant, by the backend when it emits a
  kernel. A fleet ships the specializer's IR (Note [Portable specializations]) and every
  replica re-emits it, so packed weights are built on the replica that runs them and
  never travel (their layout depends on the replica's CPU);
- one `PrepackCache` per JIT engine (it sits in the engine's `CpuOptions`), i.e. per
  program and device: the specializations of a region, and of all regions, share one
  packed copy per (constant, transform, hint);
- the cache holds them weakly. A kernel holds its packed weights as globals of its
  generated module, so a packed weight is freed with the last specialization that uses
  it (eviction, demotion, drop), and a later compile packs it again.

Transforms are folded into the packed copy, never into the program's constant: a
weight stored [K, N] (MM, MATMUL, ADDMM's `b`) is transposed into linear's [N, K].
"""

from __future__ import annotations

import threading
import weakref

import torch

from dynvm.jit.background import checkpoint

_mkldnn = torch.ops.mkldnn


class PrepackCache:
    """Packed weights of one engine's constants, held weakly (Note [Prepacked weights])."""

    def __init__(self) -> None:
        self._packed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.packs = 0        # weights packed (not answered from the cache)

    def linear_weight(self, index: int, weight: torch.Tensor, batch_hint: int,
                      transpose: bool = False) -> torch.Tensor:
        """Constant `index` (`weight`) as oneDNN linear's packed [N, K] weight; with
        `transpose` the constant is [K, N]."""
        def build():
            dense = weight.t() if transpose else weight
            # A transposed or strided constant is made contiguous first (once per pack).
            return _mkldnn._reorder_linear_weight(dense.contiguous(), max(1, int(batch_hint)))
        return self.get((index, "linear", transpose), build)

    def get(self, key: tuple, build) -> torch.Tensor:
        """The packed tensor cached under `key`, made by `build()` if none is alive. The
        key names everything the packed tensor is computed from (constant indices,
        transforms, hints): the cache serves one engine, whose constants never change."""
        with self._lock:
            found = self._packed.get(key)
        if found is not None:
            return found
        # A pack is a reorder of a whole weight (ms at BERT-base width): a step of its
        # own for the compile worker (Note [Background work yields to calls]).
        checkpoint()
        packed = build()
        with self._lock:
            # Two compile threads may pack the same weight; the first stored is shared.
            existing = self._packed.get(key)
            if existing is not None:
                return existing
            self._packed[key] = packed
            self.packs += 1
        return packed

    def key_of(self, packed: torch.Tensor) -> tuple | None:
        """The key `packed` is cached under (None: this cache did not make it, or it
        died): a tensor derived from it (its bf16 copy) is cached under a key of its
        own built from this one, so kernels sharing `packed` share the copy too."""
        with self._lock:
            return next((k for k, v in self._packed.items() if v is packed), None)

    def alive(self) -> int:
        """Packed weights alive (held by at least one kernel)."""
        with self._lock:
            return len(self._packed)

    def nbytes(self) -> int:
        """Bytes of the packed weights alive: a second copy of those weights, beside the
        program's constants that the interpreter reads (Note [A generator's resident
        memory] in dynvm._generate_memory)."""
        with self._lock:
            packed = list(self._packed.values())
        # a tensor, or an object holding copies of its own (onednn_linear's weights)
        return sum(t.nbytes() if callable(getattr(t, "nbytes", None))
                   else t.numel() * t.element_size() for t in packed)
