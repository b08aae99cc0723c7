"""One announce channel per program (Note [Announcement channels]) and the compile
service's warm-up (Note [Warm compile service]). Real redis-server."""

from __future__ import annotations

import time

from dynvm.cluster.announce import Announcement, Announcer, Subscription, channel_for
from dynvm.cluster.service_warmup import Warmup
from dynvm.jit.artifact_keys import program_tag, tagged_key
from tests.cluster._cluster_helpers import wait_until
from tests.cluster._redis_server import redis_config

PROGRAM_A = "a" * 64
PROGRAM_B = "b" * 64


def test_an_announcement_reaches_its_programs_subscribers_only(redis_server):
    config = redis_config(redis_server)
    heard: dict[str, list] = {PROGRAM_A: [], PROGRAM_B: []}
    subscriptions = [Subscription(config, p, heard[p].append).start() for p in heard]
    announcer = Announcer(config)
    try:
        assert all(s.connected.wait(10) for s in subscriptions)
        key = tagged_key("0" * 64, PROGRAM_A)
        assert announcer.publish(Announcement(PROGRAM_A, "cpu", key))
        assert wait_until(lambda: heard[PROGRAM_A], 10) is not None
        time.sleep(0.2)   # time enough for a (wrong) delivery to B to arrive too
        assert [a.key for a in heard[PROGRAM_A]] == [key]
        assert heard[PROGRAM_B] == []
        # The channel carries the program's tag in braces, as its keys do (one slot).
        assert channel_for(PROGRAM_A).endswith("{" + program_tag(PROGRAM_A) + "}")
        assert subscriptions[1].received == 0
    finally:
        for subscription in subscriptions:
            subscription.close()
        announcer.close()


def test_the_warmup_runs_torch_meta_kernels_off_the_callers_thread():
    warmup = Warmup().start()
    assert warmup.wait(120)
    assert warmup.seconds is not None and warmup.seconds >= 0.0
