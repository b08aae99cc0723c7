"""Inconsistent and untrusted programs (Note [Program signature], Note [Signed
programs]): a .dvm file whose content hash and checksum were recomputed after an edit
passes the integrity checks, so the verifier checks the signature itself, and a loader
that requires signed programs refuses anything its secret did not sign."""

from __future__ import annotations

import dataclasses
import secrets

import pytest
import torch

import dynvm
from dynvm.cluster import ServingConfig, StoreConfig
from dynvm.cluster.fleet._link import FleetOptions
from dynvm.cluster.serving._limits import ServingLimits
from dynvm.cluster.serving._replica import ReplicaServer
from dynvm.vm import dvm_file, dvm_signature
from dynvm.vm.errors import CorruptSectionError, DvmSignatureError, VerifyError
from dynvm.vm.program import DimSpec, InputSpec, Program
from tests.vm._programs import build, compiled


def _forged(program: Program, **changes) -> bytes:
    """The .dvm bytes of `program` edited past the verifier, hash and checksum
    recomputed: what an attacker with write access to the file can produce."""
    fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(Program)
              if f.name != "_cache"}
    fields.update(changes)
    fake = object.__new__(Program)
    for name, value in fields.items():
        object.__setattr__(fake, name, value)
    object.__setattr__(fake, "_cache", {})
    return dvm_file.dumps(fake)


def _two_inputs() -> Program:
    return build("""
        0  %2 = ADD %0, %1
        1  RETURN {%2}
    """, regs=3, inputs=('"a" float32 [n:1..64]', '"b" float32 [n:1..64]'))


CASES = [
    ("two inputs with one name", lambda p: {"inputs": (p.inputs[0], dataclasses.replace(
        p.inputs[1], name="a"))}, "inputs 0 and 1 are both named 'a'"),
    ("a dim bound of 2**62", lambda p: {"inputs": (InputSpec(
        "a", torch.float32, (DimSpec("n", 1, 2**62),)), InputSpec(
        "b", torch.float32, (DimSpec("n", 1, 2**62),)))},
     f"input 'a' dim 0: bounds [1, {2**62}], expected 0 <= low <= high <= 2147483647"),
    ("2**20 registers", lambda p: {"n_regs": 2**20},
     "program declares 1048576 registers but its code uses registers up to %2 only"),
    ("a shared dim with two ranges", lambda p: {"inputs": (p.inputs[0], InputSpec(
        "b", torch.float32, (DimSpec("n", 1, 8),)))},
     "input 'b' dim 0: dim 'n' is [1, 8] here but [1, 64] in input 'a'"),
    ("a dynamic dim without a name", lambda p: {"inputs": (InputSpec(
        "a", torch.float32, (DimSpec("", 1, 64),)), p.inputs[1])},
     "input 'a' dim 0: a dynamic dim [1, 64] needs a name"),
    ("a bound above 2**31 - 1 on one input only", lambda p: {"inputs": (InputSpec(
        "a", torch.float32, (DimSpec("n", 1, 2**31),)), p.inputs[1])}, "bounds [1, 2147483648]"),
]


@pytest.mark.parametrize("case,change,message", CASES, ids=[c[0] for c in CASES])
def test_an_inconsistent_signature_does_not_load(case, change, message):
    program = _two_inputs()
    data = _forged(program, **change(program))
    with pytest.raises(CorruptSectionError) as info:
        dvm_file.loads(data)
    assert "the program does not verify" in str(info.value) and message in str(info.value)
    with pytest.raises(VerifyError, match=message.replace("[", r"\[").replace("*", r"\*")):
        Program(**{f.name: getattr(program, f.name) for f in dataclasses.fields(Program)
                   if f.name != "_cache"} | change(program))


def test_the_demo_programs_pass_the_signature_checks():
    for name in ("transformer", "recommender", "gnn", "branchy", "looping"):
        program = compiled(name)
        assert dvm_file.loads(dvm_file.dumps(program)).content_hash == program.content_hash


@pytest.fixture
def secret() -> bytes:
    return secrets.token_bytes(32)


