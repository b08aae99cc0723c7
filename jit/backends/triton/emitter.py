"""An indented code emitter: generated source is built line by line, never by gluing
strings with hand-counted spaces.

    em = CodeEmitter()
    em.line("@triton.jit")
    with em.block("def kernel(x_ptr, N):"):
        em.comment("one program per row")
        em.line("row = tl.program_id(0)")
    source = em.source()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

INDENT = "    "


class CodeEmitter:
    """Lines of source at a current indentation level."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._level = 0

    def line(self, text: str = "") -> None:
        """One line at the current level (an empty `text` is a blank line)."""
        if "\n" in text:
            raise ValueError(f"one line at a time, got {text!r}")
        self._lines.append(INDENT * self._level + text if text else "")

    def lines(self, texts) -> None:
        for text in texts:
            self.line(text)

    def comment(self, text: str) -> None:
        """A comment; several lines of `text` become several comment lines."""
        for part in text.splitlines() or [""]:
            self.line(f"# {part}".rstrip())

    def blank(self) -> None:
        if self._lines and self._lines[-1]:
            self._lines.append("")

    @contextmanager
    def indent(self) -> Iterator[None]:
        self._level += 1
        try:
            yield
        finally:
            self._level -= 1

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        """`header` (ending in ':'), then the body one level deeper."""
        if not header.endswith(":"):
            raise ValueError(f"a block header ends with ':', got {header!r}")
        self.line(header)
        with self.indent():
            yield

    def call(self, head: str, args: list[str], tail: str = ")") -> None:
        """`head(` then one argument per line (with an optional trailing comment after
        `  # `), then `tail`: how long signatures stay readable."""
        self.line(head + "(")
        with self.indent():
            for arg in args:
                text, _, note = arg.partition("  # ")
                self.line(f"{text},  # {note}" if note else f"{text},")
        self.line(tail)

    def include(self, other: CodeEmitter) -> None:
        """`other`'s lines, indented to the current level."""
        for text in other._lines:
            self._lines.append(INDENT * self._level + text if text else "")

    @property
    def level(self) -> int:
        return self._level

    def source(self) -> str:
        if self._level:
            raise RuntimeError(f"source taken inside an open block (level {self._level})")
        return "\n".join(self._lines).rstrip("\n") + "\n"
