"""Portable specializations: a compile's result as plain data that another process installs.

Note [Portable specializations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The compile service specializes a region once for the whole fleet; every replica then
installs the result without compiling. What travels is not the generated source but the
specializer's output: the `SpecializedRegion` IR (operations named by opcode, over
registers, program-constant indices and literals from a closed set of types), the
abstract values the arena planner needs, and the guard (an exact signature, or a
family's structure and bounds). Installing re-emits the backend's code from the IR, a
linear pass of a few milliseconds next to the specializer's abstract evaluation at every
probe; the shape analysis, which is what a compile costs, is never repeated.

Why not ship the source and run it: a record has passed the HMAC check of Note [Signed
artifacts] before it gets here, so it was written by a holder of the cluster's secret;
re-emitting from validated IR is the second wall. The only code a replica runs is code
it generated itself from operations of its own opcode table, with every literal
rendered by `repr` or bound as a value, so even a record that is well signed but wrong
cannot make a replica run anything its bytecode could not. `decode` checks every field
against the program (region, live-ins, opcodes, registers, constant indices, literal
types) and raises `PortableError` naming the field; nothing is half-installed.

Records are msgpack-able dicts (no pickle): ints, floats, strings, lists and maps;
operands use the tagged lists of dynvm.jit.ir_codec, as the Triton artifact's plan does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvm.jit.guards import GuardStrength
from dynvm.jit.ir import ConstRef, SpecializedRegion, SpecOp, Var
from dynvm.jit.ir_codec import IrCodecError, decode_value, encode_value
from dynvm.shape_cluster import SCALAR, TENSOR, Family, ScalarPart, TensorPart
from dynvm.shape_cluster.signature import is_tensor_entry
from dynvm.vm import torch_literals
from dynvm.vm.errors import DynvmError
from dynvm.vm.opcodes import OPCODES
from dynvm.vm.shapes import intern_shape
from dynvm.vm.torch_literals import UnknownTorchLiteral, literal_name

RECORD_VERSION = 1
_SCALAR_TYPES = {"int": int, "float": float, "bool": bool}


class PortableError(DynvmError, ValueError):
    """A record that does not describe a specialization of this program (names the field)."""


@dataclass(frozen=True)
class PortableSpecialization:
    """A decoded record: everything `Jit.install_portable` needs except the code."""

    region: int
    strength: GuardStrength
    signature: tuple            # exact guard; () for a family kernel
    family: Family | None
    ir: SpecializedRegion


# -- encoding ------------------------------------------------------------------------


def _encode_abstract(value):
    if isinstance(value, torch.Tensor):
        return ["T", list(value.shape), list(value.stride()), value.storage_offset(),
                literal_name(value.dtype)]
    if isinstance(value, bool | int | float):
        return ["S", value]
    raise PortableError(f"abstract value of type {type(value).__name__} cannot be encoded")


def encode_signature(signature: tuple) -> list:
    """A strong signature (Note [Guard strength]) as plain data."""
    out = []
    for entry in signature:
        if is_tensor_entry(entry):
            shape, dtype, strides, offset, device = entry
            out.append(["t", list(shape.dims), literal_name(dtype), list(strides), offset,
                        str(device)])
        else:
            kind, value = entry
            out.append(["s", kind.__name__, value])
    return out


def _encode_family(family: Family) -> dict:
    structure = []
    for part in family.structure:
        if part.tag == TENSOR:
            structure.append(["t", part.rank, literal_name(part.dtype), str(part.device),
                              part.layout])
        else:
            structure.append(["s", part.type.__name__, part.value])
    bounds = [None if dims is None else [list(b) for b in dims] for dims in family.bounds]
    return {"structure": structure, "bounds": bounds}


def encode(ir: SpecializedRegion, strength: GuardStrength, signature: tuple,
           family: Family | None) -> dict:
    """The record of one specialization (see Note [Portable specializations])."""
    return {
        "version": RECORD_VERSION,
        "region": ir.region_index,
        "strength": strength.value,
        "signature": encode_signature(signature) if family is None else None,
        "family": _encode_family(family) if family is not None else None,
        "ir": {
            "live_in": list(ir.live_in),
            "ops": [[op.opcode, list(op.dsts), [encode_value(a) for a in op.args],
                     op.source_pc, list(op.frees), op.variant] for op in ir.ops],
            "outputs": [[reg, encode_value(v)] for reg, v in ir.outputs],
            "dead_live_ins": list(ir.dead_live_ins),
            "assumes_shapes": ir.assumes_shapes,
            "notes": list(ir.notes),
            "instructions": ir.instructions,
            "abstract": [[[reg, _encode_abstract(v)] for reg, v in probe.items()]
                         for probe in ir.abstract],
        },
    }


# -- decoding (validating) -------------------------------------------------------------


class _Decoder:
    def __init__(self, program=None) -> None:
        self.program = program
        self.n_regs = program.n_regs if program is not None else 0
        self.n_consts = len(program.constants) if program is not None else 0

    def fail(self, where: str, problem: str):
        raise PortableError(f"{where}: {problem}")

    def int_in(self, value, bound: int, where: str) -> int:
        if type(value) is not int or not 0 <= value < bound:
            self.fail(where, f"expected an integer in [0, {bound}), got {value!r}")
        return value

    def seq(self, value, where: str) -> list:
        if not isinstance(value, list | tuple):
            self.fail(where, f"expected a list, got {type(value).__name__}")
        return list(value)

    def reg(self, value, where: str) -> int:
        return self.int_in(value, self.n_regs, where)

    def regs(self, value, where: str) -> tuple[int, ...]:
        return tuple(self.reg(v, f"{where}[{i}]") for i, v in enumerate(self.seq(value, where)))

    def torch_enum(self, kind: str, name, where: str):
        """The dtype, layout, memory format or device `name` names."""
        try:
            return torch_literals.literal_named(kind, name)
        except UnknownTorchLiteral as exc:
            self.fail(where, str(exc))

    def device(self, text, where: str) -> torch.device:
        return self.torch_enum("device", text, where)

    def value(self, raw, where: str):
        """An operand (dynvm.jit.ir_codec), its registers and constants in range."""
        try:
            value = decode_value(raw)
        except IrCodecError as error:
            self.fail(where, str(error))
        self.check_operand(value, where)
        return value

    def check_operand(self, value, where: str) -> None:
        if isinstance(value, Var):
            self.reg(value.reg, where)
        elif isinstance(value, ConstRef):
            self.int_in(value.index, self.n_consts, where)
        elif isinstance(value, list):
            for item in value:
                self.check_operand(item, where)

    def op(self, raw, where: str) -> SpecOp:
        fields = self.seq(raw, where)
        if len(fields) != 6:
            self.fail(where, f"expected 6 fields, got {len(fields)}")
        name, dsts, args, source_pc, frees, variant = fields
        if name not in OPCODES:
            self.fail(where, f"unknown opcode {name!r}")
        if variant not in ("", "inplace") or (variant == "inplace"
                                               and OPCODES[name].inplace is None):
            self.fail(where, f"opcode {name} has no variant {variant!r}")
        return SpecOp(name, self.regs(dsts, f"{where}.dsts"),
                      tuple(self.value(a, f"{where}.args[{i}]")
                            for i, a in enumerate(self.seq(args, f"{where}.args"))),
                      self.int_in(source_pc, len(self.program.code), f"{where}.source_pc"),
                      self.regs(frees, f"{where}.frees"), variant)

    def output(self, raw, where: str) -> tuple:
        pair = self.seq(raw, where)
        if len(pair) != 2:
            self.fail(where, "expected a [register, value] pair")
        return self.reg(pair[0], where), self.value(pair[1], where)

    def abstract(self, raw, where: str) -> dict:
        probe = {}
        for i, pair in enumerate(self.seq(raw, where)):
            at = f"{where}[{i}]"
            fields = self.seq(pair, at)
            if len(fields) != 2:
                self.fail(at, "expected a [register, value] pair")
            reg, value = fields
            entry = self.seq(value, at)
            if entry and entry[0] == "S" and len(entry) == 2 and \
                    isinstance(entry[1], bool | int | float):
                probe[self.reg(reg, at)] = entry[1]
                continue
            if not entry or entry[0] != "T" or len(entry) != 5:
                self.fail(at, "expected ['T', dims, strides, offset, dtype] or ['S', value]")
            _, dims, strides, offset, dtype = entry
            dims, strides = self.dims(dims, at), self.dims(strides, at)
            if len(dims) != len(strides):
                self.fail(at, "dims and strides differ in rank")
            tensor = torch.empty_strided(dims, strides, device="meta",
                                         dtype=self.torch_enum("dtype", dtype, at))
            if self.int_in(offset, 1 << 62, at):
                tensor = tensor.as_strided(dims, strides, offset)
            probe[self.reg(reg, at)] = tensor
        return probe

    def dims(self, raw, where: str) -> tuple[int, ...]:
        return tuple(self.int_in(d, 1 << 62, where) for d in self.seq(raw, where))

    def signature(self, raw, where: str) -> tuple:
        out = []
        for i, entry in enumerate(self.seq(raw, where)):
            at = f"{where}[{i}]"
            fields = self.seq(entry, at)
            if fields and fields[0] == "t" and len(fields) == 6:
                _, dims, dtype, strides, offset, device = fields
                out.append((intern_shape(self.dims(dims, at)),
                            self.torch_enum("dtype", dtype, at), self.dims(strides, at),
                            self.int_in(offset, 1 << 62, at), self.device(device, at)))
            elif fields and fields[0] == "s" and len(fields) == 3 and \
                    fields[1] in _SCALAR_TYPES:
                kind = _SCALAR_TYPES[fields[1]]
                if type(fields[2]) is not kind:
                    self.fail(at, f"scalar {fields[2]!r} is not a {fields[1]}")
                out.append((kind, fields[2]))
            else:
                self.fail(at, "expected ['t', dims, dtype, strides, offset, device] or "
                              "['s', type, value]")
        return tuple(out)

    def family(self, raw, where: str) -> Family:
        if not isinstance(raw, dict):
            self.fail(where, "expected a map")
        structure = []
        for i, part in enumerate(self.seq(raw.get("structure"), f"{where}.structure")):
            at = f"{where}.structure[{i}]"
            fields = self.seq(part, at)
            if fields and fields[0] == "t" and len(fields) == 5:
                _, rank, dtype, device, layout = fields
                structure.append(TensorPart(TENSOR, self.int_in(rank, 64, at),
                                            self.torch_enum("dtype", dtype, at),
                                            self.device(device, at),
                                            self.layout_class(layout, at)))
            elif fields and fields[0] == "s" and len(fields) == 3 and \
                    fields[1] in _SCALAR_TYPES:
                structure.append(ScalarPart(SCALAR, _SCALAR_TYPES[fields[1]], fields[2]))
            else:
                self.fail(at, "expected a tensor or scalar structure part")
        bounds = []
        for i, dims in enumerate(self.seq(raw.get("bounds"), f"{where}.bounds")):
            at = f"{where}.bounds[{i}]"
            if dims is None:
                bounds.append(None)
                continue
            pairs = []
            for pair in self.seq(dims, at):
                low, high = self.dims(pair, at)
                if low > high:
                    self.fail(at, f"empty bound ({low}, {high})")
                pairs.append((low, high))
            bounds.append(tuple(pairs))
        try:
            return Family(tuple(structure), tuple(bounds))
        except ValueError as exc:
            self.fail(where, str(exc))

    def layout_class(self, text, where: str) -> str:
        if text not in ("contiguous", "strided"):
            self.fail(where, f"unknown layout class {text!r}")
        return text


def decode_signature(raw, live_ins: int) -> tuple:
    """A strong signature from `encode_signature`'s form, for a region of `live_ins`."""
    signature = _Decoder().signature(raw, "signature")
    if len(signature) != live_ins:
        raise PortableError(f"signature: {len(signature)} entries for {live_ins} live-ins")
    return signature


