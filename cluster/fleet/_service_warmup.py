"""Warming a compile service shard's compile path before the first shape is sighted.

Note [Warm compile service]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The first compile in a fresh process runs the specializer's abstract evaluation (meta
tensors) for the first time, and torch's first meta decomposition of a linear layer
(addmm) imports torch._dynamo on use: ~900 modules. Measured in the fleet simulator
(bench/fleet_sim.py, 2 shared cores, load 5-6): each new shard's first compile took
3.2-5.8 s against a median of 30-70 ms for the others, and with one compile worker per
shard every shape promoted meanwhile waited behind it: at N = 1000 the median shape
waited 5.2 s in the queue for 68 ms of compiling, at N = 10 it was most of the 3.8 s
from sighting to installed. A shard (re)started mid-traffic pays the same.

So a shard evaluates a few ops on meta tensors on a background thread as it starts,
before any replica has registered a program: the imports happen while nothing waits
for them. A compile that starts before the warm-up finishes waits on Python's import
lock for the rest of it, never longer than it would have alone. What is warmed is
torch's lazy loading, not dynvm's state: nothing is compiled, cached or published.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


def warm_meta_evaluation() -> float:
    """Run the meta kernels the specializer meets first (linear, matmul, layer norm,
    softmax), importing what torch loads on their first use; returns the seconds."""
    import torch

    start = time.perf_counter()
    meta = torch.device("meta")
    x = torch.empty(2, 4, 8, device=meta)
    weight = torch.empty(16, 8, device=meta)
    hidden = torch.nn.functional.linear(x, weight, torch.empty(16, device=meta))
    scores = torch.matmul(hidden, hidden.transpose(-1, -2)).softmax(-1)
    torch.nn.functional.layer_norm(scores, (4,))
    return time.perf_counter() - start


class Warmup:
    """`warm_meta_evaluation` on a daemon thread; `seconds` once it is done."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="dynvm-warmup", daemon=True)

    def start(self) -> Warmup:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.seconds = warm_meta_evaluation()
        except Exception as error:  # noqa: BLE001 - the first compile will pay it instead
            logger.warning("compile service warm-up failed (%s: %s); the first compile "
                           "pays torch's first-use imports", type(error).__name__, error)

    def wait(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
