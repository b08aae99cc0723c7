"""bench/full_width.py (Note [Full-width timing]) at a tiny width: the three phases run,
every figure the report states is there and consistent with the calls made, the JIT
and the interpreter give eager's outputs, and --update-docs rewrites only its own block
of the doc. No timing is asserted (the host is shared)."""

from __future__ import annotations

import pytest

from bench import full_width
from dynvm.jit.backends.cpu_precision import precision_available


@pytest.fixture(scope="module")
def measured():
    shapes = ((1, 16), (2, 32), (4, 16))
    model = full_width.bert(hidden=32, layers=1, heads=2, ffn=64, vocab=128, shapes=shapes)
    peers = ("onnxruntime",) if _installed("onnxruntime") else ()
    precisions = ("bf16",) if precision_available("bf16") is None else ()
    return model, full_width.measure(model, warmup=6, calls_per_shape=1, peers=peers,
                                     log=lambda m: None, jit_precisions=precisions)


def _installed(name: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(n) is not None for n in (name, "onnx", "onnxscript"))


def test_phases_report_every_shape(measured):
    model, result = measured
    assert model.labels == ("1x16", "2x32", "4x16") and model.export_index == 1
    warm, steady = result["warmup"], result["steady"]
    assert warm["calls"] == 6 and sum(s["calls"] for s in warm["per_shape"].values()) == 6
    for shape in warm["per_shape"].values():
        assert shape["jit_over_interp_p90"] == pytest.approx(
            shape["jit_p90_ms"] / shape["interp_p90_ms"])
        assert shape["jit_max_ms"] >= shape["jit_p90_ms"] > 0
    assert steady["calls"] == 3
    for system in ("interp", "interp_b", "jit"):
        assert set(steady["x_eager"][system]) == set(model.labels)
        assert steady["max_abs_error"][system] < 1e-4, system
    assert steady["aa_margin"] >= abs(steady["interp_aa"] - 1.0)
    assert result["season"]["settled"] in (True, False)
    if "jit-bf16" in steady["x_eager"]:   # the JIT in bf16 beside the others
        assert set(steady["x_eager"]["jit-bf16"]) == set(model.labels)
        assert steady["max_abs_error"]["jit-bf16"] < 0.1
    if "onnxruntime" in result["peers"]:
        assert steady["max_abs_error"]["onnxruntime"] < 1e-4


def test_report_and_docs_block(measured, tmp_path):
    _, result = measured
    run = {"command": "python -m bench.full_width --test", "started": "now",
           "total_wall_seconds": 1.0, "machine": {"torch": "2.x"}, "threads": 1,
           "loadavg_start": (1.0, 1.0, 1.0), "loadavg_end": (1.0, 1.0, 1.0),
           "models": [result]}
    text = full_width.markdown(run)
    # --keep: an earlier run's model the later run did not measure, under its own line
    other = {**result, "name": "resnet50-224"}
    kept = full_width.keep_models({**run, "models": [result]},
                                  {**run, "started": "earlier", "models": [result, other]})
    assert [m["name"] for m in kept["models"]] == [result["name"], "resnet50-224"]
    assert "From the run of earlier" in full_width.markdown(kept)
    assert "| 2x32 |" in text and "JIT / best fp32 peer" in text and "Warm-up" in text
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nhand-written text\n")
    full_width.update_docs(text, doc)
    full_width.update_docs(text.replace("| 2x32 |", "| 2x32 again |"), doc)
    written = doc.read_text()
    assert written.startswith("# Benchmarks\n\nhand-written text\n")
    assert written.count(full_width.BEGIN) == 1 and "2x32 again" in written