def decode(record, program) -> PortableSpecialization:
    """Validate `record` against `program` and rebuild the specialization's IR and guard."""
    d = _Decoder(program)
    if not isinstance(record, dict):
        raise PortableError(f"record: expected a map, got {type(record).__name__}")
    if record.get("version") != RECORD_VERSION:
        raise PortableError(f"record version {record.get('version')!r} is not "
                            f"{RECORD_VERSION}")
    region_index = d.int_in(record.get("region"), len(program.regions), "region")
    region = program.regions[region_index]
    try:
        strength = GuardStrength(record.get("strength"))
    except ValueError:
        d.fail("strength", f"unknown guard strength {record.get('strength')!r}")
    ir = record.get("ir")
    if not isinstance(ir, dict):
        d.fail("ir", "expected a map")
    live_in = d.regs(ir.get("live_in"), "ir.live_in")
    if live_in != tuple(r.index for r in region.live_in):
        d.fail("ir.live_in", f"{live_in} are not region {region_index}'s live-ins")
    notes = d.seq(ir.get("notes", []), "ir.notes")
    if not all(isinstance(n, str) for n in notes):
        d.fail("ir.notes", "expected strings")
    if not isinstance(ir.get("assumes_shapes"), bool):
        d.fail("ir.assumes_shapes", "expected a boolean")
    specialized = SpecializedRegion(
        region_index=region_index,
        live_in=live_in,
        ops=tuple(d.op(op, f"ir.ops[{i}]") for i, op in enumerate(d.seq(ir.get("ops"),
                                                                       "ir.ops"))),
        outputs=tuple(d.output(pair, f"ir.outputs[{i}]")
                      for i, pair in enumerate(d.seq(ir.get("outputs"), "ir.outputs"))),
        dead_live_ins=d.regs(ir.get("dead_live_ins"), "ir.dead_live_ins"),
        assumes_shapes=ir["assumes_shapes"],
        notes=tuple(notes),
        instructions=d.int_in(ir.get("instructions"), len(program.code) + 1,
                              "ir.instructions"),
        abstract=tuple(d.abstract(p, f"ir.abstract[{i}]")
                       for i, p in enumerate(d.seq(ir.get("abstract"), "ir.abstract"))),
    )
    if not specialized.abstract:
        d.fail("ir.abstract", "a specialization needs at least one probe")
    if strength is GuardStrength.FAMILY:
        family = d.family(record.get("family"), "family")
        if len(family.structure) != len(live_in):
            d.fail("family", f"{len(family.structure)} structure parts for "
                             f"{len(live_in)} live-ins")
        return PortableSpecialization(region_index, strength, (), family, specialized)
    signature = d.signature(record.get("signature"), "signature")
    if len(signature) != len(live_in):
        d.fail("signature", f"{len(signature)} entries for {len(live_in)} live-ins")
    return PortableSpecialization(region_index, strength, signature, None, specialized)


def retarget(portable: PortableSpecialization, device: torch.device) -> PortableSpecialization:
    """The same specialization guarded for tensors on `device`. The compile service
    specializes from signatures on its own device (a CPU); a GPU replica installing the
    record (dynvm.cluster.fleet._gpu) guards on its device instead. Only the guard's device
    changes: shapes, dtypes, strides, bounds and the IR (whose abstract values are device
    free; device literals mean "the runtime's device") stay as they were."""
    device = torch.device(device)
    signature = tuple((*entry[:4], device) if is_tensor_entry(entry) else entry
                      for entry in portable.signature)
    family = portable.family
    if family is not None:
        structure = tuple(part._replace(device=device) if part.tag == TENSOR else part
                          for part in family.structure)
        family = Family(structure, family.bounds)
    return PortableSpecialization(portable.region, portable.strength, signature, family,
                                  portable.ir)