def test_a_negative_bound_does_not_verify():
    program = _two_inputs()
    spec = InputSpec("a", torch.float32, (DimSpec("n", -1, 64),))
    with pytest.raises(VerifyError, match=r"bounds \[-1, 64\]"):
        dataclasses.replace(program, inputs=(spec, dataclasses.replace(spec, name="b")),
                            _cache={})


def _renamed(program: Program, name: str) -> Program:
    """The same program under another name (a fresh cache: the content hash changes)."""
    return dataclasses.replace(program, name=name, _cache={})


def test_a_signed_program_loads_only_as_signed(tmp_path, secret):
    program, path = compiled("looping"), tmp_path / "m.dvm"
    dvm_file.save(program, path, signing_secret=secret)
    assert dvm_file.load(path, signing_secret=secret).content_hash == program.content_hash
    assert dvm_file.load(path).content_hash == program.content_hash  # nobody checks: loads
    with pytest.raises(DvmSignatureError, match="does not match"):
        dvm_file.load(path, signing_secret=secrets.token_bytes(32))
    # An edit whose hash and checksum were recomputed: the integrity checks pass, the
    # signature does not.
    path.write_bytes(dvm_file.dumps(_renamed(program, "edited")))
    assert dvm_file.load(path).name == "edited"
    with pytest.raises(DvmSignatureError, match="changed after it was signed") as info:
        dvm_file.load(path, signing_secret=secret)
    assert secret.hex() not in str(info.value) and isinstance(info.value, dynvm.DynvmError)
    dvm_signature.sign_file(path, secret)  # re-signed by a holder of the secret
    assert dvm_file.load(path, signing_secret=secret).name == "edited"


@pytest.mark.parametrize("signature", [None, b"", b"{}", b"not json", b"x" * 10_000,
                                       b'{"v": 1, "alg": "HMAC-SHA256", "mac": "00"}'])
def test_a_missing_or_malformed_signature_is_refused(tmp_path, secret, signature):
    path = tmp_path / "m.dvm"
    dvm_file.save(compiled("looping"), path)
    if signature is not None:
        dvm_signature.signature_path(path).write_bytes(signature)
    with pytest.raises(DvmSignatureError):
        dvm_file.load(path, signing_secret=secret)


def test_a_replica_that_requires_signed_programs_refuses_an_unsigned_one(tmp_path, secret):
    path = tmp_path / "m.dvm"
    dvm_file.save(compiled("looping"), path)
    cls = ReplicaServer  # the class itself, without Serve
    fleet = FleetOptions(StoreConfig(secret=secret, local_dir=str(tmp_path / "store")))
    limits = ServingLimits(require_signed_programs=True)
    with pytest.raises(DvmSignatureError, match="no signature"):
        cls("m", str(path), ServingConfig(device="cpu", jit=False, fleet=fleet, limits=limits),
            probe_outputs=False)
    dvm_signature.sign_file(path, secret)
    replica = cls("m", str(path), ServingConfig(device="cpu", jit=False, fleet=fleet,
                                                limits=limits), probe_outputs=False)
    assert replica.program.name == "looping"
    with pytest.raises(ValueError, match="needs the fleet's store secret"):
        cls("m", str(path), ServingConfig(device="cpu", jit=False, limits=limits),
            probe_outputs=False)


def _serve_args(*argv: str):
    import argparse

    from dynvm._serve_cmd import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_dynvm_serve_require_signed_needs_the_store_secret(tmp_path, monkeypatch):
    from dynvm._run_cmd import CliError
    from dynvm._serve_cmd import options_from_args

    path = tmp_path / "m.dvm"
    dvm_file.save(compiled("looping"), path)
    monkeypatch.delenv("DYNVM_STORE_SECRET", raising=False)
    with pytest.raises(CliError, match="--require-signed checks .* DYNVM_STORE_SECRET, "
                                       "which is not set"):
        options_from_args(_serve_args(str(path), "--require-signed"))
    monkeypatch.setenv("DYNVM_STORE_SECRET", secrets.token_hex(32))
    signed = options_from_args(_serve_args(str(path), "--require-signed"))
    assert signed.serving.limits.require_signed_programs
    assert not options_from_args(_serve_args(str(path))).serving.limits.require_signed_programs
