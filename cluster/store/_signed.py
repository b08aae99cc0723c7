"""Sealing and opening kernel store entries, and `ArtifactCache`, the verified view of a store.

Note [Signed artifacts]
~~~~~~~~~~~~~~~~~~~~~~~
A kernel store entry becomes code that runs inside every replica, so a replica trusts
an entry only if it was written by a holder of the cluster's secret, for exactly the
key it was asked for, by a build of this format, for this process's target and
toolchain. Anything else is rejected, counted and never executed (docs/ARCHITECTURE.md,
Invariants): `open_sealed` only returns plain fields, and only after every check below
passed; loading `source` is the caller's job. The entry is

    msgpack {"v": FORMAT_VERSION, "key": key, "body": msgpack(fields),
             "mac": HMAC-SHA256(secret, key + b"\\0" + body)}

* Why the MAC covers the key and not only the body: the store maps keys to values, and
  whoever can write to Redis can copy a valid value under another key. A MAC over the
  body alone would accept the copy, and a replica would run a kernel built for another
  region, family or target under a guard that does not describe it. Binding the key into
  the MAC (and checking the envelope's key against the requested one) makes a moved
  entry fail as Forged. The 0 byte separates key and body (keys are hex digits and a
  braced program tag, never a 0 byte, so it is belt and braces).
* Why msgpack and never pickle: unpickling runs code chosen by whoever wrote the bytes,
  before any check could look at them; msgpack only ever produces maps, lists, strings,
  numbers and bytes, so a forged entry can at worst fail validation. The body is its own
  msgpack document (bytes inside the envelope) so the MAC is computed over exactly the
  bytes that were written, with no re-encoding on either side.
* What each rejection means (one class each, counted by ArtifactCache.stats()):
    CorruptArtifact      not a well-formed envelope, or a signed body that is not a map
                         of the required fields with the right types;
    UnsignedArtifact     a well-formed envelope without a signature;
    ForgedArtifact       the signature does not match (another secret, or any change to
                         key or body after sealing), or the entry was sealed for another
                         key. Without the secret, accidental damage to the body and
                         tampering cannot be told apart: both mean "not what a holder of
                         the secret wrote", and both are reported as Forged;
    IncompatibleArtifact another format version, or authentic but built for another
                         target or toolchain than this process's.
  The format version sits outside the MAC (a future version may sign differently), so
  anyone can turn an entry into "Incompatible": that is a rejection too, never a pass.
* Decoding is bounded (Note [Bounded decoding] in dynvm.vm.bounded_decode): the envelope
  is read before its MAC can be checked, by every replica, from bytes anyone who can
  write to the store chose, so it is decoded as what it is, one map of four fields with
  a short key and two byte strings (ENVELOPE_LIMITS): a header that promises millions of
  items is refused at that header. The body is decoded only after its MAC matched:
  bytes a holder of the secret wrote, within their own size.
* The secret comes from configuration: DYNVM_STORE_SECRET, read only by
  dynvm.cluster.store._store_config.StoreConfig.from_env. It is passed as bytes, kept in private
  attributes, and no message, repr or log line built here contains it; messages quote
  only the key, field names, types, and target/toolchain values.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, ClassVar

import msgpack

from dynvm.cluster.store._base import KernelStore, StoreUnavailable, check_key, shorten
from dynvm.jit.artifact import Artifact
from dynvm.vm.bounded_decode import DecodeError, DecodeLimits, unpack_msgpack
from dynvm.vm.errors import ConfigError, ConfigTypeError, DynvmError

FORMAT_VERSION = 1
_ENVELOPE_FIELDS = frozenset({"v", "key", "body", "mac"})
_MAX_KEY_CHARS = 128
"""A store key is 64 hex digits and an 18-character program tag; field names are shorter."""
_ANY_SIZE = (1 << 32) - 1
"""msgpack's own largest string or container: sizes are the store's cap's business."""
ENVELOPE_LIMITS = DecodeLimits(max_bytes=_ANY_SIZE, max_str=_MAX_KEY_CHARS,
                               max_bin=_ANY_SIZE, max_map=len(_ENVELOPE_FIELDS),
                               max_containers=1, max_depth=1)
