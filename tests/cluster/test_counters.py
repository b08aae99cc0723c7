"""The serving counters are typed (dynvm.cluster._counters) and their JSON keys, which
/stats serves and `dynvm top` and Prometheus read, are the ones they always were."""

from __future__ import annotations

import asyncio

import pytest

from dynvm._runtime_stats import RuntimeStats
from dynvm.cluster._counters import (
    BatcherCounters,
    ExecCounters,
    LinkCounters,
    RequestCounters,
    as_dict,
    field_of,
    read,
)
from dynvm.cluster.serving._batcher import OpportunisticBatcher
from dynvm.cluster.serving._metrics import Series
from dynvm.cluster.serving.serving_config import BatchingOptions

# The wire keys before the counters were typed (the dicts' keys, in their order).
WIRE_KEYS = {
    RequestCounters: ["requests", "errors", "rejected_busy"],
    ExecCounters: ["vm_calls", "batches", "batched_vm_calls", "batched_requests",
                   "max_requests_per_vm_call", "unbatched_fallbacks"],
    BatcherCounters: ["batches", "batched_requests", "max_batch_requests", "held_batches",
                      "split_batches", "rejected_overload", "recorded_batches",
                      "specialized_batches", "inline_batches"],
    LinkCounters: ["reported", "records", "reports", "dropped_observations",
                   "service_failures", "backoffs", "registrations", "installed",
                   "install_rejected", "announcements", "announcements_dropped",
                   "warm_start_installs", "index_reads_skipped", "index_stamps_followed",
                   "index_rejected"],
}


@pytest.mark.parametrize("kind", list(WIRE_KEYS), ids=lambda k: k.__name__)
def test_the_json_keys_are_the_old_ones(kind):
    assert list(as_dict(kind())) == WIRE_KEYS[kind]
    assert set(as_dict(kind()).values()) == {0}


def test_a_batchers_stats_after_real_batches():
    ran = []

    def execute(items):
        ran.append(len(items))
        return [item * 2 for item in items]

    batcher = OpportunisticBatcher(execute, BatchingOptions(max_delay_s=0.0))

    async def go():
        return await asyncio.gather(*(batcher.submit(i, 1, None) for i in range(5)))

    try:
        assert asyncio.run(go()) == [0, 2, 4, 6, 8]
        batcher.record(2, specialized=True)
        batcher.record(3, specialized=False)
        stats = batcher.stats()
    finally:
        batcher.close()
    assert list(stats) == [*WIRE_KEYS[BatcherCounters], "specialized_batch_ratio",
                           "hot_sizes", "queued"]
    assert stats["batches"] == batcher.counters.batches == len(ran)
    assert stats["batched_requests"] == 5 and stats["max_batch_requests"] == max(ran)
    assert (stats["specialized_batch_ratio"], stats["hot_sizes"], stats["queued"]) \
        == (0.5, [2], 0)


def test_exec_counters_add_sums_and_keeps_the_largest_batch():
    total = ExecCounters()
    total.add(ExecCounters(vm_calls=1, batches=1, batched_vm_calls=1, batched_requests=4,
                           max_requests_per_vm_call=4))
    total.add(ExecCounters(vm_calls=3, batches=1, max_requests_per_vm_call=1,
                           unbatched_fallbacks=1))
    assert total == ExecCounters(vm_calls=4, batches=2, batched_vm_calls=1,
                                 batched_requests=4, max_requests_per_vm_call=4,
                                 unbatched_fallbacks=1)


def test_reading_back_is_tolerant_and_typed():
    doc = {"requests": 7, "errors": True, "calls": 3, "specialized_region_calls": 3,
           "interpreted_region_calls": 1, "extra_key": "ignored"}
    assert read(RequestCounters, doc) == RequestCounters(requests=7, errors=None,
                                                         rejected_busy=None)
    runtime = read(RuntimeStats, doc)
    assert (runtime.calls, runtime.compiles, runtime.specialized_ratio) == (3, None, 0.75)
    assert read(RequestCounters, None) == RequestCounters(None, None, None)


def test_a_reader_naming_a_missing_field_fails_when_it_is_defined():
    assert field_of(RequestCounters, "errors") == "errors"
    with pytest.raises(AttributeError, match="no field 'error'"):
        field_of(RequestCounters, "error")
    with pytest.raises(AttributeError, match="request"):
        Series("dynvm_requests", "Inference requests received.", requests="request")
    with pytest.raises(AttributeError, match="compile"):
        Series("dynvm_compiles", "Specializations compiled.", "compile")
    Series("dynvm_specialized_ratio", "a derived figure is an attribute too",
           "specialized_ratio")


def test_dynvm_top_reads_the_request_counters_through_their_type():
    from dynvm import _top_cmd
    from dynvm.cluster.serving.serving_config import HTTP_PORT

    assert _top_cmd._request_counters({"requests": 3, "errors": 1}) == RequestCounters(
        requests=3, errors=1, rejected_busy=None)
    assert set(_top_cmd._SUMMED[-2:]) <= set(WIRE_KEYS[RequestCounters])
    assert _top_cmd.default_url() == f"http://127.0.0.1:{HTTP_PORT}"
