"""The benchmarks' ONNX peers (bench/peers.py, Note [ONNX peers]): ONNX Runtime and
OpenVINO, really exported and really run, give eager's results at shapes other than the
export's (the dims stayed dynamic), the suite's system wraps them, and what cannot run
says why. Skipped where the bench extra is not installed."""

from __future__ import annotations

import random

import pytest
import torch
from torch.export import Dim

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from bench.peers import PEER_SYSTEMS, Peer, PeerUnavailable  # noqa: E402


class _Block(torch.nn.Module):
    """A masked attention block (linear, softmax over a padded mask, layer norm, GELU):
    the op kinds the full-width benchmark times, at a tiny width."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / 4.0
        scores = scores.masked_fill(mask[:, None, :] == 0, -1e4)
        return self.norm(x + torch.nn.functional.gelu(self.out(scores.softmax(-1) @ v)))


def _inputs(batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 16, generator=gen)
    lengths = torch.randint((seq + 1) // 2, seq + 1, (batch,), generator=gen)
    return x, (torch.arange(seq)[None, :] < lengths[:, None]).long()


DYNAMIC = ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=64)},
           {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=64)})


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return _Block().eval()


@pytest.mark.parametrize("name,tolerance", [("onnxruntime", 1e-5), ("openvino", 1e-5),
                                            ("onnxruntime-int8", 0.1)])
def test_peer_matches_eager_at_shapes_it_was_not_exported_at(model, name, tolerance):
    pytest.importorskip(name.split("-")[0])
    peer = Peer(name, model, _inputs(2, 8, 0), DYNAMIC, threads=1)
    try:
        assert peer.exporter in ("dynamo", "torchscript")
        assert peer.setup_seconds > 0
        for batch, seq in ((1, 5), (3, 13), (8, 64)):
            x = _inputs(batch, seq, batch + seq)
            with torch.inference_mode():
                expected = model(*x)
            (out,) = peer(*x)
            assert out.shape == expected.shape
            torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    finally:
        peer.close()


def test_suite_system_wraps_the_peer(model):
    pytest.importorskip("onnxruntime")
    from bench.systems import LABELS, SYSTEMS, make
    from dynvm.models import DemoModel

    assert set(PEER_SYSTEMS) <= set(SYSTEMS) and set(PEER_SYSTEMS) <= set(LABELS)
    demo = DemoModel("block", model, _inputs(2, 8, 0), DYNAMIC,
                     lambda rng: _inputs(rng.randint(1, 4), rng.randint(2, 20), 7))
    system = make("onnxruntime", demo)
    try:
        x = demo.sample_inputs(random.Random(0))
        out, seconds = system(*x)
        with torch.inference_mode():
            torch.testing.assert_close(out, model(*x), rtol=1e-5, atol=1e-5)
        assert seconds > 0 and system.calls == 1
        assert system.extra()["exporter"] in ("dynamo", "torchscript")
    finally:
        system.close()


def test_unknown_peer_and_unexportable_model_say_why(model):
    with pytest.raises(KeyError, match="known: onnxruntime"):
        Peer("tensorrt", model, _inputs(2, 8, 0), DYNAMIC)

    class Untraceable(torch.nn.Module):
        def forward(self, x, mask):
            raise NotImplementedError("no graph to export")

    pytest.importorskip("onnxruntime")
    with pytest.raises(PeerUnavailable, match="does not export to ONNX"):
        Peer("onnxruntime", Untraceable(), _inputs(2, 8, 0), DYNAMIC)


def test_zoo_report_states_a_peer_that_did_not_run():
    from bench import zoo_report

    rows = [{"name": "bert", "jit_x_eager": 0.5, "onnx_peers": {
        "onnxruntime": {"x_eager": 0.25, "setup_seconds": 3.0, "exporter": "dynamo",
                        "version": "1.32.0", "max_abs_error": 1e-6},
        "openvino": {"unavailable": "openvino is not installed: pip install ..."}}}]
    table = zoo_report._onnx_table(rows)
    assert "| bert | 0.50x | onnxruntime | 0.25x | 2.00 |" in table
    assert "| bert | | openvino | | | | | not run: openvino is not installed" in table


def test_bench_zoo_times_a_peer_beside_the_jit(tmp_path):
    import json

    pytest.importorskip("onnxruntime")
    pytest.importorskip("transformers")
    from dynvm.cli import main

    assert main(["bench", "zoo", "--models", "bert", "--peers", "onnxruntime", "--quick",
                 "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["models"]
    peer = row["onnx_peers"]["onnxruntime"]
    assert peer["x_eager"] > 0 and peer["setup_seconds"] > 0
    assert peer["max_abs_error"] < 1e-4, peer
    report = (tmp_path / "report.md").read_text()
    assert "## Against ONNX Runtime and OpenVINO" in report
    assert f"| bert | {row['jit_x_eager']:.2f}x | onnxruntime |" in report