"""What an envelope may hold: one map of at most four fields, strings no longer than a
key, two byte strings (body and MAC), nothing nested."""
_BODY_LIMITS = DecodeLimits(max_bytes=_ANY_SIZE, max_str=_ANY_SIZE, max_bin=_ANY_SIZE,
                            max_array=_ANY_SIZE, max_map=_ANY_SIZE, max_depth=None)
"""A body is read after its MAC matched (bytes a holder of the secret wrote): within its
size and msgpack's own depth bound, without a walk over every container (that walk made
opening a portable specialization 8x slower)."""


REQUIRED_FIELDS: Mapping[str, type | tuple[type, ...]] = {
    "backend": str,
    "target": str,
    "toolchain": dict,
    "kernel_name": str,
    "source": str,
    "guard": str,
}
"""Fields every sealed artifact carries, with their msgpack types."""

OPTIONAL_FIELDS: Mapping[str, type | tuple[type, ...]] = {
    "key": str,
    "notes": list,
    "compile_seconds": (int, float),
    "metadata": dict,
}
"""Fields an artifact may carry; other fields are kept as they are (a backend's extras)."""

logger = logging.getLogger(__name__)


class RejectedArtifact(DynvmError):
    """A kernel store entry that must not be used; `reason` names the subclass's case."""

    reason: ClassVar[str] = "rejected"

    def __init__(self, key: str, detail: str):
        self.key = key
        self.detail = detail
        super().__init__(f"kernel store entry {key} rejected ({self.reason}): {detail}")


class UnsignedArtifact(RejectedArtifact):
    """A well-formed entry without a signature."""

    reason = "unsigned"


class ForgedArtifact(RejectedArtifact):
    """A signature that does not match, or an entry sealed for another key."""

    reason = "forged"


class CorruptArtifact(RejectedArtifact):
    """Bytes that are not a well-formed entry or carry a malformed artifact."""

    reason = "corrupt"


class IncompatibleArtifact(RejectedArtifact):
    """Another format version, or built for another target or toolchain."""

    reason = "incompatible"


REJECTIONS: tuple[type[RejectedArtifact], ...] = (
    UnsignedArtifact, ForgedArtifact, CorruptArtifact, IncompatibleArtifact)


def _check_secret(secret: object) -> bytes:
    # The messages below describe the secret's type or emptiness, never its value.
    if not isinstance(secret, bytes):
        raise ConfigTypeError(f"the kernel store secret must be bytes, got {type(secret).__name__}")
    if not secret:
        raise ConfigError("the kernel store secret is empty")
    return secret


def _mac(secret: bytes, key: str, body: bytes) -> bytes:
    return hmac.new(secret, key.encode("ascii") + b"\0" + body, hashlib.sha256).digest()


