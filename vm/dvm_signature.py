"""Signed .dvm files: a detached HMAC-SHA256 signature, `<file>.sig`, beside the file.

Note [Signed programs]
~~~~~~~~~~~~~~~~~~~~~~
A .dvm file's sha256 and its stored content hash are integrity checks: they catch a
truncated download or a flipped bit, not an edit. Anyone who can write the file can
recompute both after changing the code or the signature (two inputs with one name, a
dim bound of 2**62, a loop that never ends), and the file loads. The verifier refuses
what is inconsistent (Note [Program signature] in dynvm.vm.verifier) and the call budget
stops what never ends (Note [Call budget]), but a program that is consistent and wrong
on purpose is still a program. So a .dvm file from anywhere untrusted must be signed,
like a kernel store entry (Note [Signed artifacts] in dynvm.cluster.store._signed), with the
same kind of secret: whoever holds it vouches for the file.

The signature is a small JSON document, {"v": 1, "alg": "HMAC-SHA256", "sha256": hex of
the file, "mac": hex of HMAC-SHA256(secret, b"dynvm .dvm v1\\0" + file bytes)}, kept
beside the file so that the file format does not change and a signed file still loads
where nobody checks. `dvm_file.load(path, signing_secret=...)` checks it before it parses
a byte of the file; `dvm_file.save(..., signing_secret=...)` and `sign_file` write it.
The secret is a parameter (the cluster passes its store secret): this module, like the
whole VM layer, imports nothing from the cluster, and no message shows the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from dynvm.vm.bounded_decode import DecodeError, DecodeLimits, unpack_json
from dynvm.vm.errors import ConfigTypeError, DvmSignatureError

SUFFIX = ".sig"
VERSION = 1
_DOMAIN = b"dynvm .dvm v1\0"  # a MAC for a .dvm file is never a MAC for anything else
MAX_SIGNATURE_BYTES = 4096
_LIMITS = DecodeLimits(max_bytes=MAX_SIGNATURE_BYTES, max_depth=1)
"""A signature is one flat JSON object (Note [Bounded decoding] in dynvm.vm.bounded_decode):
4 KiB of `[` would otherwise raise RecursionError out of the loader."""


def signature_path(path: str | os.PathLike) -> Path:
    """Where the signature of the .dvm file at `path` lives: `<path>.sig`."""
    return Path(os.fspath(path) + SUFFIX)


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes) or not secret:
        raise ConfigTypeError("a .dvm signing secret must be non-empty bytes")
    return secret


def _mac(data: bytes, secret: bytes) -> str:
    return hmac.new(_check_secret(secret), _DOMAIN + data, hashlib.sha256).hexdigest()


def sign(data: bytes, secret: bytes) -> bytes:
    """The signature document of a .dvm file's bytes."""
    return json.dumps({"v": VERSION, "alg": "HMAC-SHA256",
                       "sha256": hashlib.sha256(data).hexdigest(),
                       "mac": _mac(data, secret)}).encode()


def sign_file(path: str | os.PathLike, secret: bytes) -> Path:
    """Write `<path>.sig` for the .dvm file at `path`; returns the signature's path."""
    target = signature_path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(sign(Path(path).read_bytes(), secret))
    os.replace(tmp, target)
    return target


def check(data: bytes, signature: bytes, secret: bytes, where: str) -> None:
    """Raise DvmSignatureError unless `signature` is a holder of `secret`'s signature of
    exactly `data`."""
    if len(signature) > MAX_SIGNATURE_BYTES:
        raise DvmSignatureError(where, f"the signature is {len(signature)} bytes, more than "
                                       f"{MAX_SIGNATURE_BYTES}")
    try:
        doc = unpack_json(signature, _LIMITS, "the signature")
    except DecodeError as error:
        raise DvmSignatureError(where, f"the signature is not a flat JSON document ({error})") \
            from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION \
            or doc.get("alg") != "HMAC-SHA256" or not isinstance(doc.get("mac"), str):
        raise DvmSignatureError(where, f"the signature is not a version {VERSION} "
                                       "HMAC-SHA256 signature")
    if not hmac.compare_digest(doc["mac"], _mac(data, secret)):
        raise DvmSignatureError(where, "the signature does not match: the file was changed "
                                       "after it was signed, or signed with another secret")


def check_file(path: str | os.PathLike, data: bytes, secret: bytes) -> None:
    """Check the signature beside `path` for the file's `data` (read once by the caller)."""
    where = os.fspath(path)
    sig = signature_path(path)
    try:
        with open(sig, "rb") as f:
            signature = f.read(MAX_SIGNATURE_BYTES + 1)
    except FileNotFoundError:
        raise DvmSignatureError(where, f"no signature ({sig.name} is missing) and this "
                                       "loader requires signed programs") from None
    check(data, signature, secret, where)
