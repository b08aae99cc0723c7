"""A hypothesis strategy shared by the fuzz tests of parsers that take bytes (signed store
entries, HTTP infer bodies): a valid input damaged by a few edits.

Not a conftest on purpose (as tests/vm/_programs.py): import what you need.
"""

from __future__ import annotations

from hypothesis import strategies as st

ANY_BYTE = st.integers(0, 255)


@st.composite
def mutated_bytes(draw, data: bytes, set_values=ANY_BYTE) -> bytes:
    """`data` after 1 to 4 edits: bit flips, bytes set (drawn from `set_values`),
    insertions, deletions, truncation."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip" and out:
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and out:
            out[at] = draw(set_values)
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and out:
            del out[at:at + draw(st.integers(1, 8))]
        elif kind == "truncate":
            del out[at:]
    return bytes(out)
