"""The replica's execution and fault handling without Serve (the class itself; its HTTP
layer is covered by test_replica_http.py): batchability is decided once (Note
[Batchability decided once]), and a model call's error is told client from server
fault, a server fault's id reaching the request's trace (Note [Client or server fault])."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.cluster import ServingConfig
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._http_errors import ERROR_ID_HEADER
from dynvm.cluster.serving._infer_seam import is_client_fault
from dynvm.cluster.serving._replica import ReplicaServer
from dynvm.telemetry import Telemetry
from dynvm.vm.interpreter import Interpreter
from tests.vm._programs import build

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class ColumnSums(torch.nn.Module):
    """Outputs without the batch dim: rows are summed together."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0).sum(0)


def _replica(tmp_path, probe_outputs: bool):
    path = tmp_path / "sums.dvm"
    if not path.exists():
        program = dynvm.compile(ColumnSums(), (torch.randn(4, 3),),
                                ({0: Dim("batch", min=1, max=16)},), name="sums")
        dynvm.save(program, path)
    cls = ReplicaServer  # the class itself, without Serve
    return cls("sums", str(path), ServingConfig(device="cpu", jit=False),
               probe_outputs=probe_outputs)


def _request(replica, rows: list[list[float]]) -> v2.InferRequest:
    body = {"inputs": [{"name": replica.program.inputs[0].name, "datatype": "FP32",
                        "shape": [len(rows), 3], "data": [v for r in rows for v in r]}]}
    return v2.parse_infer_request(json.dumps(body).encode(), replica.program.inputs)


def _two_requests(replica):
    # 1 + 3 rows: a batch of 4 whose output (3 column sums) cannot pass for 4 rows.
    return [_request(replica, [[1, 2, 3]]),
            _request(replica, [[1, 1, 1], [2, 2, 2], [3, 3, 3]])]


def test_outputs_without_the_batch_dim_are_never_batched_when_the_probe_says_so(tmp_path):
    replica = _replica(tmp_path, probe_outputs=True)
    assert replica.executor.batch_dim is None  # the probe saw dim 0 vanish
    outcomes, counts = replica.executor.run_batch(_two_requests(replica), [None, None])
    assert counts.vm_calls == 2 and counts.unbatched_fallbacks == 0
    assert [o.outputs[0].tolist() for o in outcomes] == [[2.0, 4.0, 6.0], [12.0, 12.0, 12.0]]


def test_without_a_probe_a_thrown_away_batch_happens_once(tmp_path):
    replica = _replica(tmp_path, probe_outputs=False)
    assert replica.executor.batch_dim == ("batch", 16)
    first, counts = replica.executor.run_batch(_two_requests(replica), [None, None])
    assert counts.unbatched_fallbacks == 1 and counts.vm_calls == 3
    second, counts = replica.executor.run_batch(_two_requests(replica), [None, None])
    assert counts.unbatched_fallbacks == 0 and counts.vm_calls == 2
    for outcomes in (first, second):
        assert [o.outputs[0].tolist() for o in outcomes] == [[2.0, 4.0, 6.0],
                                                             [12.0, 12.0, 12.0]]


def _execution_error(program, inputs) -> dynvm.ExecutionError:
    with pytest.raises(dynvm.ExecutionError) as info:
        Interpreter(program).run(inputs)
    return info.value


