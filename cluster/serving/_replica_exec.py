"""A replica's model execution: the Runtime behind an `OpportunisticBatcher`, batches
split back per request, each request's outcome (Note [Request batching] in
dynvm.cluster.serving._replica). No transport here: HTTP and gRPC hand it validated
`v2.InferRequest`s, each with its transport's `Encoder` (dynvm.cluster.protocol._seam),
through dynvm.cluster.serving._infer_seam.

Note [Batchability decided once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Requests are concatenated along dim 0 only when every input's dim 0 is the same dynamic
dim and every output carries it as its dim 0 too. The first is read from the program's
signature; the second from the start-up probe (two zero-input runs whose batch sizes
differ): a model whose outputs lack the batch dim (a mean over the batch, a fixed-size
summary) is served request by request from the start. Only when the probe could not run
(a model that rejects zeros) is it learnt from the first batched call, and remembered:
a batch is never run and thrown away more than once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from opentelemetry import context as otel_context
from opentelemetry import propagate
from torch.utils import _pytree as pytree

from dynvm.cluster._counters import ExecCounters
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._seam import Encoder
from dynvm.cluster.serving._batcher import OpportunisticBatcher
from dynvm.cluster.serving.serving_config import ServingConfig
from dynvm.vm.budget import CallBudget
from dynvm.vm.errors import CallBudgetError
from dynvm.vm.isa import Flow

logger = logging.getLogger("dynvm.cluster.serving._replica")

# Responses of at most this many output elements are encoded on the model's worker
# thread right after the batch (Note [Lean request path]); larger ones on the parse
# threads, so that a big JSON encode does not hold the model.
WORKER_ENCODE_ELEMENTS = 4096


@dataclass
class Outcome:
    """What a request gets back from its batch: outputs or the error to raise."""

    outputs: list[torch.Tensor] | None = None
    error: BaseException | None = None
    response: Any = None   # the transport's response, encoded on the worker thread


def time_follows_shapes(program) -> bool:
    """Whether a call's work is decided by its input shapes: no loop, no branch and no
    op whose output size depends on values (Note [Inline fast batches] in
    dynvm.cluster.serving._batcher: only such a program's fast calls may run on the loop)."""
    return not any(instr.spec.flow in _CONTROL or instr.spec.data_dependent
                   for instr in program.code)


_CONTROL = (Flow.JUMP, Flow.BRANCH_IF_FALSE)


def find_batch_dim(program) -> tuple[str, int] | None:
    """(name, high) of the dynamic dim 0 every input shares, or None."""
    names = set()
    high = None
    for spec in program.inputs:
        if not spec.dims or spec.dims[0].is_static:
            return None
        names.add(spec.dims[0].name)
        high = spec.dims[0].high if high is None else min(high, spec.dims[0].high)
    if len(names) != 1 or high is None:
        return None
    return names.pop(), high


@contextlib.contextmanager
def _attached(context):
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


class ReplicaExecutor:
    """Runs a replica's requests on its Runtime, batched (module docstring). `submit`
    lives on the replica's event loop; everything else runs on the batcher's worker."""

    def __init__(self, model_name: str, program, runtime, device: str,
                 config: ServingConfig, probe_outputs: bool = True) -> None:
        self.model_name = model_name
        self.program = program
        self.runtime = runtime
        self.device = device
        self._budget = config.limits.call_budget()
        self.batch_dim = find_batch_dim(program) if config.batching.enabled else None
        self.outputs_meta: list[v2.TensorMetadata] = []
        if probe_outputs:
            self.outputs_meta = self._probe_outputs()
        self.batcher = OpportunisticBatcher(
            self._execute, config.batching,
            high_rows=self.batch_dim[1] if self.batch_dim is not None else None,
            inline=time_follows_shapes(program))
        # Bumped only on the worker thread (Note [Lean request path]).
        self.counters = ExecCounters()

    # ------------------------------------------------------------------ start-up

    def _probe_inputs(self, bump: bool) -> list[torch.Tensor]:
        # Each dynamic dim's root takes its lowest value (or the next one) that every dim
        # of that root allows; a derived dim's size follows from it (Note [Derived dims]
        # in dynvm.vm.input_check): `low + 1` of a dim `8*k` is not a size it may have.
        bounds: dict[str, tuple[int, int]] = {}
        for spec in self.program.inputs:
            for d in spec.dims:
                if not d.is_static:
                    low, high = d.root_range()
                    known = bounds.get(d.name, (low, high))
                    bounds[d.name] = (max(low, known[0]), min(high, known[1]))
        roots = {name: min(low + 1, high) if bump else low
                 for name, (low, high) in bounds.items()}
        return [torch.zeros([d.low if d.is_static else d.scale * roots[d.name] + d.offset
                             for d in spec.dims], dtype=spec.dtype, device=self.device)
                for spec in self.program.inputs]

    def _probe_outputs(self) -> list[v2.TensorMetadata]:
        """Output datatypes and shapes (-1 where they vary) from two zero-input runs;
        they also decide whether outputs carry the batch dim (Note [Batchability decided
        once])."""
        try:
            inputs = [self._probe_inputs(bump) for bump in (False, True)]
            probes = [self.run(tensors) for tensors in inputs]
        except Exception:  # a model that rejects zeros: learnt from the first batch
            return []
        if self.batch_dim is not None:
            for tensors, outputs in zip(inputs, probes, strict=True):
                if not self._outputs_follow_rows(outputs, tensors[0].shape[0]):
                    self.batch_dim = None
                    break
        return v2.output_metadata_from_probes(probes)

    @staticmethod
    def _outputs_follow_rows(outputs: Sequence[torch.Tensor], rows: int) -> bool:
        return all(o.dim() >= 1 and o.shape[0] == rows for o in outputs)

    # ------------------------------------------------------------------ running

    def run(self, tensors: Sequence[torch.Tensor],
            budget: CallBudget | None = None) -> list[torch.Tensor]:
        """One Runtime call; the outputs as CPU tensors."""
        inputs = [t.to(self.device) for t in tensors]
        result = self.runtime(*inputs, budget=budget or self._budget)
        outputs = []
        for leaf in pytree.tree_leaves(result):
            if not isinstance(leaf, torch.Tensor):
                leaf = torch.tensor(leaf)
            outputs.append(leaf.detach().to("cpu"))
        return outputs

    def _run_recorded(self, tensors: Sequence[torch.Tensor],
                      budget: CallBudget | None = None) -> list[torch.Tensor]:
        """`run`, telling the batcher whether this row count ran entirely specialized
        (what shape-aware batching learns from, Note [Opportunistic batching])."""
        if self.batch_dim is None:
            return self.run(tensors, budget)
        specialized, interpreted = self.runtime.region_calls()
        outputs = self.run(tensors, budget)
        now_specialized, now_interpreted = self.runtime.region_calls()
        self.batcher.record(tensors[0].shape[0], now_interpreted == interpreted
                            and now_specialized > specialized)
        return outputs

    def _run_one(self, tensors: Sequence[torch.Tensor],
                 budget: CallBudget | None = None) -> Outcome:
        try:
            return Outcome(outputs=self._run_recorded(tensors, budget))
        except Exception as exc:  # handed to this request's caller
            return Outcome(error=exc)

    def _groups(self, requests: Sequence[v2.InferRequest]) -> list[list[int]]:
        """Indices of requests that can share one VM call, in arrival order."""
        if self.batch_dim is None:
            return [[i] for i in range(len(requests))]
        _, high = self.batch_dim
        groups: list[list[int]] = []
        keys: list[tuple] = []
        rows: list[int] = []
        for i, req in enumerate(requests):
            key = tuple((t.dtype, tuple(t.shape[1:])) for t in req.tensors)
            n = req.tensors[0].shape[0]
            for g, group in enumerate(groups):
                if keys[g] == key and rows[g] + n <= high:
                    group.append(i)
                    rows[g] += n
                    break
            else:
                groups.append([i])
                keys.append(key)
                rows.append(n)
        return groups

    def _trace_parent(self, carrier: dict | None):
        """Run a VM call as a child of the request's W3C trace context, if any."""
        if carrier is None or self.runtime.telemetry is None:
            return contextlib.nullcontext()
        return _attached(propagate.extract(carrier))

    def run_batch(self, requests: Sequence[v2.InferRequest],
                  traces: Sequence[dict | None]) -> tuple[list[Outcome], ExecCounters]:
        """One VM call per group, split back per request, and this batch's counts. A
        batched call joins the trace of its first request (a span has one parent)."""
        outcomes: list[Outcome | None] = [None] * len(requests)
        counts = ExecCounters(max_requests_per_vm_call=1)
        for group in self._groups(requests):
            with self._trace_parent(traces[group[0]]):
                self._run_group(requests, traces, group, outcomes, counts)
        return [o if o is not None else Outcome(error=RuntimeError("not run"))
                for o in outcomes], counts

    def _run_group(self, requests, traces, group: list[int], outcomes: list,
                   counts: ExecCounters) -> None:
        """One batched VM call for `group`, or one call per request when batching does
        not apply or fails; fills `outcomes` and `counts`. After a batched call that ran
        past its budget, the re-runs share one budget between them (each gets its share),
        so that a runaway request holds the worker for about two budgets, not one per
        request of its batch (Note [Call budget])."""
        budget = None
        if len(group) > 1:
            sizes = [requests[i].tensors[0].shape[0] for i in group]
            total = sum(sizes)
            try:
                cat = [torch.cat([requests[i].tensors[k] for i in group])
                       for k in range(len(self.program.inputs))]
                outputs = self._run_recorded(cat)
                counts.vm_calls += 1
                if self._outputs_follow_rows(outputs, total):
                    pieces = [o.split(sizes) for o in outputs]
                    for j, i in enumerate(group):
                        outcomes[i] = Outcome(outputs=[p[j].clone() for p in pieces])
                    counts.batched_vm_calls += 1
                    counts.batched_requests += len(group)
                    counts.max_requests_per_vm_call = max(counts.max_requests_per_vm_call,
                                                          len(group))
                    return
                # Only when the start-up probe could not tell: never again.
                logger.warning("model %r: outputs do not carry the batch dim; serving it "
                               "request by request from now on", self.model_name)
                self.batch_dim = None
            except CallBudgetError:
                budget = dataclasses.replace(
                    self._budget, seconds=self._budget.seconds / len(group))
            except Exception:  # each request re-runs below and gets its own error
                pass
            counts.unbatched_fallbacks += 1
        for i in group:
            with self._trace_parent(traces[i]):
                outcomes[i] = self._run_one(requests[i].tensors, budget)
            counts.vm_calls += 1

    def _execute(self, items: list[tuple[v2.InferRequest, dict | None, Encoder | None]]
                 ) -> list[Outcome]:
        """One batch, on the batcher's worker thread (Note [Opportunistic batching]); small
        responses are encoded here by their transport's encoder, in the same hop (Note
        [Lean request path])."""
        requests = [request for request, _, _ in items]
        traces = [trace for _, trace, _ in items]
        outcomes, counts = self.run_batch(requests, traces)
        for (request, _, encoder), outcome in zip(items, outcomes, strict=True):
            outputs = outcome.outputs
            if encoder is not None and outputs is not None \
                    and sum(o.numel() for o in outputs) <= WORKER_ENCODE_ELEMENTS:
                # A ProtocolError is raised again, as a 4xx, by the seam's own encode.
                with contextlib.suppress(v2.ProtocolError):
                    outcome.response = encoder.encode(outputs, request)
        counts.batches = 1
        self.counters.add(counts)
        return outcomes

    async def submit(self, request: v2.InferRequest, trace: dict | None,
                     encoder: Encoder | None = None) -> Outcome:
        """`request`'s outcome once its batch has run (on the replica's event loop), its
        response encoded by `encoder` when small; raises Overloaded when the batcher's
        queue is full."""
        tensors = request.tensors
        if self.batch_dim is not None and tensors:
            rows = tensors[0].shape[0]
            key = signature = tuple((t.dtype, tuple(t.shape[1:])) for t in tensors)
        else:
            rows, key = 1, None
            signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        return await self.batcher.submit((request, trace, encoder), rows, key,
                                         sum(t.nbytes for t in tensors), signature)

    def close(self) -> None:
        """Stop the worker thread once the batch it runs (if any) ends."""
        self.batcher.close()
