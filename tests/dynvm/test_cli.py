"""The `dynvm` command line: each subcommand end to end, and every error a user can cause
reported as one `dynvm: error:` line with a non-zero status and no traceback.

Most tests call `dynvm.cli.main` in-process (importing torch once); a few run the real
`python -m dynvm` to pin the entry point, exit status and stderr of a fresh process.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest
import torch

import dynvm
from dynvm._run_cmd import parse_schedule
from dynvm.cli import main


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynvm", *argv], capture_output=True,
                          text=True, timeout=timeout)


def _error(capsys, code: int, *argv: str) -> str:
    """Run argv, expect failure with `code`; return the error message."""
    assert main(list(argv)) == code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.startswith("dynvm: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("dynvm: error: ")


@pytest.fixture(scope="module")
def branchy_dvm(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "branchy.dvm"
    assert main(["compile", "branchy", "-o", str(path)]) == 0
    return path


def test_compile_in_a_fresh_process(tmp_path):
    out = tmp_path / "rec.dvm"
    result = _cli("compile", "recommender", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    line = result.stdout.strip()
    assert re.fullmatch(r".*rec\.dvm: recommender: \d+ instructions, \d+ regions?, \d+ constants, "
                        r"[\d,]+ bytes written in [\d.]+ s", line), line
    size = int(re.search(r"([\d,]+) bytes", line).group(1).replace(",", ""))
    assert size == out.stat().st_size
    assert dynvm.load(out).name == "recommender"


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dynvm {dynvm.__version__}"


def test_every_command_has_help(capsys):
    for command in ("compile", "disasm", "asm", "run", "top"):
        assert main([command, "--help"]) == 0
        assert f"usage: dynvm {command}" in capsys.readouterr().out


def test_disasm(branchy_dvm, capsys):
    assert main(["disasm", str(branchy_dvm)]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith(".program 'branchy'")
    assert re.search(r"^\s+0  SHAPE_ASSERT ", listing, re.M)
    assert re.search(r"^\s+\d+  RETURN ", listing, re.M)


def test_asm_round_trip_and_hand_edit(branchy_dvm, tmp_path, capsys):
    listing = tmp_path / "branchy.txt"
    assert main(["disasm", str(branchy_dvm)]) == 0
    listing.write_text(capsys.readouterr().out)
    out = tmp_path / "again.dvm"
    assert main(["asm", str(listing), "--weights", str(branchy_dvm), "-o", str(out)]) == 0
    assert "same content as --weights" in capsys.readouterr().out
    assert dynvm.load(out).content_hash == dynvm.load(branchy_dvm).content_hash

    # A hand edit: the shallow branch's tanh becomes a relu.
    edited = tmp_path / "edited.txt"
    edited.write_text(listing.read_text().replace("TANH", "RELU"))
    assert main(["asm", str(edited), "--weights", str(branchy_dvm), "-o", str(out)]) == 0
    program = dynvm.load(out)
    assert any(instr.op == "RELU" for instr in program.code)
    assert program.content_hash != dynvm.load(branchy_dvm).content_hash


def test_run_file_with_schedule(branchy_dvm, capsys):
    argv = ["run", str(branchy_dvm), "--calls", "5", "--warmup", "0",
            "--schedule", "batch=1,2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): int(m.group(2))
            for m in re.finditer(r"^(batch=\d+|all calls)\s+(\d+)(\s+[\d.]+){3}$", out, re.M)}
    assert rows == {"batch=1": 3, "batch=2": 2, "all calls": 5}
    assert "runtime.stats()" in out
    assert re.search(r"^\s+calls\s+5$", out, re.M)  # no warmup: stats count the 5 calls
    assert re.search(r"^\s+instructions_executed\s+\d+$", out, re.M)


def test_run_caps_the_rows(branchy_dvm, capsys):
    argv = ["run", str(branchy_dvm), "--calls", "4", "--warmup", "0", "--max-rows", "1",
            "--schedule", "batch=1,1,2,3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^batch=1\s+2\s", out, re.M)
    assert not re.search(r"^batch=[23]\s", out, re.M)
    assert "... 2 more shapes (2 calls)" in out
    assert re.search(r"^all calls\s+4\s", out, re.M)


def test_run_demo_model_uses_its_sampler(capsys):
    assert main(["run", "branchy", "--calls", "4", "--warmup", "1", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "compiled in" in out
    assert re.search(r"^all calls\s+4\s", out, re.M)
    assert re.search(r"^\s+calls\s+5$", out, re.M)


def test_plain_run_is_the_transformer_in_a_fresh_process():
    # Small shapes keep it fast; the target is the default one.
    result = _cli("run", "--calls", "3", "--warmup", "0", "--schedule", "batch=1,2;seq=4")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("program   transformer ")
    assert re.search(r"^batch=1, seq=4\s+2\s", result.stdout, re.M)
    assert re.search(r"^batch=2, seq=4\s+1\s", result.stdout, re.M)
    assert "runtime.stats()" in result.stdout


def test_schedule_forms():
    cycle, uniform, walk = parse_schedule(" batch=1, 4,16 ; seq=2..9;n=walk:1,2,4,8;")
    rng = random.Random(0)
    assert [next(d) for d in [cycle.draws(rng)] * 4] == [1, 4, 16, 1]
    assert all(2 <= v <= 9 for v, _ in zip(uniform.draws(rng), range(200)))
    steps = [v for v, _ in zip(walk.draws(rng), range(200))]
    values = list(walk.values)
    assert all(abs(values.index(a) - values.index(b)) == 1 for a, b in zip(steps, steps[1:]))
    assert set(steps) == set(values)


@pytest.mark.parametrize("schedule, expected", [
    ("batch=1..x", "bad --schedule part 'batch=1..x'"),
    ("batch=walk:", "bad --schedule part 'batch=walk:'"),
    ("batch=9..2", "empty range 9..2"),
    ("batch=1;batch=2", "names dim 'batch' twice"),
    ("seq=4", "'seq', which branchy does not have; its dynamic dims: batch"),
    ("batch=2000", "within its declared range 1..1024"),
])
def test_bad_schedule(branchy_dvm, capsys, schedule, expected):
    message = _error(capsys, 2, "run", str(branchy_dvm), "--calls", "1", "--schedule", schedule)
    assert expected in message


def test_file_errors(tmp_path, branchy_dvm, capsys):
    missing = str(tmp_path / "missing.dvm")
    assert "No such file" in _error(capsys, 2, "disasm", missing)
    assert "No such file" in _error(capsys, 2, "run", missing)
    truncated = tmp_path / "truncated.dvm"
    truncated.write_bytes(branchy_dvm.read_bytes()[:100])
    assert "truncated .dvm file" in _error(capsys, 2, "disasm", str(truncated))
    text = tmp_path / "text.dvm"
    text.write_text("hello")
    assert "not a .dvm file" in _error(capsys, 2, "run", str(text))
    out = str(tmp_path / "out.dvm")
    assert "No such file" in _error(capsys, 2, "asm", str(tmp_path / "x.txt"), "-o", out)
    bad = tmp_path / "bad.txt"
    bad.write_text(".program 'p'\n.regs 1\n     0  FROB %0\n")
    assert "line 3: unknown opcode 'FROB'" in _error(capsys, 1, "asm", str(bad), "-o", out)
    nowhere = str(tmp_path / "no" / "dir.dvm")
    assert "does not exist" in _error(capsys, 2, "compile", "branchy", "-o", nowhere)


def test_usage_errors(capsys):
    assert "known models: branchy, gnn" in _error(capsys, 2, "compile", "resnet")
    assert "neither a .dvm file nor a demo model" in _error(capsys, 2, "run", "resnet")
    assert "--calls: must be at least 1" in _error(capsys, 2, "run", "--calls", "0")
    assert "required: COMMAND" in _error(capsys, 2)
    if not torch.cuda.is_available():
        assert "no CUDA device" in _error(capsys, 2, "run", "branchy", "--device", "cuda")


def test_error_during_run(branchy_dvm, capsys, monkeypatch):
    def fail(self, *inputs):
        raise dynvm.ExecutionError("instruction 4 (LINEAR) failed: boom")

    monkeypatch.setattr(dynvm.Runtime, "__call__", fail)
    message = _error(capsys, 1, "run", str(branchy_dvm), "--schedule", "batch=3")
    assert message == "call 1 (batch=3): instruction 4 (LINEAR) failed: boom"


def test_errors_in_a_fresh_process(tmp_path):
    result = _cli("run", str(tmp_path / "missing.dvm"))
    assert result.returncode == 2
    assert result.stderr.startswith("dynvm: error: cannot read ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# ------------------------------------------------------------------ --trace, progress bars

_OTEL = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@pytest.fixture
def processors(monkeypatch):
    """The span processors every TracerProvider gets during the test (a spy around the
    real method), with the OTEL_* variables that would configure an exporter unset."""
    from opentelemetry.sdk.trace import TracerProvider

    for name in _OTEL:
        monkeypatch.delenv(name, raising=False)
    added = []
    real = TracerProvider.add_span_processor
    monkeypatch.setattr(TracerProvider, "add_span_processor",
                        lambda self, p: added.append(p) or real(self, p))
    return added


def test_no_exporter_configured_means_no_tracing(branchy_dvm, capsys, processors):
    from opentelemetry import trace

    assert main(["run", str(branchy_dvm), "--calls", "3", "--warmup", "0"]) == 0
    out, err = capsys.readouterr()
    assert processors == [] and "dynvm.call" not in out + err and "trace " not in out
    assert main(["explain", "branchy", "--shape", "batch=2"]) == 0
    assert processors == [] and "dynvm.compile" not in capsys.readouterr().err
    # The process-wide provider is never set: tracing stays with the Runtime it was given.
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_run_trace_prints_spans_on_stderr(branchy_dvm, capsys, processors):
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    argv = ["run", str(branchy_dvm), "--calls", "3", "--warmup", "1", "--trace"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    (processor,) = processors
    assert isinstance(processor, SimpleSpanProcessor)
    assert isinstance(processor.span_exporter, ConsoleSpanExporter)
    assert err.count('"name": "dynvm.call"') == 4  # one per call, warm-up included
    assert "dynvm.call" not in out and "trace     spans printed on stderr" in out
    assert re.search(r"^all calls\s+3\s", out, re.M)


def test_explain_trace_shows_the_compile(capsys, processors):
    assert main(["explain", "branchy", "--shape", "batch=2", "--trace"]) == 0
    out, err = capsys.readouterr()
    assert len(processors) == 1
    assert '"name": "dynvm.compile"' in err and '"name": "dynvm.install"' in err
    assert "dynvm.compile" not in out


def test_progress_bars_only_on_a_terminal(tmp_path):
    import fcntl
    import os
    import pty
    import struct
    import termios

    argv = [sys.executable, "-m", "dynvm", "run", "branchy", "--calls", "40", "--warmup", "0"]
    # The same command with its stderr piped, run meanwhile: each is a fresh Python that
    # imports torch and exports the model, mostly on one core.
    piped = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave) as child:
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        out = child.stdout.read().decode()
        assert child.wait(timeout=120) == 0
    os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert "compile branchy: export + lower (2/2)" in err
    assert re.search(r"calls: +\d+%\|.*\| \d+/40 ", err), err[-500:]
    assert "compile branchy" not in out and "calls:" not in out
    _, piped_err = piped.communicate(timeout=120)
    assert piped.returncode == 0 and piped_err == ""


# ------------------------------------------------------------------ dynvm top (no server)


def test_top_table_and_replica_totals():
    # The HTTP side runs against real Serve replicas in tests/cluster/test_metrics.py;
    # here the table is fed real Runtime.stats() as two named replicas would return them.
    from dynvm._top_cmd import Row, format_table, specialized_ratio, total
    from tests.jit._jit_helpers import compiled, eager_config

    stats = []
    for calls in (2, 5):
        with dynvm.Runtime(compiled("branchy"), jit=eager_config()) as runtime:
            for _ in range(calls):
                runtime(torch.randn(3, 32))
            stats.append({**runtime.stats().to_dict(), "requests": calls})
    stats[0]["latency_ms"] = {"p50": 1.234, "p99": 9.5}
    summed = total(stats)
    assert summed["calls"] == 7 and summed["requests"] == 7
    assert summed["compiles"] == stats[0]["compiles"] + stats[1]["compiles"] > 0
    rows = [Row("branchy", "r1", stats[0]), Row("branchy", "r2", stats[1]),
            Row("branchy", "all", summed), Row("gnn", "-", error="HTTP 404: unknown model")]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:4] == ["MODEL", "REPLICA", "CALLS", "REQS"]
    r1, r2, all_, gnn = (re.split(r"\s{2,}", line.strip()) for line in lines[1:])
    assert r1[:7] == ["branchy", "r1", "2", "2", f"{100 * specialized_ratio(stats[0]):.1f}",
                      "1.23", "9.50"]
    assert r2[5:7] == ["-", "-"] and all_[:4] == ["branchy", "all", "7", "7"]
    assert all_[4] == f"{100 * specialized_ratio(summed):.1f}" and all_[5:7] == ["-", "-"]
    assert gnn == ["gnn", "-", "HTTP 404: unknown model"]
    assert len({len(line) for line in lines[:4]}) == 1  # columns line up
