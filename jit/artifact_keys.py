"""The text form of an artifact cache key, and the program it belongs to.

Note [Program hash tags]
~~~~~~~~~~~~~~~~~~~~~~~~
A key is the sha256 digest of everything that shaped the artifact (dynvm.jit.artifact.
cache_key), followed by its program's tag in braces:

    <64 hex digits of the digest>{<first 16 hex digits of the program hash>}

* Redis Cluster places a key by the text inside its first "{...}" (its hash tag), so
  every key of one program (its artifacts for every target, its indexes, the store's
  bookkeeping of them) lands on one slot, on one node: a program's entries can be read,
  bounded and expired together (a pipeline or transaction over one slot), and one hot
  program never spreads its traffic over every node while a cold one still costs each.
* The store learns a key's program from the key alone (`program_tag_of`), which is how
  it groups entries for expiry and for its per-program size bound (Note [Artifact
  lifetime] in dynvm.cluster.store._base), without opening anything.
* The digest comes first so that a key's first characters, as logs print them
  (`key[:16]`), still tell artifacts apart; the tag only groups. 16 hex digits (64
  bits) of the program hash keep distinct programs apart by accident; the tag is not a
  security boundary (the signature covers the whole key, Note [Signed artifacts]).
* A program id that is not a sha256 hex digest (tests name programs "prog") is hashed
  first, so the tag is always 16 hex digits and a key always matches `KEY_PATTERN`.
* A bare 64-digit digest (keys written before the tag existed) is still a valid key; it
  belongs to no program, so only the store's TTL and Redis's LRU ever remove it.
"""

from __future__ import annotations

import hashlib
import re

TAG_DIGITS = 16
"""Hex digits of the program hash in a key's tag (Note [Program hash tags])."""

KEY_PATTERN = re.compile(r"[0-9a-f]{64}(?:\{([0-9a-f]{" + str(TAG_DIGITS) + r"})\})?")
"""A store key: a hex sha256 digest, then (for every key cache_key builds) a program tag."""

_PROGRAM_HASH = re.compile(r"[0-9a-f]{64}")


def program_tag(program_hash: str) -> str:
    """The tag of every key of the program whose content hash is `program_hash`."""
    if _PROGRAM_HASH.fullmatch(program_hash) is None:
        program_hash = hashlib.sha256(program_hash.encode()).hexdigest()
    return program_hash[:TAG_DIGITS]


def tagged_key(digest: str, program_hash: str) -> str:
    """The key of the artifact whose cache digest is `digest`, of `program_hash`."""
    return f"{digest}{{{program_tag(program_hash)}}}"


def program_tag_of(key: str) -> str | None:
    """The program tag of a valid key, None for a bare digest (or a malformed key)."""
    match = KEY_PATTERN.fullmatch(key)
    return match.group(1) if match is not None else None