def _type_names(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


def _field_problem(key: str, fields: object) -> str | None:
    """What is wrong with an artifact's fields, or None if they are well-formed."""
    if not isinstance(fields, dict):
        return f"artifact fields are a {type(fields).__name__}, not a map"
    for name in fields:
        if not isinstance(name, str):
            return f"artifact field name {shorten(name)} is not a string"
    for name in REQUIRED_FIELDS:
        if name not in fields:
            return f"artifact field {name!r} is missing"
    for name, expected in {**REQUIRED_FIELDS, **OPTIONAL_FIELDS}.items():
        value = fields.get(name)
        if name in fields and (not isinstance(value, expected) or isinstance(value, bool)):
            return (f"artifact field {name!r} must be {_type_names(expected)}, "
                    f"got {type(value).__name__}")
    for name, version in fields["toolchain"].items():
        if not isinstance(name, str) or not isinstance(version, str):
            return (f"artifact field 'toolchain' must map names to version strings, "
                    f"got {shorten(name)}: {shorten(version)}")
    if "notes" in fields and not all(isinstance(note, str) for note in fields["notes"]):
        return "artifact field 'notes' must be a list of strings"
    if "key" in fields and fields["key"] != key:
        return f"artifact field 'key' is {shorten(fields['key'])}, the entry's key is {key}"
    return None


def _expectation(expect: Mapping[str, Any]) -> tuple[str, dict[str, str], str | None]:
    if not isinstance(expect, Mapping) or "target" not in expect or "toolchain" not in expect:
        raise TypeError("expect must be a mapping with 'target' and 'toolchain' "
                        "(and optionally 'backend')")
    # Plain str values: torch.__version__ is a TorchVersion, whose == parses both sides
    # as versions (22 us against 0.05 us), paid on every artifact a replica verifies.
    toolchain = {str(name): str(version) for name, version in expect["toolchain"].items()}
    return str(expect["target"]), toolchain, expect.get("backend")


def _toolchain_difference(built: Mapping[str, str], here: Mapping[str, str]) -> str:
    names = sorted(set(built) | set(here))
    parts = [f"{name} {shorten(built.get(name))} (here {shorten(here.get(name))})"
             for name in names if built.get(name) != here.get(name)]
    return ", ".join(parts)


def seal(key: str, artifact_fields: Mapping[str, Any], secret: bytes) -> bytes:
    """The signed store value of an artifact (Note [Signed artifacts]).

    Raises ValueError if the fields are not a well-formed artifact, TypeError if they
    hold something msgpack cannot encode.
    """
    key = check_key(key)
    secret = _check_secret(secret)
    fields = dict(artifact_fields)
    problem = _field_problem(key, fields)
    if problem is not None:
        raise ValueError(f"cannot seal kernel store entry {key}: {problem}")
    body = msgpack.packb(fields, use_bin_type=True)
    envelope = {"v": FORMAT_VERSION, "key": key, "body": body, "mac": _mac(secret, key, body)}
    return msgpack.packb(envelope, use_bin_type=True)




def open_sealed(key: str, data: bytes, secret: bytes, expect: Mapping[str, Any]) -> dict:
    """The artifact fields in `data`, stored under `key`, if and only if they may be used.

    `expect` is {"target": ..., "toolchain": ...} (optionally "backend") of this process.
    Raises a `RejectedArtifact` subclass naming why otherwise (Note [Signed artifacts]).
    """
    key = check_key(key)
    secret = _check_secret(secret)
    target, toolchain, backend = _expectation(expect)
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CorruptArtifact(key, f"value is a {type(data).__name__}, not bytes")
    try:
        envelope = unpack_msgpack(data, ENVELOPE_LIMITS, "envelope")
    except DecodeError as error:  # any failure to decode outside bytes is corruption
        raise CorruptArtifact(key, f"{error} ({len(data)} bytes)") from None
    if not isinstance(envelope, dict):
        raise CorruptArtifact(key, f"envelope is a {type(envelope).__name__}, not a map")
    version = envelope.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptArtifact(key, "envelope has no integer format version 'v'")
    if version != FORMAT_VERSION:
        raise IncompatibleArtifact(
            key, f"format version {version}, this process reads version {FORMAT_VERSION}")
    extra = sorted(map(str, set(envelope) - _ENVELOPE_FIELDS))
    if extra:
        raise CorruptArtifact(key, f"envelope has unknown fields {shorten(extra)}")
    mac = envelope.get("mac")
    if mac is None or mac == b"":
        raise UnsignedArtifact(key, "envelope has no signature 'mac'")
    if not isinstance(mac, bytes):
        raise CorruptArtifact(key, f"signature is a {type(mac).__name__}, not bytes")
    stored_key, body = envelope.get("key"), envelope.get("body")
    if not isinstance(stored_key, str):
        raise CorruptArtifact(key, "envelope has no string 'key'")
    if not isinstance(body, bytes):
        raise CorruptArtifact(key, "envelope has no bytes 'body'")
    if stored_key != key:
        raise ForgedArtifact(key, f"entry was sealed for key {shorten(stored_key)} "
                                  "(a valid entry copied under another key)")
    if not hmac.compare_digest(mac, _mac(secret, key, body)):
        raise ForgedArtifact(key, "signature does not match: sealed with another secret, "
                                  "or altered after sealing")
    try:
        fields = unpack_msgpack(body, _BODY_LIMITS, "signed body")
    except DecodeError as error:  # see above: every decode failure is corruption
        raise CorruptArtifact(key, str(error)) from None
    problem = _field_problem(key, fields)
    if problem is not None:
        raise CorruptArtifact(key, problem)
    if backend is not None and fields["backend"] != backend:
        raise IncompatibleArtifact(key, f"built by backend {shorten(fields['backend'])}, "
                                        f"this process needs {backend!r}")
    if fields["target"] != target:
        raise IncompatibleArtifact(key, f"built for target {shorten(fields['target'])}, "
                                        f"this process runs {target!r}")
    if fields["toolchain"] != toolchain:
        raise IncompatibleArtifact(key, "built with another toolchain: "
                                        + _toolchain_difference(fields["toolchain"], toolchain))
    return fields


def artifact_fields(artifact: Artifact, toolchain: Mapping[str, str]) -> dict:
    """The sealable fields of a `dynvm.jit.artifact.Artifact` built with `toolchain`."""
    fields = asdict(artifact)
    fields["notes"] = list(artifact.notes)
    fields["toolchain"] = dict(toolchain)
    return fields


def artifact_from_fields(fields: Mapping[str, Any]) -> Artifact:
    """The `Artifact` that `open_sealed` fields describe (extra backend fields are dropped)."""
    return Artifact(key=fields["key"], backend=fields["backend"], target=fields["target"],
                    kernel_name=fields["kernel_name"], source=fields["source"],
                    guard=fields["guard"], notes=tuple(fields.get("notes", ())),
                    compile_seconds=float(fields.get("compile_seconds", 0.0)),
                    metadata=dict(fields.get("metadata", {})))


class ArtifactCache:
    """A `KernelStore` seen through `seal`/`open_sealed`: only valid entries come out.

    The store is a cache (losing it only costs recompiles), so an unreachable store is
    counted and logged, and `fetch` returns nothing / `publish` returns False instead of
    raising. Rejected entries are counted by reason and logged; their bytes are dropped.
    """

    def __init__(self, store: KernelStore, secret: bytes, expect: Mapping[str, Any]):
        self.store = store
        self._secret = _check_secret(secret)
        self._target, self._toolchain, self._backend = _expectation(expect)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("valid", "missing", "published", "unavailable",
             *(cls.reason for cls in REJECTIONS)), 0)

    def __repr__(self) -> str:
        return f"ArtifactCache({self.store!r}, target={self._target!r})"

    @property
    def expect(self) -> dict[str, Any]:
        expect = {"target": self._target, "toolchain": dict(self._toolchain)}
        if self._backend is not None:
            expect["backend"] = self._backend
        return expect

    def fetch(self, keys: Sequence[str], rejected: set[str] | None = None) -> dict[str, dict]:
        """The valid artifacts among `keys` (missing, rejected and unreachable ones absent);
        the keys whose entries were rejected are added to `rejected` when given."""
        keys = [check_key(key) for key in keys]
        try:
            found = self.store.get(keys)
        except StoreUnavailable as error:
            self._count("unavailable")
            logger.warning("kernel store fetch failed: %s", error)
            return {}
        valid: dict[str, dict] = {}
        expect = self.expect
        for key in keys:
            data = found.get(key)
            if data is None:
                self._count("missing")
                continue
            try:
                valid[key] = open_sealed(key, data, self._secret, expect)
            except RejectedArtifact as rejection:
                self._count(rejection.reason)
                logger.warning("%s", rejection)
                if rejected is not None:
                    rejected.add(key)
                continue
            self._count("valid")
        return valid

    def store_keys_present(self, keys: Sequence[str]) -> set[str]:
        """Which of `keys` the store holds (unverified: a presence check, not a fetch, and
        not a use that would keep a retired program alive, Note [Artifact lifetime]);
        every key when the store cannot be reached, so that an outage is not mistaken
        for data loss."""
        try:
            return self.store.contains([check_key(k) for k in keys])
        except StoreUnavailable:
            self._count("unavailable")
            return set(keys)

    def publish(self, key: str, fields: Mapping[str, Any]) -> bool:
        """Seal and store an artifact; False (counted, logged) if the store is unreachable."""
        data = seal(key, fields, self._secret)
        try:
            self.store.put(key, data)
        except StoreUnavailable as error:
            self._count("unavailable")
            logger.warning("kernel store publish failed: %s", error)
            return False
        self._count("published")
        return True

    def stats(self) -> dict[str, int]:
        """Counters: valid, missing, published, unavailable, one per rejection reason
        (unsigned, forged, corrupt, incompatible) and their total, rejected."""
        with self._lock:
            counts = dict(self._counts)
        counts["rejected"] = sum(counts[cls.reason] for cls in REJECTIONS)
        return counts

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
