"""A user's own torch.library op, as a user would write it (Note [Custom ops] in
dynvm.vm.ops_custom); registered once per process, when this module is imported."""

from __future__ import annotations

import torch


@torch.library.custom_op("dvmtest::scaled_gelu", mutates_args=())
def scaled_gelu(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * scale


@scaled_gelu.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("dvmtest::add_into", mutates_args=("out",))
def add_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.add_(x)


@add_into.register_fake
def _(x, out):
    return None