class PairSums(torch.nn.Module):
    """A row of 8*k features summed in pairs: [batch, 8*k] -> [batch, 4*k]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1, 2).sum(-1)


def test_the_start_up_probe_respects_derived_dims(tmp_path):
    # The probe's second run bumps each root by one: a size `low + 1` of a dim 8*k is
    # off its grid, the program refuses it, and the replica started without output
    # metadata or a batchability check (Note [Batchability decided once]).
    path = tmp_path / "pairs.dvm"
    k = Dim("k", min=1, max=8)
    program = dynvm.compile(PairSums(), (torch.randn(4, 16),),
                            ({0: Dim("batch", min=1, max=16), 1: 8 * k},), name="pairs")
    assert program.inputs[0].dims[1].is_derived
    dynvm.save(program, path)
    replica = ReplicaServer("pairs", str(path), ServingConfig(device="cpu", jit=False))
    assert replica.executor.batch_dim is not None   # both probes ran: rows follow dim 0
    assert [(m.datatype, m.shape) for m in replica.outputs_meta] == [("FP32", (-1, -1))]


def test_client_and_server_faults_are_told_apart():
    lookup = build("""
        0  %1 = EMBEDDING c0, %0, -1
        1  RETURN {%1}
    """, constants=(torch.randn(10, 4),), regs=2, inputs=('"idx" int64 [n:1..64]',),
        consts=('"table" float32 [10, 4]',))
    bad_index = _execution_error(lookup, [torch.tensor([3, 12])])
    branch = build("""
        0  %1 = GT %0, 0
        1  JUMP_IF_FALSE %1, @3
        2  RETURN {%0}
        3  RETURN {%1}
    """, regs=2)
    program_fault = _execution_error(branch, [torch.ones(3)])
    assert is_client_fault(bad_index)           # the request's data indexes past the table
    assert not is_client_fault(program_fault)   # the program's own failure: a 500
    assert is_client_fault(dynvm.ShapeError("input 'x': dim 0 is 99, outside [1, 64]"))
    assert not is_client_fault(RuntimeError("boom"))


def test_a_server_faults_error_id_is_in_the_requests_trace(tmp_path):
    replica = _replica(tmp_path, probe_outputs=False)
    telemetry, spans = Telemetry.in_memory()
    replica.seam.gate.telemetry = telemetry
    fault = replica.seam.fault(RuntimeError("boom"), {"traceparent": PARENT})
    response = replica._fault_response(fault)
    assert response.status_code == 500
    error_id = response.headers[ERROR_ID_HEADER]
    assert f"error id {error_id}" in json.loads(response.body)["error"]
    (span,) = [s for s in spans.get_finished_spans() if s.name == "dynvm.request.error"]
    assert span.attributes["dynvm.error_id"] == error_id
    assert format(span.context.trace_id, "032x") == TRACE_ID


class _GrpcStatus:
    """The part of Serve's grpc_context that the gRPC RPCs use: a call's status."""

    code = details = None

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details

    def invocation_metadata(self):
        return ()


def test_both_transports_run_through_one_seam_with_their_own_encoder(tmp_path):
    """The executor encodes a small response with the transport's encoder on the worker
    thread: a gRPC request gets its ModelInferResponse from there and no HTTP body is
    built for it; a model's client fault is one Fault that HTTP answers 400 and gRPC
    INVALID_ARGUMENT, with the same message; both are counted in the same counters."""
    pytest.importorskip("tritonclient.grpc")
    import grpc

    from dynvm.cluster.protocol._http_front import HttpEncoder
    from dynvm.cluster.protocol._seam import FaultKind
    from dynvm.cluster.protocol.grpc_v2 import GrpcEncoder, protos

    replica = _replica(tmp_path, probe_outputs=True)
    rows = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]

    async def submit(encoder):
        return await replica.executor.submit(_request(replica, rows), None, encoder)

    grpc_outcome = asyncio.run(submit(GrpcEncoder("sums")))
    assert isinstance(grpc_outcome.response, protos().ModelInferResponse)
    expected = ColumnSums()(torch.tensor(rows)).flatten().tolist()
    (raw,) = grpc_outcome.response.raw_output_contents
    assert torch.frombuffer(bytearray(raw), dtype=torch.float32).tolist() == expected
    body, _ = asyncio.run(submit(HttpEncoder("sums"))).response
    assert json.loads(body)["outputs"][0]["data"] == expected

    message = protos().ModelInferRequest(model_name="sums")
    message.inputs.add(name=replica.program.inputs[0].name, datatype="FP32", shape=[1, 5])
    message.raw_input_contents.append(torch.ones(1, 5).numpy().tobytes())
    context = _GrpcStatus()
    before = replica.request_stats.counters.errors
    asyncio.run(replica.ModelInfer(message, grpc_context=context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    fault = replica.seam.fault(dynvm.ShapeError("input 'x': dim 1 is 5, expected 3"), None)
    assert fault.kind is FaultKind.CLIENT
    assert fault.message == "model 'sums': input 'x': dim 1 is 5, expected 3"
    response = replica._fault_response(fault)
    assert response.status_code == 400
    assert json.loads(response.body)["error"] == fault.message
    assert replica.request_stats.counters.errors == before + 2
    replica.executor.close()
