"""`dynvm bench zoo` on one model, quick: the row has every column docs/MODELS.md shows
and the markdown is built from it. No timing is asserted (the machine is shared)."""

from __future__ import annotations

import json

from dynvm.cli import main


def test_bench_zoo_writes_the_models_table(tmp_path):
    assert main(["bench", "zoo", "--models", "gin", "--quick", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "results.json").read_text())
    assert run["command"] == "dynvm bench zoo --models gin --quick"
    assert run["machine"]["torch_threads"] == 1
    (row,) = run["models"]
    assert row["name"] == "gin" and row["library"] == "torch_geometric"
    assert row["status"] == "ok", row["status"]
    assert row["parameters"] > 0 and row["compile_seconds"] > 0 and row["eager_ms"] > 0
    assert row["interp_x_eager"] > 0 and row["jit_x_eager"] > 0
    # the per-call JIT / interpreter and its A/A beside it (a second interpreter)
    assert row["jit_over_interp"] > 0 and row["interp_aa"] > 0
    assert "interp_b" not in row["ms_per_call"]
    assert row["dims"] == {"nodes": "2..1024", "edges": "2..8192"}
    assert "SCATTER_ADD" in row["opcodes"]
    # quick: one period, a cycle of the 16 call orders of 4 systems for each of the
    # entry's 4 shapes (each shape at every place of the cycle once); a call that started
    # a background compile is dropped
    assert row["steps"] == 4 * 16
    assert row["steady_calls"] + row["discarded_calls"] == 4 * 16 and row["steady_calls"] > 0
    assert row["eager_spread"] >= 1
    assert len(row["ms_per_call"]["eager"]) == row["steady_calls"]
    report = (tmp_path / "report.md").read_text()
    assert "| gin | torch_geometric |" in report and "SCATTER_ADD" in report
    assert row["interp_aa_margin"] >= 0 and row["interp_aa_margin_cpu"] >= 0
    assert (f"{row['jit_over_interp']:.3f} ({row['interp_aa']:.3f}, "
            f"{row['interp_aa_margin']:.3f})") in report
    assert "within the model's A/A margin" in report


def test_bench_zoo_names_an_unknown_model(capsys):
    assert main(["bench", "zoo", "--models", "nope", "--quick"]) == 2
    assert "unknown zoo model 'nope'; known: " in capsys.readouterr().err
