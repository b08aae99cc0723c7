"""A thread's time slice on Linux's EEVDF scheduler: the generator replica's two threads
that every step waits on ask for a short one (Note [Short slices for the step's threads]).

    from dynvm.cluster.serving._generate_slice import request_slice
    request_slice(0.0005)   # on the thread itself; False where the kernel has no say

Note [Short slices for the step's threads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A served generator's step is a chain of two threads: the scheduler's thread runs the
model (3.7-4 ms of CPU a step at the median, 8 clients on the bench's model) and Serve's
event loop writes the step's tokens to the streams; every running stream waits for
both. When the host has more runnable threads than cores (other processes, the client,
Ray's own), the kernel shares each core in slices, and a preempted scheduler thread
waits out another task's whole slice, sometimes several. That wait, not the step's
work, made the tail of the inter-token gaps: measured in a served replica (per-step
wall, thread CPU and run-queue wait from /proc schedstat), steps longer than 8.5 ms
were 12-15 ms of which 5-6 ms was run-queue wait at load 2.4-4 (docs/bench_log.md,
issue 33).

Since Linux 6.12 (EEVDF with custom slices) a SCHED_OTHER thread may ask for its own
slice through `sched_setattr`'s `sched_runtime` (0.1-100 ms), without privilege. Its
share of the CPU stays what its nice value gives it, but a shorter slice gives it
earlier virtual deadlines: it is picked sooner once runnable and preempts a task on a
longer slice (the default here is 1.4 ms). The thread then waits more often and each
wait is short, instead of rarely and long: the p99 of a step, its CPU plus the waits in
it, comes close to its median. Measured with 4 replicas in one Ray cluster taking
passes in turn (8 clients, 96 requests, 6 passes each, load 1.5-3.1, 17:40 UTC):

| slice (both threads) | run-queue wait p99 | step period p50 / p99 | ITL p99/p50 | tokens/s |
|---|---:|---:|---|---:|
| kernel's, 1.4 ms | 4.24 ms | 4.53 / 10.82 ms | 1.86-2.69 | 1193-1394 |
| 0.5 ms | 1.38 | 4.28 / 8.19 | 2.04-2.22 | 1392-1481 |
| 0.2 ms | 2.38 | 4.40 / 8.91 | 1.99-2.40 | 1330-1478 |

The client's ratio moves less than the step's tail does. In bench.serve_generate's own
A/B (`--thread-slice-ms 0,0.5 --passes 4`, CTranslate2 in the same passes), the
per-pass ITL p99/p50 at the kernel's slice / at 0.5 ms was:
- load 3.0-3.3 (18:01 UTC): 3.61 / 2.01, 1.85 / 2.11, 2.35 / 3.76 (a host stall),
  2.34 / 1.99;
- load 1.3-1.7 (18:33 UTC): 2.06 / 2.25, 1.71 / 1.68, 1.71 / 1.78, 2.17 / 2.29. Here
  run-queue waits are not the tail, and the two are the same.

Kernels without custom slices ignore the field for SCHED_OTHER; other systems have no
such call, and `request_slice` returns False there, changing nothing. A thread that
someone put on another policy (real-time, batch) is left alone.
"""

from __future__ import annotations

import os
import platform
import struct

# sched_setattr's syscall number per machine (include/uapi/asm-generic/unistd.h and
# arch/x86/entry/syscalls/syscall_64.tbl).
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
# struct sched_attr (include/uapi/linux/sched/types.h): size, policy, flags, nice,
# priority, runtime, deadline, period (ns), util_min, util_max.
_SCHED_ATTR = "IIQiIQQQII"
SCHED_OTHER = 0
SLICE_MIN_S, SLICE_MAX_S = 0.0001, 0.1   # what the kernel accepts for a fair task


def request_slice(seconds: float) -> bool:
    """Ask the kernel for a time slice of `seconds` (clamped to 0.1-100 ms) for the
    calling thread, keeping its policy (SCHED_OTHER) and nice value (Note [Short slices
    for the step's threads]). True when the call succeeded; False off Linux, on an
    unknown machine, or when the kernel refused (nothing changes then)."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not hasattr(os, "sched_getscheduler") or seconds <= 0:
        return False
    import ctypes

    try:
        if os.sched_getscheduler(0) != SCHED_OTHER:
            return False   # a real-time or batch thread: someone chose its policy
        slice_ns = int(min(max(seconds, SLICE_MIN_S), SLICE_MAX_S) * 1e9)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        attr = struct.pack(_SCHED_ATTR, struct.calcsize(_SCHED_ATTR), SCHED_OTHER, 0,
                           nice, 0, slice_ns, 0, 0, 0, 0)
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(number, 0, ctypes.create_string_buffer(attr), 0) == 0
    except (OSError, AttributeError):
        return False


def thread_slice() -> float | None:
    """The calling thread's slice in seconds as the kernel reports it (`se.slice` in
    /proc/thread-self/sched), None where it reports none."""
    try:
        with open("/proc/thread-self/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1]) / 1e9
    except (OSError, ValueError):
        return None
    return None
