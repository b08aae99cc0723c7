"""One table of torch literal names, used by every codec (dynvm.vm.torch_literals)."""

import warnings

import msgpack
import pytest
import torch

from dynvm.jit.ir_codec import IrCodecError, decode_literal, encode_literal
from dynvm.vm import torch_literals
from dynvm.vm.errors import DvmFormatError, DynvmError
from dynvm.vm.operands import Imm
from dynvm.vm.serialize import decode_operand, encode_operand, pack, unpack
from dynvm.vm.torch_literals import UnknownTorchLiteral, literal_named


def _tensor_dtypes() -> list[torch.dtype]:
    """Every dtype torch defines that a tensor can be made with."""
    dtypes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 and quantized dtypes warn
        for value in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            try:
                torch.empty(0, dtype=value)
            except (RuntimeError, TypeError):
                continue
            dtypes.append(value)
    return sorted(dtypes, key=str)


TENSOR_DTYPES = _tensor_dtypes()
OTHER_LITERALS = [*torch_literals.LAYOUTS.values(), *torch_literals.MEMORY_FORMATS.values(),
                  torch.device("cpu"), torch.device("cuda:1"), torch.device("meta")]


def test_the_table_has_every_dtype_a_tensor_can_carry():
    assert len(TENSOR_DTYPES) > 30  # not an empty scan
    assert set(TENSOR_DTYPES) <= set(torch_literals.DTYPES.values())
    assert {torch.float8_e4m3fn, torch.uint16, torch.complex32, torch.qint8} <= set(
        TENSOR_DTYPES)


@pytest.mark.parametrize("value", TENSOR_DTYPES + OTHER_LITERALS, ids=str)
def test_every_literal_round_trips_through_every_codec(value):
    kind = torch_literals.kind_of(value)
    assert literal_named(kind, torch_literals.literal_name(value)) == value
    # the specialized-region IR (jit.ir_codec), also used by portable specializations
    assert decode_literal(msgpack.unpackb(msgpack.packb(encode_literal(value)))) == value
    # the .dvm file's msgpack extension types
    operand = decode_operand(unpack(pack(encode_operand(Imm(value))), "CODE"))
    assert operand == Imm(value)


def test_aliases_print_as_the_canonical_name():
    assert torch_literals.literal_name(torch.half) == "float16"
    assert literal_named("dtype", "float16") is torch.half


@pytest.mark.parametrize("kind, name, problem", [
    ("dtype", "float33", "unknown dtype 'float33'"),
    ("dtype", "channels_last", "unknown dtype 'channels_last'"),  # another kind's name
    ("dtype", "Tensor", "unknown dtype 'Tensor'"),  # a torch attribute, not a dtype
    ("dtype", 7, "a dtype name must be a string, got int"),
    ("layout", "float32", "unknown layout 'float32'"),
    ("memory_format", "_mkldnn", "unknown memory_format '_mkldnn'"),
    ("device", "tpu:0", "unknown device 'tpu:0'"),
    ("colour", "red", "unknown kind of torch literal 'colour'"),
])
def test_unknown_names_are_rejected_with_a_clear_error(kind, name, problem):
    with pytest.raises(UnknownTorchLiteral, match=problem) as caught:
        literal_named(kind, name)
    assert isinstance(caught.value, DynvmError)


def test_callers_raise_their_own_errors_with_the_codecs_message():
    with pytest.raises(IrCodecError, match="unknown dtype 'float33'"):
        decode_literal(["dtype", "float33"])
    bad = msgpack.packb(["i", msgpack.ExtType(1, b"float33")])
    with pytest.raises(DvmFormatError, match="unknown dtype 'float33'"):
        decode_operand(unpack(bad, "CODE"))
