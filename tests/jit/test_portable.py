"""Portable specializations (Note [Portable specializations]): what one JIT compiled, a
fresh JIT installs from plain data without compiling, and runs with the same results;
records that do not describe the program are refused with the field named."""

from __future__ import annotations

import copy
import random

import msgpack
import pytest
import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.portable import PortableError, decode, encode
from tests.jit._jit_helpers import compiled, demo, eager_config

MODELS = ["transformer", "recommender", "gnn", "branchy", "looping"]


def _records(runtime) -> list[tuple[str, dict]]:
    out = []
    for region_jit in runtime.jit.regions.values():
        for spec in region_jit.installed():
            record = encode(spec.ir, spec.strength, spec.signature, spec.family)
            # Through msgpack, as the store carries it.
            out.append((spec.artifact.key, msgpack.unpackb(msgpack.packb(record))))
    return out


def _trained(name: str, families: bool, calls: int = 10, seed: int = 0):
    program = compiled(name)
    runtime = dynvm.Runtime(program, "cpu", jit=eager_config(families=families))
    rng = random.Random(seed)
    for _ in range(calls):
        runtime(*demo(name).sample_inputs(rng))
    return program, runtime


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("families", [False, True])
def test_installed_records_run_like_the_compiled_ones(name, families):
    program, source = _trained(name, families)
    records = _records(source)
    assert records, "nothing was compiled to carry over"
    target = dynvm.Runtime(program, "cpu", jit=JitConfig(online_compile=False))
    for key, record in records:
        assert target.jit.install_portable(decode(record, program), key) is not None
    stats = target.stats()
    assert stats["compiles"] == 0 and stats["installs"] == len(records)
    reference = dynvm.Runtime(program, "cpu", jit=False)
    rng = random.Random(0)  # the shapes the source JIT compiled for
    for _ in range(10):
        inputs = demo(name).sample_inputs(rng)
        for got, want in zip(torch.utils._pytree.tree_leaves(target(*inputs)),
                             torch.utils._pytree.tree_leaves(reference(*inputs))):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    after = target.stats()
    assert after["specialized_region_calls"] > 0
    assert after["compiles"] == 0, "online_compile=False must never compile"
    # The same key twice installs once.
    key, record = records[0]
    assert target.jit.install_portable(decode(record, program), key) is None


def test_record_under_another_key_is_refused():
    program, source = _trained("recommender", families=False)
    (key, record), *_ = _records(source)
    target = dynvm.Runtime(program, "cpu", jit=JitConfig(online_compile=False))
    with pytest.raises(PortableError, match="does not match the key"):
        target.jit.install_portable(decode(record, program), "0" * 64)
    assert target.stats()["install_rejections"] == 1
    assert target.stats()["installs"] == 0


def _corruptions(record: dict):
    def edit(fn):
        bad = copy.deepcopy(record)
        fn(bad)
        return bad

    yield "region", edit(lambda r: r.__setitem__("region", 10_000))
    yield "strength", edit(lambda r: r.__setitem__("strength", "psychic"))
    yield "ir.live_in", edit(lambda r: r["ir"].__setitem__("live_in", [0, 1, 2, 3, 4, 5, 6]))
    yield "ir.ops[0]", edit(lambda r: r["ir"]["ops"][0].__setitem__(0, "SYSTEM"))
    yield "ir.ops[0]", edit(lambda r: r["ir"]["ops"][0].__setitem__(5, "evil"))
    yield "ir.ops[0].dsts", edit(lambda r: r["ir"]["ops"][0].__setitem__(1, [10**9]))
    yield "ir.ops[0].args[0]", edit(
        lambda r: r["ir"]["ops"][0][2].insert(0, ["const", 10**9]))
    yield "ir.ops[0].args[0]", edit(
        lambda r: r["ir"]["ops"][0][2].insert(0, ["lit", ["os", "rm"]]))
    yield "ir.ops[0].args[0]", edit(
        lambda r: r["ir"]["ops"][0][2].insert(0, ["lit", ["dtype", "os"]]))
    yield "ir.ops[0].dsts", edit(lambda r: r["ir"]["ops"][0].__setitem__(1, [True]))
    yield "version", edit(lambda r: r.__setitem__("version", 99))
    yield "ir.abstract", edit(lambda r: r["ir"].__setitem__("abstract", []))
    yield "signature", edit(lambda r: r.__setitem__("signature", [["t", [1], "x"]]))


def test_malformed_records_name_the_field():
    program, source = _trained("recommender", families=False)
    (_, record), *_ = _records(source)
    decode(record, program)  # the pristine one is fine
    for field, bad in _corruptions(record):
        with pytest.raises(PortableError) as caught:
            decode(bad, program)
        assert field in str(caught.value), (field, str(caught.value))
    with pytest.raises(PortableError, match="expected a map"):
        decode([1, 2], program)


def test_record_for_another_program_is_refused():
    program, source = _trained("recommender", families=False)
    other = compiled("gnn")
    refused = 0
    for _key, record in _records(source):
        try:
            decode(record, other)
        except PortableError:
            refused += 1
    assert refused == len(_records(source))
