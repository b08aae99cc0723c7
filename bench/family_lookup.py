"""Cost of FamilyIndex.family_of on a memo hit, next to a plain dict lookup of the same
signature (what a region cache slot costs), and of observe() on a signature seen before.

    python bench/family_lookup.py [--lookups 200000] [--repeats 7]

The signature is a realistic one: three tensor live-ins and a scalar, batch varying.
Each figure is the best of --repeats timings of --lookups calls (the least disturbed).
"""

from __future__ import annotations

import argparse
import timeit

import torch

from dynvm.shape_cluster import FamilyIndex
from dynvm.vm.shapes import intern_shape

CPU = torch.device("cpu")


def tensor_entry(*dims: int) -> tuple:
    strides, step = [], 1
    for dim in reversed(dims):
        strides.append(step)
        step *= max(dim, 1)
    return (intern_shape(dims), torch.float32, tuple(reversed(strides)), 0, CPU)


def signature(batch: int) -> tuple:
    return (tensor_entry(batch, 32, 256), tensor_entry(256, 256), tensor_entry(256),
            (int, 7))


def best_microseconds(stmt, lookups: int, repeats: int) -> float:
    return min(timeit.repeat(stmt, number=lookups, repeat=repeats)) / lookups * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    index = FamilyIndex()
    for batch in range(1, 65):
        index.observe(signature(batch))
    hot = signature(24)
    family = index.family_of(hot)
    slot = {hot: family}
    rows = [
        ("dict lookup (baseline)", lambda: slot.get(hot)),
        ("family_of, memo hit", lambda: index.family_of(hot)),
        ("observe, seen before", lambda: index.observe(hot)),
    ]
    print(f"family {family.key}")
    for name, stmt in rows:
        print(f"{name:<24} {best_microseconds(stmt, args.lookups, args.repeats):7.3f} us")


if __name__ == "__main__":
    main()
