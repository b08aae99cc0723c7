"""Per-layer join of a CNN's convolution times across systems, for `python -m
bench.resnet_profile --layers` (Note [ResNet layers side by side]).

Note [ResNet layers side by side]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A whole-call ratio says the JIT is behind; it does not say where. Three sources time
the same convolutions, each in its own way, and this module puts them on one row per
layer geometry, the key being (input shape, weight shape) in NCHW order, which all
three can name:
- the JIT's operators (torch.profiler, self time per operator and input shapes): a
  fused call's time, oneDNN's execution *and* what torch and ideep do around it on
  every call (tensor wrapping, descriptors, attributes, scratchpad, output);
- oneDNN's own execution times (ONEDNN_VERBOSE lines, `exec`): the primitive alone, its
  OpenMP region included, and the implementation oneDNN picked (`brgconv_1x1`,
  `brg_conv_fwd`, ...);
- ONNX Runtime's node profile (`_kernel_time` events, input shapes per node).
So per layer: JIT / ONNX Runtime (how far behind), and the JIT's time over oneDNN's
execution (what the per-call path costs). The fused calls' operand orders differ
(`_convolution_pointwise(x, w, ...)`, `.binary(x, other, w, ...)`, the in-place
`_convolution_pointwise_.binary(other, x, w, ...)`), so the input and the weight are
found by position per form.
"""

from __future__ import annotations

import re
from collections import defaultdict

Key = tuple[tuple[int, ...], tuple[int, ...]]   # (input NCHW, weight OIHW)

_VERBOSE_PROBLEM = re.compile(
    r"mb(\d+)_(?:g(\d+))?ic(\d+)oc(\d+)_(?:id\d+od\d+kd\d+sd\d+dd\d+pd\d+_)?"
    r"ih(\d+)oh\d+kh(\d+)\D.*?iw(\d+)ow\d+kw(\d+)")


def jit_conv_key(name: str, shapes: list) -> Key | None:
    """The (input, weight) shapes of a fused convolution call from its profiler row
    (operator name and input shapes), or None when the row is not one."""
    if "_convolution_pointwise" not in name or len(shapes) < 3:
        return None
    four = [tuple(s) for s in shapes[:3]]
    if name.endswith("_convolution_pointwise_"):     # (other, x, weight, ...)
        x, weight = four[1], four[2]
    elif len(four[1]) == 4 and len(four[2]) == 4:     # .binary: (x, other, weight, ...)
        x, weight = four[0], four[2]
    else:                                             # unary: (x, weight, bias, ...)
        x, weight = four[0], four[1]
    if len(x) != 4 or len(weight) != 4:
        return None
    return x, weight


def onednn_exec(lines) -> dict[Key, tuple[str, float, int]]:
    """Per key: (implementation, summed ms, count) from ONEDNN_VERBOSE `exec` lines of
    convolutions."""
    found: dict[Key, list] = {}
    for line in lines:
        fields = line.strip().split(",")
        if len(fields) < 8 or "exec" not in fields[:4] or "convolution" not in fields:
            continue
        match = _VERBOSE_PROBLEM.search(line)
        if match is None:
            continue
        mb, g, ic, oc, ih, kh, iw, kw = (int(v) if v else None for v in match.groups())
        groups = g or 1
        key = ((mb, ic, ih, iw), (oc, ic // groups, kh, kw))
        impl = fields[fields.index("convolution") + 1]
        entry = found.setdefault(key, [impl, 0.0, 0])
        entry[1] += float(fields[-1])
        entry[2] += 1
    return {k: (v[0], v[1], v[2]) for k, v in found.items()}


def join(jit: dict[Key, tuple[float, int]], ort: dict[Key, tuple[float, int]],
         onednn: dict[Key, tuple[str, float, int]] | None = None, *, calls: int = 1,
         onednn_calls: int = 1) -> list[dict]:
    """One row per key of `jit` or `ort` (ms summed per call over the layers with that
    geometry; `calls` and `onednn_calls`: how many calls the sums of `jit`/`ort` and of
    `onednn` cover), largest JIT time first."""
    rows = []
    for key in set(jit) | set(ort):
        jit_ms, count = jit.get(key, (0.0, 0))
        ort_ms, ort_count = ort.get(key, (0.0, 0))
        row = {"input": key[0], "weight": key[1], "count": max(count, ort_count) // calls,
               "jit_ms": jit_ms / calls, "ort_ms": ort_ms / calls}
        if onednn is not None and key in onednn:
            impl, ms, _ = onednn[key]
            row.update(impl=impl, exec_ms=ms / onednn_calls)
        rows.append(row)
    return sorted(rows, key=lambda r: -r["jit_ms"])


def ort_conv_times(trace: list[dict]) -> tuple[dict[Key, tuple[float, int]], int]:
    """Per key: (summed ms, count) of ONNX Runtime's Conv nodes in a profile's events,
    and how many runs the profile holds."""
    runs = 0
    found: dict[Key, list] = defaultdict(lambda: [0.0, 0])
    for event in trace:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += 1
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        args = event.get("args", {})
        if args.get("op_name") != "Conv":
            continue
        shapes = [next(iter(d.values())) for d in args.get("input_type_shape", [])]
        if len(shapes) < 2 or len(shapes[0]) != 4 or len(shapes[1]) != 4:
            continue
        entry = found[(tuple(shapes[0]), tuple(shapes[1]))]
        entry[0] += event["dur"] / 1e3
        entry[1] += 1
    return {k: (v[0], v[1]) for k, v in found.items()}, runs


def markdown(rows: list[dict]) -> str:
    """The joined rows as a markdown table, with totals."""
    with_exec = any("exec_ms" in r for r in rows)
    head = "| input | weight | n | JIT ms | ONNX Runtime ms | JIT / ORT |"
    rule = "|---|---|---:|---:|---:|---:|"
    if with_exec:
        head += " oneDNN exec ms | JIT - exec ms | oneDNN impl |"
        rule += "---:|---:|---|"
    lines = [head, rule]

    def ratio(a, b):
        return f"{a / b:.2f}" if b else "-"
    for r in rows:
        line = (f"| {list(r['input'])} | {list(r['weight'])} | {r['count']} | "
                f"{r['jit_ms']:.3f} | {r['ort_ms']:.3f} | {ratio(r['jit_ms'], r['ort_ms'])} |")
        if with_exec:
            exec_ms = r.get("exec_ms")
            line += (f" {exec_ms:.3f} | {r['jit_ms'] - exec_ms:.3f} | {r['impl']} |"
                     if exec_ms is not None else " - | - | - |")
        lines.append(line)
    jit_total = sum(r["jit_ms"] for r in rows)
    ort_total = sum(r["ort_ms"] for r in rows)
    total = (f"| all convolutions | | {sum(r['count'] for r in rows)} | {jit_total:.3f} | "
             f"{ort_total:.3f} | {ratio(jit_total, ort_total)} |")
    if with_exec:
        exec_total = sum(r.get("exec_ms", 0.0) for r in rows)
        total += f" {exec_total:.3f} | {jit_total - exec_total:.3f} | |"
    lines.append(total)
    return "\n".join(lines)
