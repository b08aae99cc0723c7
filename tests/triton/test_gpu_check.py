"""bench/gpu_check.py in its CPU mode, with tiny sizes, so the prepared GPU check cannot
rot between the runs on a GPU: kernels interpreted, stored sm_90 artifacts loaded with
Triton's compiler forbidden and launched through the fake device boundary, and a short
walk of eager, the interpreter and the JIT with CUDA graphs (none captured on a CPU).
torch.compile's systems are left out here (minutes of Inductor builds on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ["eager", "dynvm-interp", "dynvm-jit-graphs"]


@pytest.mark.slow
def test_gpu_check_runs_in_cpu_mode(tmp_path):
    out = tmp_path / "gpu_check"
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu",
               "--calls", "4", "--warmup", "1", "--members", "1", "--batches", "1,4",
               "--cases", "softmax-rows",
               "--systems", ",".join(SYSTEMS), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [r["case"] for r in report["kernels"]] == ["softmax-rows"]
    assert all(r["ok"] for r in report["kernels"])
    assert [(r["how"], r["target"]) for r in report["stored"]] == [
        ("cubin", "cuda:90"), ("ptx", "cuda:80")]
    for row in report["stored"]:
        assert row["ok"] and row["compiler_calls"] == [] and row["launches"] >= 1
    systems = report["walk"]["systems"]
    assert list(systems) == SYSTEMS
    for entry in systems.values():
        assert len(entry["latency_s"]) == 4
        assert max(entry["max_abs_err_vs_eager"].values()) < 1e-3
    assert systems["dynvm-jit-graphs"]["cuda_graphs"] == 0        # CUDA only
    text = (out / "gpu_check.md").read_text()
    assert "## Stored artifacts, loaded without compiling" in text
    assert "dynvm JIT (cpu backend) + CUDA graphs (0 captured)" in text
