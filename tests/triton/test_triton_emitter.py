"""The indented code emitter the Triton backend writes kernels with."""

from __future__ import annotations

import ast

import pytest

from dynvm.jit.backends.triton.emitter import CodeEmitter


def test_blocks_indent_and_close():
    em = CodeEmitter()
    em.comment("header\nsecond line")
    with em.block("def f(x):"):
        em.line("y = x + 1")
        with em.block("if y > 2:"):
            em.line("return y")
        em.blank()
        em.line("return 0")
    assert em.source() == ("# header\n# second line\ndef f(x):\n    y = x + 1\n"
                           "    if y > 2:\n        return y\n\n    return 0\n")
    ast.parse(em.source())


def test_call_puts_one_argument_per_line_with_comments():
    em = CodeEmitter()
    em.call("def kernel", ["x_ptr  # input", "N: tl.constexpr"], "):")
    with em.indent():
        em.line("pass")
    assert em.source() == ("def kernel(\n    x_ptr,  # input\n    N: tl.constexpr,\n):\n"
                           "    pass\n")


def test_include_reindents_another_emitter():
    inner = CodeEmitter()
    with inner.block("for i in range(3):"):
        inner.line("total += i")
    outer = CodeEmitter()
    with outer.block("def f():"):
        outer.line("total = 0")
        outer.include(inner)
        outer.line("return total")
    namespace = {}
    exec(compile(outer.source(), "<test>", "exec"), namespace)
    assert namespace["f"]() == 3


def test_misuse_is_refused():
    em = CodeEmitter()
    with pytest.raises(ValueError, match="one line at a time"):
        em.line("a\nb")
    with pytest.raises(ValueError, match="ends with ':'"), em.block("def f()"):
        pass
    with em.indent(), pytest.raises(RuntimeError, match="open block"):
        em.source()
