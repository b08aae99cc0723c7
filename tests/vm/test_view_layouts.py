"""VIEW on a layout the export's example did not have: torch.export resolves `reshape`
and `flatten` to `view` for the example's (NCHW) strides, and eager's reshape copies
where no view exists; a channels-last or sliced input must get eager's answer, not a
"view size is not compatible" error (the comment at VIEW in dynvm.vm.ops_tensor)."""

from __future__ import annotations

import torch
from torch.export import Dim

import dynvm
from dynvm.vm.opcodes import opcode
from tests.jit._jit_helpers import eager_config


class _FlattenHead(torch.nn.Module):
    """A classifier that flattens a whole feature map (VGG's and LeNet's head), not a
    1x1 pooled one: [N, C, H, W] -> [N, C*H*W] has no view for channels-last strides."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.head(torch.flatten(torch.relu(self.conv(x)), 1))


def _program():
    torch.manual_seed(0)
    model = _FlattenHead().eval()
    example = torch.randn(2, 3, 8, 8)
    program = dynvm.compile(model, (example,), ({0: Dim("batch", min=1, max=16)},))
    return model, program


def _layouts(batch: int, seed: int) -> dict[str, torch.Tensor]:
    base = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    wide = torch.randn(batch, 3, 8, 16, generator=torch.Generator().manual_seed(seed))
    return {"contiguous": base,
            "channels-last": base.contiguous(memory_format=torch.channels_last),
            "strided": wide[..., ::2],
            "offset": wide[..., 8:]}


def test_view_is_a_view_where_one_exists_and_a_copy_elsewhere():
    view = opcode("VIEW").impl
    x = torch.randn(2, 8, 6, 6)
    assert view(x, [2, 288]).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    nhwc = x.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(view(nhwc, [2, 288]), x.reshape(2, 288), rtol=0, atol=0)


def test_interpreter_and_jit_answer_every_layout_as_eager():
    model, program = _program()
    config = eager_config(families=True)
    with dynvm.Runtime(program, jit=False) as interpreter, \
            dynvm.Runtime(program, jit=config) as jit:
        for seed, batch in enumerate((2, 5, 2, 3, 5)):
            for layout, image in _layouts(batch, seed).items():
                expected = model(image)
                for runtime, what in ((interpreter, "interpreter"), (jit, "JIT")):
                    torch.testing.assert_close(runtime(image), expected, rtol=1e-5,
                                               atol=1e-5, msg=f"{what}, {layout}, {batch}")
        stats = jit.stats()
    assert stats["specialized_region_calls"] > 0
    assert stats["compile_failures"] == 0
