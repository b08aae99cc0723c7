"""Interned shapes.

Note [Interned shapes]
~~~~~~~~~~~~~~~~~~~~~~
A guard must decide "same shape as when this specialization was compiled" in about one
pointer comparison. So shapes are interned: `intern_shape((4, 32, 256))` returns the one
`Shape` object for those dims for as long as anybody holds it, and equal dims always give
the same object. `Shape` therefore keeps object identity as its equality and hash: a
signature that is a tuple of shapes hashes and compares in C, without looking at dims.

The table holds its shapes weakly: a shape that no signature, guard or caller keeps is
dropped, so a stream of never-repeating shapes (a shape storm, a fuzzer) cannot grow the
table without bound.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator


class Shape:
    """An immutable, interned sequence of dims. Build with `intern_shape`, never directly.

    Equality and hashing are by identity (see Note [Interned shapes]); compare dims with
    `shape.dims == other_dims` when an uninterned tuple is involved.
    """

    __slots__ = ("dims", "numel", "__weakref__")

    def __init__(self, dims: tuple[int, ...]) -> None:
        self.dims = dims
        numel = 1
        for dim in dims:
            numel *= dim
        self.numel = numel

    @property
    def rank(self) -> int:
        return len(self.dims)

    def __len__(self) -> int:
        return len(self.dims)

    def __iter__(self) -> Iterator[int]:
        return iter(self.dims)

    def __getitem__(self, index):
        return self.dims[index]

    def __setattr__(self, name, value):
        if hasattr(self, "numel"):
            raise AttributeError("Shape is immutable")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise AttributeError("Shape is immutable")

    def __reduce__(self):
        return intern_shape, (self.dims,)

    def __repr__(self) -> str:
        return f"Shape{self.dims!r}"


class ShapeTable:
    """Interns dims to `Shape` objects; see Note [Interned shapes]."""

    def __init__(self) -> None:
        self._refs: dict[tuple[int, ...], weakref.ref] = {}
        # Reentrant: a weakref callback can run (from GC) while _insert holds the lock.
        self._lock = threading.RLock()

    def intern(self, dims: Iterable[int]) -> Shape:
        # Fast path: a dict lookup and a weakref call, both in C. torch.Size is a tuple
        # and hashes/compares like one, so it is a valid key as it is.
        ref = self._refs.get(dims)  # type: ignore[arg-type]
        if ref is not None:
            shape = ref()
            if shape is not None:
                return shape
        return self._insert(tuple(int(d) for d in dims))

    def _insert(self, key: tuple[int, ...]) -> Shape:
        with self._lock:
            ref = self._refs.get(key)
            shape = ref() if ref is not None else None
            if shape is None:
                shape = Shape(key)
                self._refs[key] = weakref.ref(shape, self._forget(key))
            return shape

    def _forget(self, key: tuple[int, ...]):
        refs, lock = self._refs, self._lock

        def drop(dead_ref: weakref.ref) -> None:
            with lock:
                if refs.get(key) is dead_ref:
                    del refs[key]

        return drop

    def __len__(self) -> int:
        return len(self._refs)


# One table per process: interning is only useful if every caller shares it.
_TABLE = ShapeTable()


def intern_shape(dims: Iterable[int]) -> Shape:
    """The unique `Shape` for `dims` (a torch.Size, tuple or list of ints)."""
    if isinstance(dims, list):
        dims = tuple(dims)
    return _TABLE.intern(dims)


def interned_count() -> int:
    """How many distinct shapes are alive in the process-wide table."""
    return len(_TABLE)
