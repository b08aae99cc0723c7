"""One announce channel per program (Note [Announcement channels]), a burst read off the
socket together (Note [Announcement bursts]) and the compile service's warm-up (Note
[Warm compile service]). Real redis-server."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from dynvm.cluster.fleet._announce import Announcement, Announcer, Subscription, channel_for
from dynvm.cluster.fleet._service_warmup import Warmup
from dynvm.jit.artifact_keys import program_tag, tagged_key
from dynvm.vm.errors import ConfigError
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


def test_announcements_waiting_on_the_socket_are_handed_over_together(redis_server):
    """Note [Announcement bursts]: while the subscriber is busy with one announcement,
    the ones published meanwhile wait on its socket and come as one batch; one that
    arrives alone is handed over alone, at once."""
    config = redis_config(redis_server)
    batches: list[list[str]] = []
    busy = threading.Event()
    release = threading.Event()

    def on_batch(announcements) -> None:
        batches.append([a.key for a in announcements])
        busy.set()
        release.wait(10)

    subscription = Subscription(config, PROGRAM_A, on_batch=on_batch).start()
    announcer = Announcer(config)
    keys = [tagged_key(f"{i}" * 64, PROGRAM_A) for i in range(6)]
    try:
        assert subscription.connected.wait(10)
        assert announcer.publish(Announcement(PROGRAM_A, "cpu", keys[0]))
        assert busy.wait(10)
        for key in keys[1:]:
            assert announcer.publish(Announcement(PROGRAM_A, "cpu", key))
        time.sleep(0.3)   # the five reach the subscriber's socket while it is busy
        release.set()
        assert wait_until(lambda: sum(map(len, batches)) == 6, 10) is not None
        assert batches == [keys[:1], keys[1:]]
        assert subscription.received == 6
    finally:
        release.set()
        subscription.close()
        announcer.close()


def test_a_subscription_takes_one_callback():
    with pytest.raises(ConfigError):
        Subscription(None, PROGRAM_A)
    with pytest.raises(ConfigError):
        Subscription(None, PROGRAM_A, print, on_batch=print)


def test_index_stamps_travel_with_an_announcement_only_as_a_pair():
    key = tagged_key("0" * 64, PROGRAM_A)
    both = Announcement(PROGRAM_A, "cpu", key, None, b"s2", b"s1")
    assert Announcement.decode(both.encode()) == both
    alone = Announcement(PROGRAM_A, "cpu", key, None, b"s2", None)
    assert Announcement.decode(alone.encode()) == Announcement(PROGRAM_A, "cpu", key)
    junk = msgpack.packb({"program": PROGRAM_A, "target": "cpu", "key": key,
                          "stamp": "text", "after": b"x" * 65}, use_bin_type=True)
    assert Announcement.decode(junk) == Announcement(PROGRAM_A, "cpu", key)
