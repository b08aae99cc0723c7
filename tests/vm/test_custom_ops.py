"""Custom ops as instructions (Note [Custom ops] in dynvm.vm.ops_custom): a user's own
torch.library op (tests/vm/_custom_ops.py, five lines) compiles to CALL_CUSTOM, runs in
the interpreter and the JIT as eager does, is recorded in the .dvm file with its schema,
and a program whose op this process has not registered fails at dynvm.load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.vm.errors import UnregisteredOpError, UnsupportedOpError
from dynvm.vm.opcodes import opcode
from dynvm.vm.ops_custom import check_registered
from tests.jit._jit_helpers import eager_config
from tests.vm import _custom_ops  # noqa: F401 - registers dvmtest::scaled_gelu

REPO = Path(__file__).resolve().parents[2]
NAME = "dvmtest::scaled_gelu.default"


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.ops.dvmtest.scaled_gelu(self.a(x), 0.5)) + x


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    torch.manual_seed(0)
    module = _Block().eval()
    program = dynvm.compile(module, (torch.randn(2, 5, 8),),
                            ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=2, max=32)},))
    path = tmp_path_factory.mktemp("custom") / "block.dvm"
    dynvm.save(program, path)
    return module, program, path


def test_custom_op_is_one_instruction_with_its_schema(block):
    _, program, path = block
    (call,) = [instr for instr in program.code if instr.op == "CALL_CUSTOM"]
    name, _tensors, layout, schema, module = (getattr(a, "value", a) for a in call.args)
    assert name == NAME
    assert schema == "dvmtest::scaled_gelu(Tensor x, float scale) -> Tensor"
    assert module == "tests.vm._custom_ops"
    assert layout == (("t", 0), ("v", 0.5))
    loaded = dynvm.load(path)
    assert loaded.content_hash == program.content_hash
    assert [i for i in loaded.code if i.op == "CALL_CUSTOM"] == [call]


def test_interpreter_and_jit_match_eager(block):
    module, _, path = block
    program = dynvm.load(path)
    with dynvm.Runtime(program, jit=False) as interpreter, \
            dynvm.Runtime(program, jit=eager_config(families=True)) as jit:
        for shape in ((1, 3, 8), (4, 17, 8), (3, 9, 8)):
            x = torch.randn(shape)
            expected = module(x)
            torch.testing.assert_close(interpreter(x), expected)
            for _ in range(2):
                torch.testing.assert_close(jit(x), expected)
        stats = jit.stats()
    assert stats["specialized_region_calls"] >= 3
    assert stats["deopts"] == 0 and stats["specialize_failures_total"] == 0


def test_unregistered_op_fails_at_load_naming_it(block):
    """A fresh process that never imported the op's module: dynvm.load itself raises,
    naming the op and the module that registers it."""
    _, _, path = block
    script = ("import sys, dynvm\n"
              "from dynvm.vm.errors import UnregisteredOpError\n"
              "try:\n"
              f"    dynvm.load({str(path)!r})\n"
              "except UnregisteredOpError as exc:\n"
              "    print('REFUSED', exc)\n"
              "    sys.exit(0)\n"
              "print('LOADED')\n"
              "sys.exit(1)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"custom op {NAME} is not registered in this process" in done.stdout
    assert "import tests.vm._custom_ops" in done.stdout


def test_impl_is_the_custom_op():
    x = torch.randn(3, 4)
    got = opcode("CALL_CUSTOM").impl(NAME, [x], (("t", 0), ("v", 0.5)), "", "")
    torch.testing.assert_close(got, torch.ops.dvmtest.scaled_gelu(x, 0.5), rtol=0, atol=0)


def test_schema_mismatch_and_unknown_op_are_refused():
    with pytest.raises(UnregisteredOpError, match="dvmtest::never_registered.default"):
        check_registered("dvmtest::never_registered.default", "x", "")
    with pytest.raises(UnregisteredOpError, match="built for schema"):
        check_registered(NAME, "dvmtest::scaled_gelu(Tensor x) -> Tensor", "")
    assert issubclass(UnregisteredOpError, dynvm.DynvmError)


class _Mutating(torch.nn.Module):
    """Calls dvmtest::add_into, which writes its `out` argument: export wraps it in
    auto_functionalized_v2."""

    def forward(self, x):
        y = x * 2
        torch.ops.dvmtest.add_into(x, y)
        return y + 1, x


def test_functionalized_mutating_op_runs_on_copies():
    program = dynvm.compile(_Mutating(), (torch.randn(3, 4),), ({0: Dim("n", min=1, max=16)},))
    (call,) = [i for i in program.code if i.op.startswith("CALL_CUSTOM")]
    assert call.op == "CALL_CUSTOM_FUNCTIONAL" and call.args[5].value == (1,)
    with dynvm.Runtime(program, jit=False) as interpreter, \
            dynvm.Runtime(program, jit=eager_config(families=True)) as jit:
        for n in (2, 5, 9):
            x = torch.randn(n, 4)
            before = x.clone()
            expected = _Mutating()(x.clone())
            for runtime in (interpreter, jit, jit):
                got = runtime(x)
                assert torch.equal(x, before), "the program wrote its input"
                for a, e in zip(got, expected, strict=True):
                    torch.testing.assert_close(a, e)
        stats = jit.stats()
    assert stats["specialized_region_calls"] >= 3 and stats["deopts"] == 0


def test_mutating_op_left_mutating_is_refused_at_compile_time():
    """An op called on the mutated tensor itself, as export would never leave it: the
    lowering refuses it before any program exists."""
    from dynvm.vm.ops_custom import check_lowerable

    with pytest.raises(UnsupportedOpError, match=r"dvmtest.add_into.default mutates its "
                                                 r"argument\(s\) out"):
        check_lowerable(torch.ops.dvmtest.add_into.default, "test")


def test_specialization_with_a_custom_op_travels_to_a_replica(block):
    """A fleet replica installs the portable record of a specialization that calls the
    op (re-emitted from its own opcode table, Note [Portable specializations]) and runs
    it specialized."""
    import msgpack

    from dynvm.jit.config import JitConfig
    from dynvm.jit.portable import decode, encode

    module, _, path = block
    program = dynvm.load(path)
    x = torch.randn(2, 7, 8)
    with dynvm.Runtime(program, jit=eager_config()) as source:
        source(x)
        records = [(spec.artifact.key, msgpack.unpackb(msgpack.packb(
            encode(spec.ir, spec.strength, spec.signature, spec.family))))
            for region_jit in source.jit.regions.values() for spec in region_jit.installed()]
    assert records
    with dynvm.Runtime(program, jit=JitConfig(online_compile=False)) as target:
        for key, record in records:
            assert target.jit.install_portable(decode(record, program), key) is not None
        torch.testing.assert_close(target(x), module(x))
        assert target.stats()["specialized_region_calls"] == 1
