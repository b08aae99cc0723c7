"""bench/full_width.py (Note [Full-width timing]) at a tiny width: the three phases run,
every figure the report states is there and consistent with the calls made, the JIT
and the interpreter give eager's outputs, and --update-docs rewrites only its own block
of the doc. No timing is asserted (the host is shared)."""

from __future__ import annotations

import pytest

from bench import full_width
from dynvm.jit.backends.cpu.precision import precision_available


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
        assert shape["aa_over_interp_p90"] > 0   # the warm-up's A/A, a second interpreter
    for label, shape in warm["per_shape"].items():   # the calls' own times (warmup_bar)
        calls = warm["times_ms"]["jit"][label]
        assert len(calls) == shape["calls"] and max(calls) == pytest.approx(
            shape["jit_max_ms"], abs=1e-3)
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
    assert "The warm-up's A/A" in text and "| A/A p90 |" in text
    # each shape's own A/A: interpreter B's median over A's at that shape
    steady = result["steady"]["x_eager"]
    row = next(line for line in text.splitlines() if line.startswith("| 2x32 |"))
    want = steady["interp_b"]["2x32"] / steady["interp"]["2x32"]
    assert row.rstrip(" |").endswith(f"{want:.3f}"), row
    assert "| A/A (interp B / A) |" in text and "Per shape, the A/A" in text
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nhand-written text\n")
    full_width.update_docs(text, doc)
    full_width.update_docs(text.replace("| 2x32 |", "| 2x32 again |"), doc)
    written = doc.read_text()
    assert written.startswith("# Benchmarks\n\nhand-written text\n")
    assert written.count(full_width.BEGIN) == 1 and "2x32 again" in written


def test_tier_block_in_models_doc_survives_the_zoo_report(measured, tmp_path):
    """--tier --update-docs writes its block into docs/MODELS.md (Note [Full-width
    tier]); rewriting the zoo's part keeps it; a second tier run replaces it."""
    from bench import zoo_report

    model, result = measured
    run = {"command": "python -m bench.full_width --tier", "started": "now",
           "total_wall_seconds": 1.0, "machine": {"torch": "2.x"}, "threads": 2,
           "loadavg_start": (1.0, 1.0, 1.0), "loadavg_end": (1.0, 1.0, 1.0),
           "omp": "OMP_WAIT_POLICY=PASSIVE", "tier": True,
           "models": [{**result, "tier": {"key": "bert", "description": "tiny BERT"}}]}
    text = full_width.tier_markdown(run)
    assert "OMP_WAIT_POLICY=PASSIVE" in text and "tiny BERT" in text
    assert f"| {result['name']} | 2x32 |" in text   # the per-shape table
    zoo_doc = "# The model zoo\n\n## Models\n\ntable\n\n## Opcodes used\n\nops\n"
    doc = zoo_report.insert_block(zoo_doc, text)
    assert doc.index("## Full-width tier") < doc.index("## Opcodes used")
    assert doc.startswith("# The model zoo\n\n## Models\n\ntable\n")
    # `dynvm bench zoo --update-docs` writes a new zoo part and keeps the tier's block
    block = zoo_report.tier_block(doc)
    kept = zoo_report.insert_block(zoo_doc.replace("table", "new table"), block.removeprefix(
        zoo_report.TIER_BEGIN).removesuffix(zoo_report.TIER_END))
    assert "new table" in kept and zoo_report.tier_block(kept) == block
    again = zoo_report.insert_block(kept, text.replace("tiny BERT", "tiny BERT again"))
    assert again.count(zoo_report.TIER_BEGIN) == 1 and "tiny BERT again" in again


def test_openmp_wait_policy_reexec(monkeypatch):
    """Note [OpenMP wait policy]: the process starts again with PASSIVE when the
    variable is unset, and a value the user set is kept (no restart)."""
    import os
    import subprocess
    import sys

    from bench import _omp

    probe = ("import sys; from bench._omp import reexec_passive; "
             "reexec_passive([sys.executable, '-c', "
             "'import os; print(os.environ[\"OMP_WAIT_POLICY\"])'])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True, cwd=full_width.ROOT).stdout
    assert out.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", probe + "; print('not restarted')"],
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True,
                         text=True, check=True, cwd=full_width.ROOT).stdout
    assert out.strip() == "not restarted"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert _omp.wait_policy() == "OMP_WAIT_POLICY=PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert "unset" in _omp.wait_policy()
    monkeypatch.setattr(sys, "argv", ["pytest", "bench", "zoo"])
    _omp.reexec_cli_passive()   # not the dynvm command line: nothing happens


def test_batch_one_shapes_alone_export_at_an_untimed_example():
    """`--shapes 1x16,1x32` has no shape export can take (a dynamic dim at 1 would be
    specialized): the model is exported at a batch-2 example it never times, and both
    the interpreter and eager agree at the timed shapes."""
    import dynvm

    model = full_width.bert(hidden=32, layers=1, heads=2, ffn=64, vocab=128,
                            shapes=((1, 16), (1, 32)))
    assert model.export_index is None
    ids, mask = model.export_inputs
    assert ids.shape == mask.shape == (2, 32)
    program = dynvm.compile(model.module, model.export_inputs, model.dynamic_shapes)
    with dynvm.Runtime(program) as runtime:
        for inputs in model.inputs:
            expected = model.module(*inputs)
            got = runtime(*inputs)
            for e, g in zip(expected, got, strict=True):
                assert (e - g).abs().max().item() < 1e-4
    vision = full_width.resnet50(batches=(1,), size=32, blocks=(1, 1, 1, 1))
    assert vision.export_index is None and vision.export_inputs[0].shape == (2, 3, 32, 32)


def test_the_held_out_encoder_is_timed_at_its_batch_walk():
    """`--models heldout`: issue 14's held-out encoder at batch 1 / 4 / 16 / 64, seq 32,
    exported at batch 4 (not 1), and the interpreter agrees with eager at each batch."""
    import dynvm

    model = full_width.heldout(batches=(1, 4), seq=8)
    assert model.labels == ("batch 1", "batch 4") and model.export_index == 1
    assert [x.shape for (x,) in model.inputs] == [(1, 8, 256), (4, 8, 256)]
    program = dynvm.compile(model.module, model.export_inputs, model.dynamic_shapes)
    with dynvm.Runtime(program) as runtime:
        for inputs in model.inputs:
            assert (runtime(*inputs) - model.module(*inputs)).abs().max().item() < 1e-4
