"""One input-shape check (dynvm.vm.input_check) for the VM and the HTTP protocol."""

import json

import pytest
import torch

from dynvm.cluster.protocol._v2 import BadRequest, parse_infer_request
from dynvm.vm.errors import ShapeError
from dynvm.vm.input_check import check_shape
from dynvm.vm.ops_shape import check_input
from dynvm.vm.program import DimSpec, InputSpec

DIMS = ((1, 16, "batch"), (4, 4, ""))
SPEC = InputSpec("dense", torch.float32, tuple(DimSpec(n, lo, hi) for lo, hi, n in DIMS))

# (shape, message): every refusal names the input, the dim, expected and actual
REFUSALS = [
    ((2,), "input 'dense': shape [2] has rank 1, expected rank 2 [batch:1..16, 4]"),
    ((2, 5), "input 'dense': dim 1 is 5, expected 4"),
    ((17, 4), "input 'dense': dim 0 (batch) is 17, outside its declared range [1, 16]"),
    ((0, 4), "input 'dense': dim 0 (batch) is 0, outside its declared range [1, 16]"),
]


@pytest.mark.parametrize("shape, message", REFUSALS)
def test_the_vm_and_the_protocol_refuse_with_the_same_message(shape, message):
    with pytest.raises(ShapeError) as direct:
        check_input(torch.zeros(shape), "dense", torch.float32, None, DIMS)
    assert str(direct.value) == message
    request = {"inputs": [{"name": "dense", "datatype": "FP32", "shape": list(shape),
                           "data": []}]}
    with pytest.raises(BadRequest) as http:
        parse_infer_request(json.dumps(request).encode(), [SPEC])
    assert http.value.message == message


def test_bounds_are_inclusive():
    for shape in ((1, 4), (16, 4)):
        check_shape("dense", shape, DIMS)


def test_a_named_dim_must_agree_across_inputs():
    bound: dict = {}
    check_shape("dense", (3, 4), DIMS, bound)
    assert bound == {"batch": (3, "dense")}
    check_shape("ids", (3,), ((1, 16, "batch"),), bound)
    with pytest.raises(ShapeError, match=r"^input 'ids': dim 0 \(batch\) is 2 but input "
                                         r"'dense' has batch=3$"):
        check_shape("ids", (2,), ((1, 16, "batch"),), bound)
