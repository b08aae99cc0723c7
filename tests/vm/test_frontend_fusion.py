"""The frontend's fusion passes: RMS norm chains as one RMS_NORM (Note [RMS norm as one
op]) and linears reading one input as one LINEAR and a split (Note [Parallel linears as
one]): the values of eager, one copy of the weights, and the chains left alone where the
definition is not the graph's."""

from __future__ import annotations

import torch
from torch.export import Dim

import dynvm
from dynvm.vm.interpreter import Interpreter


class _RmsNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm, as written there."""

    def __init__(self, width: int, dim: int = -1) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.dim = dim

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(self.dim, keepdim=True)
        x = x * torch.rsqrt(variance + 1e-6)
        return self.weight * x.to(dtype)


class _Attention(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.norm = _RmsNorm(16)
        self.q = torch.nn.Linear(16, 16, bias=bias)
        self.k = torch.nn.Linear(16, 8, bias=bias)
        self.v = torch.nn.Linear(16, 8, bias=bias)
        self.other = torch.nn.Linear(8, 16)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        return q.view(*q.shape[:-1], 2, 8).sum(-2) + k * v, self.other(v)


def _ops(program) -> list[str]:
    return [instr.op for instr in program.code]


def _lower(module, x):
    return dynvm.compile(module, (x,), ({0: Dim("batch", min=1, max=8)},))


def test_rms_norm_chain_is_one_op_with_eager_values():
    torch.manual_seed(0)
    module = _RmsNorm(24)
    x = torch.randn(3, 5, 24)
    program = _lower(module, x)
    ops = _ops(program)
    assert "RMS_NORM" in ops and not {"POW", "RSQRT", "MEAN", "MUL"} & set(ops), ops
    with torch.no_grad():
        assert torch.equal(Interpreter(program).run([x[:2]])[0], module(x[:2]))  # bit for bit


def test_rms_norm_of_half_inputs_normalizes_the_upcast():
    # The norm of the float32 upcast is fused; the cast back and the weight stay: torch's
    # kernel would round a half input differently (Note [RMS norm as one op]).
    module = _RmsNorm(24).to(torch.bfloat16)
    x = torch.randn(3, 5, 24, dtype=torch.bfloat16)
    program = _lower(module, x)
    ops = _ops(program)
    assert ops.count("RMS_NORM") == 1 and "RSQRT" not in ops and "MUL" in ops, ops
    with torch.no_grad():
        assert torch.equal(Interpreter(program).run([x])[0], module(x))


def test_rms_norm_over_another_dim_stays_as_written():
    module = _RmsNorm(5, dim=1)
    x = torch.randn(2, 5, 5)
    program = _lower(module, x)
    assert "RMS_NORM" not in _ops(program) and "RSQRT" in _ops(program)
    torch.testing.assert_close(Interpreter(program).run([x])[0], module(x))


def test_parallel_linears_become_one_with_one_copy_of_the_weights():
    torch.manual_seed(0)
    for bias in (False, True):
        module = _Attention(bias).eval()
        x = torch.randn(4, 3, 16)
        with torch.no_grad():
            expected = module(x)
        program = _lower(module, x)
        ops = _ops(program)
        # q, k, v as one; `other` reads another input and stays apart.
        assert ops.count("LINEAR") == 2 and ops.count("SPLIT_WITH_SIZES") == 1, ops
        names = program.constant_names
        assert not any(n in ("q.weight", "k.weight", "v.weight") for n in names), names
        stacked = dict(zip(names, program.constants))["[q.weight+k.weight+v.weight]"]
        assert stacked.shape == (32, 16)
        # The module's parameters are now row views of the program's constant.
        for name, rows in (("q", slice(0, 16)), ("k", slice(16, 24)), ("v", slice(24, 32))):
            weight = getattr(module, name).weight
            assert weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
            assert torch.equal(weight, stacked[rows])
        for got, want in zip(Interpreter(program).run([x]), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # A second export of the same module takes a view: still one storage.
        again = _lower(module, x)
        held = dict(zip(again.constant_names, again.constants))["[q.weight+k.weight+v.weight]"]
        assert held.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()


def test_a_weight_read_twice_is_not_stacked():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8, bias=False)
            self.b = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return self.a(x) + self.b(x) + torch.nn.functional.linear(x * 2, self.a.weight)

    module = Tied().eval()
    x = torch.randn(2, 8)
    program = _lower(module, x)
    assert "SPLIT_WITH_SIZES" not in _ops(program)
    torch.testing.assert_close(Interpreter(program).run([x])[0], module(x))


class _Rotary(torch.nn.Module):
    """Hugging Face's rotate_half and apply_rotary_pos_emb on the query and key."""

    def forward(self, q, k, cos, sin):
        def rotate_half(x):
            return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)

        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_rotary_chain_is_one_op_with_eager_values():
    torch.manual_seed(0)
    q, k, cos, sin = (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8),
                      torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    batch = Dim("batch", min=1, max=8)
    program = dynvm.compile(_Rotary(), (q, k, cos, sin), ({0: batch},) * 4)
    ops = _ops(program)
    assert ops.count("ROTARY") == 2 and not {"NEG", "CAT", "SLICE"} & set(ops), ops
    for got, want in zip(Interpreter(program).run([q, k, cos, sin]), _Rotary()(q, k, cos, sin),
                         strict=True):
        assert torch.equal(got, want)   # the same operations, bit for bit


class _GatedMlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 32, bias=False)
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_gated_mlp_is_one_linear_and_one_silu_mul():
    torch.manual_seed(0)
    module = _GatedMlp().eval()
    x = torch.randn(4, 3, 16)
    with torch.no_grad():
        expected = module(x)
    program = _lower(module, x)
    ops = _ops(program)
    assert ops.count("LINEAR") == 2 and "SILU_MUL" in ops, ops
    assert not {"SPLIT_WITH_SIZES", "SILU", "MUL"} & set(ops), ops
    torch.testing.assert_close(Interpreter(program).run([x])[0], expected, rtol=1e-5, atol=1e-5)
