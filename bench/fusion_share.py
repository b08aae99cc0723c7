"""How much of a zoo model's specialized time is left to fusion groups no vendor op takes.

    python -m bench.fusion_share [--models resnet,bert,vit,convnext] [--calls 5]

Issue 15 allows leaving generated C++ fusion groups out where measurement shows the gain
below a stated threshold (Note [CPU fusion groups without a vendor op]). Per model: the
JIT (oneDNN rewrites measured, as a server runs it, promotion forced so that every call
runs specialized code) at the entry's export point; torch.profiler's self CPU time per
ATen/oneDNN op over a few calls, in groups:
- vendor: GEMMs, convolutions and attention (oneDNN, MKL, SDPA): what C++ would not touch;
- fusable: elementwise ops, softmax, layer/batch norm, reductions, copies: the most a
  fused C++ group could save is their whole time (it must still read and write its
  operands once, so the real gain is smaller);
- other: views and everything else (metadata, allocation).
The share of `fusable` is the bound; below the threshold (10%) C++ is not worth a
compiler on the replica's side.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

GROUPS = {
    "vendor": ("mkldnn", "addmm", "aten::mm", "bmm", "linear", "matmul", "conv",
               "scaled_dot_product", "baddbmm"),
    "fusable": ("add", "sub", "mul", "div", "gelu", "relu", "silu", "sigmoid", "tanh",
                "hardswish", "hardsigmoid", "softmax", "norm", "mean", "sum", "var", "pow",
                "sqrt", "rsqrt", "exp", "erf", "where", "masked_fill", "clamp", "copy",
                "clone", "contiguous", "cat", "neg", "pool", "max"),
}


def group_of(op: str) -> str:
    """The group of a profiler op name (first match wins: vendor before fusable)."""
    name = op.lower()
    for group, words in GROUPS.items():
        if any(word in name for word in words):
            return group
    return "other"


def measure(entry, harness, calls: int) -> dict[str, float]:
    """Self CPU seconds per call of each group, for `entry`'s specialized code."""
    from torch.profiler import ProfilerActivity, profile

    import dynvm

    compiled = harness.compile_entry(entry)
    x = compiled.built.make_inputs(entry.export_point, 0)
    config = dataclasses.replace(harness.jit_config(), cpu_fusion="measured",
                                 arena_ops="measured")
    with dynvm.Runtime(compiled.program, jit=config) as runtime:
        for _ in range(3):
            runtime(*x)
        stats = runtime.stats()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                runtime(*x)
        after = runtime.stats()
    interpreted = after["interpreted_region_calls"] - stats["interpreted_region_calls"]
    totals = {"vendor": 0.0, "fusable": 0.0, "other": 0.0}
    fusable: dict[str, float] = {}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6 / calls
        totals[group_of(event.key)] += seconds
        if group_of(event.key) == "fusable":
            fusable[event.key] = seconds
    totals["interpreted_region_calls"] = interpreted
    totals["top_fusable"] = sorted(fusable.items(), key=lambda kv: -kv[1])[:3]
    return totals


def main() -> None:
    from bench.zoo import _registry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,convnext,bert,vit")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    zoo, harness = _registry()
    print("| model | vendor ms | fusable ms | other ms | fusable share | largest fusable ops |")
    print("|---|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        t = measure(zoo.by_name(name), harness, args.calls)
        total = t["vendor"] + t["fusable"] + t["other"]
        note = f" ({t['interpreted_region_calls']} region calls interpreted)" \
            if t["interpreted_region_calls"] else ""
        print(f"| {name} | {1e3 * t['vendor']:.2f} | {1e3 * t['fusable']:.2f} | "
              f"{1e3 * t['other']:.2f} | {t['fusable'] / total:.0%}{note} | "
              + ", ".join(f"{op} {1e3 * s:.2f}" for op, s in t["top_fusable"]) + " |",
              flush=True)


if __name__ == "__main__":
    main()
