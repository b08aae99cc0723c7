"""Signed kernel store entries: every way an entry can be bad is rejected, by name, counted."""

from __future__ import annotations

import hashlib
import logging
import traceback

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynvm.cluster import (
    ArtifactCache,
    CorruptArtifact,
    ForgedArtifact,
    IncompatibleArtifact,
    LocalDirStore,
    RejectedArtifact,
    UnsignedArtifact,
)
from dynvm.cluster.store._signed import (
    FORMAT_VERSION,
    _mac,
    artifact_fields,
    artifact_from_fields,
    open_sealed,
    seal,
)
from dynvm.jit.artifact import Artifact, cache_key
from tests.cluster._mutations import mutated_bytes

TARGET = "cpu"
TOOLCHAIN = {"dynvm": "0.1.0", "torch": "2.13.0", "python": "3.11", "triton": "none"}
EXPECT = {"target": TARGET, "toolchain": TOOLCHAIN}


def key(n: int) -> str:
    return cache_key(f"program-{n}", 0, "family", "cpu", TARGET, toolchain=TOOLCHAIN)


def fields(k: str, **changes) -> dict:
    base = {"key": k, "backend": "cpu", "target": TARGET, "toolchain": dict(TOOLCHAIN),
            "kernel_name": "region_0", "source": "def region_0(x):\n    return x + 1\n",
            "guard": "strong", "notes": ["fused add"], "compile_seconds": 0.25,
            "metadata": {"arena_bytes": 4096}}
    base.update(changes)
    return base


