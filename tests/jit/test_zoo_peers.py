"""`dynvm bench zoo --peers torch.compile` (Note [Zoo peers] in bench/zoo.py): the flag is
checked, and a row with the peer's figures becomes its own table in the markdown. The
timed run itself is exercised by the lead's zoo run (minutes of Inductor compiles)."""

from __future__ import annotations

from dynvm.cli import main


def _row(name: str, jit: float, peer: float | None) -> dict:
    row = {"name": name, "library": "torchvision", "note": "", "parameters": 1000,
           "dims": {"batch": "1..8"}, "opcodes": {"RELU": 1}, "instructions": 3,
           "compile_seconds": 1.5, "eager_ms": 2.0, "eager_spread": 1.1,
           "interp_x_eager": 1.0, "jit_x_eager": jit, "jit_specialized_share": 1.0,
           "warmup_calls": 8, "settled": True, "status": "ok"}
    if peer is not None:
        row["torch_compile"] = {"x_eager": peer, "compile_seconds": 30.0, "compiles": 2,
                                "dynvm_compile_seconds": 2.5}
    return row


def test_peer_figures_are_a_table_of_their_own():
    from bench import report, zoo_report

    run = {"command": "dynvm bench zoo --peers torch.compile", "started": "now",
           "total_wall_seconds": 1.0, "machine": report.machine(), "loadavg_start": (1, 1, 1),
           "loadavg_end": (1, 1, 1), "warmup_rounds": 2, "rounds": 3, "quick": True,
           "models": [_row("resnet", 0.5, 0.8), _row("gin", 0.9, None)]}
    text = zoo_report.markdown(run)
    assert "## Against torch.compile (default)" in text
    assert "| resnet | 0.50x | 0.80x | 0.62 | 2.5 | 30.0 (2) |" in text
    assert "| gin | 0.90x |" not in text.split("## Against torch.compile")[1]
    without = dict(run, models=[_row("gin", 0.9, None)])
    assert "torch.compile (default)" not in zoo_report.markdown(without)


def test_an_unknown_peer_is_refused(capsys):
    assert main(["bench", "zoo", "--models", "gin", "--quick", "--peers", "tvm"]) == 2
    assert "unknown peer 'tvm'; known: torch.compile" in capsys.readouterr().err


def test_peer_models_must_be_measured_and_need_a_peer(capsys):
    """--peer-models times the peers on some of the run's models only; a name the run
    does not measure, or no --peers, is refused before anything runs."""
    assert main(["bench", "zoo", "--models", "gin", "--quick", "--peers", "torch.compile",
                 "--peer-models", "resnet"]) == 2
    assert "--peer-models names 'resnet', which this run does not measure" \
        in capsys.readouterr().err
    assert main(["bench", "zoo", "--models", "gin", "--quick", "--peer-models", "gin"]) == 2
    assert "--peer-models needs --peers" in capsys.readouterr().err