def envelope(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


def pack(document) -> bytes:
    return msgpack.packb(document, use_bin_type=True)


def signed_body(k: str, body_fields, secret: bytes, **overrides) -> bytes:
    """An entry whose MAC is right but whose body is whatever the test wants."""
    body = pack(body_fields)
    return pack({"v": FORMAT_VERSION, "key": k, "body": body, "mac": _mac(secret, k, body),
                 **overrides})


def flip_bit(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1:]


def bad_entries(secret: bytes, k: str | None = None,
                other: str | None = None) -> dict[str, tuple[type[RejectedArtifact], bytes]]:
    """name -> (expected rejection, bytes to store under k, by default key(0))."""
    k, other = k or key(0), other or key(1)
    good = seal(k, fields(k), secret)
    parts = envelope(good)
    no_mac = {name: value for name, value in parts.items() if name != "mac"}
    return {
        "unsigned: no mac": (UnsignedArtifact, pack(no_mac)),
        "unsigned: mac nil": (UnsignedArtifact, pack({**parts, "mac": None})),
        "unsigned: mac empty": (UnsignedArtifact, pack({**parts, "mac": b""})),
        "forged: other secret": (ForgedArtifact, seal(k, fields(k), b"another secret")),
        "forged: bit-flipped body": (ForgedArtifact,
                                     pack({**parts, "body": flip_bit(parts["body"], 20)})),
        "forged: bit-flipped mac": (ForgedArtifact,
                                    pack({**parts, "mac": flip_bit(parts["mac"], 0)})),
        "forged: short mac": (ForgedArtifact, pack({**parts, "mac": parts["mac"][:16]})),
        "forged: copied from another key": (ForgedArtifact,
                                            seal(other, fields(other), secret)),
        "forged: copied and key rewritten": (ForgedArtifact,
                                             pack({**envelope(seal(other, fields(other),
                                                                   secret)), "key": k})),
        "corrupt: truncated": (CorruptArtifact, good[:-7]),
        "corrupt: trailing bytes": (CorruptArtifact, good + b"\x00"),
        "corrupt: empty": (CorruptArtifact, b""),
        "corrupt: not msgpack": (CorruptArtifact, b"\xc1\xc1\xc1"),
        "corrupt: pickle": (CorruptArtifact, b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00N."),
        "corrupt: a list": (CorruptArtifact, pack([1, k, b"", b""])),
        "corrupt: no version": (CorruptArtifact, pack({**parts, "v": None})),
        "corrupt: extra envelope field": (CorruptArtifact, pack({**parts, "x": 1})),
        "corrupt: mac is text": (CorruptArtifact, pack({**parts, "mac": "abc"})),
        "corrupt: body is text": (CorruptArtifact, pack({**parts, "body": "abc"})),
        "corrupt: key missing": (CorruptArtifact,
                                 pack({n: v for n, v in parts.items() if n != "key"})),
        "corrupt: signed body not msgpack": (CorruptArtifact, pack(
            {"v": FORMAT_VERSION, "key": k, "body": b"\xc1",
             "mac": _mac(secret, k, b"\xc1")})),
        "corrupt: signed body a list": (CorruptArtifact, signed_body(k, [1, 2], secret)),
        "corrupt: signed body lacks source": (CorruptArtifact, signed_body(
            k, {n: v for n, v in fields(k).items() if n != "source"}, secret)),
        "corrupt: signed body wrong type": (CorruptArtifact,
                                            signed_body(k, fields(k, guard=3), secret)),
        "corrupt: signed body other key": (CorruptArtifact,
                                           signed_body(k, fields(other), secret)),
        "corrupt: toolchain not strings": (CorruptArtifact, signed_body(
            k, fields(k, toolchain={"torch": 2}), secret)),
        "incompatible: newer version": (IncompatibleArtifact,
                                        pack({**parts, "v": FORMAT_VERSION + 1})),
        "incompatible: other target": (IncompatibleArtifact,
                                       seal(k, fields(k, target="cuda:90"), secret)),
        "incompatible: other toolchain": (IncompatibleArtifact, seal(
            k, fields(k, toolchain={**TOOLCHAIN, "torch": "2.5.0"}), secret)),
        "incompatible: toolchain lacks an entry": (IncompatibleArtifact, seal(
            k, fields(k, toolchain={"torch": "2.13.0"}), secret)),
    }


CASES = sorted(bad_entries(b"names only"))


def test_round_trip(secret):
    k = key(0)
    assert open_sealed(k, seal(k, fields(k), secret), secret, EXPECT) == fields(k)


def test_round_trip_of_a_jit_artifact(secret):
    k = key(0)
    artifact = Artifact(k, "cpu", TARGET, "region_0", "source", "weak", ("a", "b"), 0.5,
                        {"bytes": 3})
    opened = open_sealed(k, seal(k, artifact_fields(artifact, TOOLCHAIN), secret), secret,
                         EXPECT)
    assert artifact_from_fields(opened) == artifact


def test_extra_backend_fields_pass_through(secret):
    k = key(0)
    extended = fields(k, binaries={"cuda:90": b"\x7fELF"}, launch={"grid": [1, 2, 3]})
    assert open_sealed(k, seal(k, extended, secret), secret, EXPECT) == extended


@pytest.mark.parametrize("case", CASES)
def test_each_bad_entry_is_rejected_by_name(secret, case):
    expected, data = bad_entries(secret)[case]
    with pytest.raises(RejectedArtifact) as caught:
        open_sealed(key(0), data, secret, EXPECT)
    assert type(caught.value) is expected, str(caught.value)
    assert caught.value.key == key(0)
    assert key(0) in str(caught.value)


def test_every_prefix_is_corrupt(secret):
    k = key(0)
    good = seal(k, fields(k), secret)
    for end in range(len(good)):
        with pytest.raises(CorruptArtifact):
            open_sealed(k, good[:end], secret, EXPECT)


def test_incompatible_names_expected_and_actual(secret):
    k = key(0)
    data = seal(k, fields(k, target="cuda:90", toolchain={**TOOLCHAIN, "torch": "2.5.0"}),
                secret)
    with pytest.raises(IncompatibleArtifact, match="'cuda:90'.*'cpu'"):
        open_sealed(k, data, secret, EXPECT)
    with pytest.raises(IncompatibleArtifact, match=r"torch '2\.5\.0' \(here '2\.13\.0'\)"):
        open_sealed(k, data, secret, {"target": "cuda:90", "toolchain": TOOLCHAIN})
    with pytest.raises(IncompatibleArtifact, match="backend"):
        open_sealed(k, seal(k, fields(k), secret), secret, {**EXPECT, "backend": "triton"})


def test_non_bytes_data_is_corrupt(secret):
    with pytest.raises(CorruptArtifact, match="not bytes"):
        open_sealed(key(0), "text", secret, EXPECT)


def test_caller_errors_are_not_rejections(secret):
    k = key(0)
    data = seal(k, fields(k), secret)
    with pytest.raises(ValueError, match="invalid kernel store key"):
        open_sealed("nope", data, secret, EXPECT)
    with pytest.raises(ValueError, match="empty"):
        open_sealed(k, data, b"", EXPECT)
    with pytest.raises(TypeError, match="must be bytes"):
        open_sealed(k, data, secret.decode(), EXPECT)
    with pytest.raises(TypeError, match="target"):
        open_sealed(k, data, secret, {"toolchain": TOOLCHAIN})
    with pytest.raises(ValueError, match="'source' is missing"):
        seal(k, {n: v for n, v in fields(k).items() if n != "source"}, secret)
    with pytest.raises(ValueError, match="'key'"):
        seal(k, fields(key(1)), secret)


def secret_forms(secret: bytes) -> list[str]:
    return [secret.decode(), secret.hex(), repr(secret), repr(secret)[2:-1]]


def test_secret_never_in_messages_or_reprs(secret, tmp_path, caplog):
    cache = ArtifactCache(LocalDirStore(tmp_path), secret, EXPECT)
    shown = [repr(cache), str(cache)]
    for case in CASES:
        expected, data = bad_entries(secret)[case]
        try:
            open_sealed(key(0), data, secret, EXPECT)
        except RejectedArtifact as error:
            shown += [str(error), repr(error), "".join(traceback.format_exception(error))]
        cache.store.put(key(0), data)
        with caplog.at_level(logging.DEBUG):
            cache.fetch([key(0)])
    for bad_secret in (b"", "text"):
        try:
            open_sealed(key(0), b"", bad_secret, EXPECT)
        except (TypeError, ValueError) as error:
            shown += [str(error), repr(error)]
    shown.append(caplog.text)
    assert caplog.text  # rejections were logged
    for text in shown:
        for form in secret_forms(secret):
            assert form not in text


def fill_store(store, secret: bytes) -> dict[str, type[RejectedArtifact] | None]:
    """Put every bad case (and some good entries) in `store`: key -> expected outcome."""
    outcome: dict[str, type[RejectedArtifact] | None] = {}
    for n, case in enumerate(CASES, start=10):
        k = key(n)
        expected, data = bad_entries(secret, k, key(n + 1000))[case]
        store.put(k, data)
        outcome[k] = expected
    for n in range(3):
        k = key(100 + n)
        store.put(k, seal(k, fields(k), secret))
        outcome[k] = None
    return outcome


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_artifact_cache_returns_only_valid_entries_and_counts(secret, tmp_path, backend,
                                                              request):
    store = (LocalDirStore(tmp_path) if backend == "local"
             else request.getfixturevalue("redis_store"))
    outcome = fill_store(store, secret)
    cache = ArtifactCache(store, secret, EXPECT)
    missing = key(999)
    got = cache.fetch([*outcome, missing])
    assert set(got) == {k for k, expected in outcome.items() if expected is None}
    for k, opened in got.items():
        assert opened == fields(k)
    stats = cache.stats()
    for cls in (UnsignedArtifact, ForgedArtifact, CorruptArtifact, IncompatibleArtifact):
        assert stats[cls.reason] == sum(1 for e in outcome.values() if e is cls), cls
    assert stats["rejected"] == len(CASES)
    assert stats["valid"] == 3 and stats["missing"] == 1 and stats["unavailable"] == 0


def test_publish_then_fetch(secret, tmp_path):
    publisher = ArtifactCache(LocalDirStore(tmp_path), secret, EXPECT)
    k = key(0)
    assert publisher.publish(k, fields(k)) is True
    replica = ArtifactCache(LocalDirStore(tmp_path), secret, EXPECT)
    assert replica.fetch([k]) == {k: fields(k)}
    assert publisher.stats()["published"] == 1
    stranger = ArtifactCache(LocalDirStore(tmp_path), b"not the cluster's secret", EXPECT)
    assert stranger.fetch([k]) == {}
    assert stranger.stats()["forged"] == 1
    gpu_replica = ArtifactCache(LocalDirStore(tmp_path), secret,
                                {"target": "cuda:90", "toolchain": TOOLCHAIN})
    assert gpu_replica.fetch([k]) == {}
    assert gpu_replica.stats()["incompatible"] == 1


def test_unreachable_store_costs_a_recompile_not_an_error(secret, redis_server, redis_store,
                                                          caplog):
    cache = ArtifactCache(redis_store, secret, EXPECT)
    k = key(0)
    assert cache.publish(k, fields(k))
    redis_server.stop()
    with caplog.at_level(logging.WARNING):
        assert cache.fetch([k]) == {}
        assert cache.publish(k, fields(k)) is False
    assert cache.stats()["unavailable"] == 2
    assert redis_server.password not in caplog.text
    redis_server.start()
    assert cache.fetch([k]) == {}  # the restarted cache is empty
    assert cache.publish(k, fields(k))
    assert cache.fetch([k]) == {k: fields(k)}


# --- fuzzing ----------------------------------------------------------------------------

FUZZ_SECRET = b"fuzz-secret"
FUZZ_KEY = key(0)
FUZZ_GOOD = seal(FUZZ_KEY, fields(FUZZ_KEY), FUZZ_SECRET)
FUZZ = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def only_rejections(data: bytes, sealed: dict | None = None) -> None:
    """open_sealed either rejects `data` by name or returns what was sealed (by default the
    fixture's fields: a mutation may only be accepted if it changed nothing that counts)."""
    try:
        opened = open_sealed(FUZZ_KEY, data, FUZZ_SECRET, EXPECT)
    except RejectedArtifact:
        return
    assert opened == (fields(FUZZ_KEY) if sealed is None else sealed)


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data):
    only_rejections(data)


def mutated():
    return mutated_bytes(FUZZ_GOOD)


@FUZZ
@given(mutated())
def test_fuzz_mutations_of_a_valid_entry(data):
    only_rejections(data)


# No NaN: it round-trips but is not equal to itself, and the checks compare values.
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@FUZZ
@given(st.dictionaries(st.sampled_from(["v", "key", "body", "mac", "x"]), msgpack_values,
                       max_size=5),
       st.booleans())
def test_fuzz_structured_envelopes(parts, sign):
    if sign and isinstance(parts.get("body"), bytes):
        parts["mac"] = _mac(FUZZ_SECRET, FUZZ_KEY, parts["body"])
    only_rejections(pack(parts))


@FUZZ
@given(st.dictionaries(st.text(max_size=12) | st.sampled_from(sorted(fields(FUZZ_KEY))),
                       msgpack_values, max_size=10))
def test_fuzz_signed_bodies(body_fields):
    # Signed with the right secret: whatever passes must be exactly the signed fields
    # (extra fields pass through) and must have the required fields with their types.
    for sealed in ({**fields(FUZZ_KEY), **body_fields}, body_fields):
        only_rejections(signed_body(FUZZ_KEY, sealed, FUZZ_SECRET),
                        msgpack.unpackb(pack(sealed), raw=False))


def test_digest_of_fuzz_fixture_is_stable():
    # The fuzz tests above start from this entry; sealing is deterministic.
    assert hashlib.sha256(seal(FUZZ_KEY, fields(FUZZ_KEY), FUZZ_SECRET)).digest() == \
        hashlib.sha256(FUZZ_GOOD).digest()
