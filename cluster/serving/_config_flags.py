"""Command-line flags derived from a config dataclass's fields (`dynvm serve`'s from
`ServingConfig`'s): a new field is a new flag without touching the CLI.

    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServingConfig.local_stack())
    config = config_from_flags(parser.parse_args(), ServingConfig.local_stack())

Note [Flags from config fields]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each scalar field (bool, int, float, str, a Literal, `X | None`, a tuple of ints) is a
flag named after it (`num_cpus` -> `--num-cpus`; a field's `cli(...)` metadata may name
it otherwise, which keeps the flags users already type, or give it a unit); a field
whose value is a dataclass (`batching`, `limits`, `autoscaling`) gives its own fields
as flags, in an argparse group of its name; any other field (`jit`, `fleet`) is not a
flag. Its help is the field's docstring, its default the config's, read when the help
is printed: the flag's own default is None (bools: `--x/--no-x`, None), so a flag
that is not given leaves the config's value, the one default of each setting, alone.
A Literal's values are the flag's choices. Two fields that would make the same flag are
an error when the parser is built (tests/cluster/test_serve_cmd.py builds it).

A second config on the same command line (a generator's SchedulerConfig beside
ServingConfig) adds its flags the same way, in a group of its own; a field whose
setting is already another config's flag (the generator's rows are --max-batch-size,
as an inference batch's) says `cli(flag=..., shared=True)`: it reads that flag and adds
none, so one setting is never two flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import types
import typing
from dataclasses import dataclass

from dynvm.vm.errors import ConfigError

_CLI = "dynvm.cli"  # the metadata key of `cli(...)`
_METAVARS = {int: "N", float: "X", str: "TEXT"}


def cli(flag: str | None = None, *, scale: float | None = None,
        unit: str | None = None, shared: bool = False) -> dict:
    """A field's metadata for its flag: `flag` its name (default: the field's, in kebab
    case), `scale` what one unit of the flag is in the field's (0.001: the flag takes
    milliseconds for a field in seconds), `unit` the flag's unit, said in its help;
    `shared`: the flag is another config's, already on the parser (read, not added)."""
    return {_CLI: {"flag": flag, "scale": scale, "unit": unit, "shared": shared}}


class FlagError(ConfigError):
    """A flag's value that its field refuses; the message names the flag or the part."""


@dataclass(frozen=True)
class ConfigFlag:
    """One flag and the field it sets."""

    path: tuple[str, ...]
    """The field's names from the config down: ("num_replicas",) or ("batching",
    "max_batch_size")."""
    flag: str
    """The option string, e.g. "--max-batch-size"."""
    kind: type
    """The value's type: bool, int, float, str or tuple (of ints, given as "1,2,3")."""
    help: str
    """The field's docstring (and the flag's unit)."""
    choices: tuple | None = None
    """A Literal field's values."""
    scale: float | None = None
    """One unit of the flag in the field's units (None: the same)."""
    shared: bool = False
    """The flag is another config's: this field reads it, adds none."""

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under."""
        return self.flag.lstrip("-").replace("-", "_")

    def value(self, raw):
        """The field's value for the flag's `raw` value (FlagError if it cannot be)."""
        if self.kind is tuple:
            try:
                return tuple(int(n) for n in raw.split(",") if n.strip())
            except ValueError:
                raise FlagError(f"{self.flag} takes integers separated by commas, "
                                f"got {raw!r}") from None
        return raw * self.scale if self.scale is not None else raw

    def shown(self, value) -> str:
        """`value` (the field's) as the flag would give it, for the help."""
        if self.kind is tuple:
            return ",".join(str(n) for n in value) or "none"
        if self.scale is not None and value is not None:
            return f"{value / self.scale:g}"
        return str(value)


def _field_types(cls) -> dict[str, object]:
    """Each field's resolved type; a field whose annotation names what only a type
    checker imports (FleetOptions) is left out: it is no flag."""
    module = vars(sys.modules[cls.__module__])
    resolved = {}
    for f in dataclasses.fields(cls):
        try:
            # The text is a config dataclass's own annotation, from our source.
            kind = eval(f.type, module) if isinstance(f.type, str) else f.type  # safe: ours
            resolved[f.name] = kind
        except NameError:
            continue
    return resolved


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string right after its annotation), on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _scalar(kind) -> tuple[type, tuple | None] | None:
    """(type, choices) of a flag for a field of type `kind`, or None if it is no scalar."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        return str, tuple(args)
    if isinstance(kind, types.UnionType) and type(None) in args and len(args) == 2:
        return _scalar(next(a for a in args if a is not type(None)))
    if kind in (bool, int, float, str):
        return kind, None
    if typing.get_origin(kind) is tuple and args == (int, ...):
        return tuple, None
    return None


def _part(kind) -> type | None:
    """The dataclass a field of type `kind` holds (`X` or `X | None`), else None."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType) and type(None) in args and len(args) == 2:
        kind = next(a for a in args if a is not type(None))
    return kind if dataclasses.is_dataclass(kind) and isinstance(kind, type) else None


@functools.cache
def config_flags(cls) -> tuple[ConfigFlag, ...]:
    """The flags of `cls`'s fields and of its parts' (Note [Flags from config fields])."""
    flags = []

    def walk(owner, prefix: tuple[str, ...]) -> None:
        docs = field_docs(owner)
        types_ = _field_types(owner)
        for f in dataclasses.fields(owner):
            if f.name not in types_:
                continue
            scalar = _scalar(types_[f.name])
            part = _part(types_[f.name])
            if scalar is None:
                if part is not None and not prefix:
                    walk(part, (f.name,))
                continue
            meta = f.metadata.get(_CLI, {})
            unit = f" The flag takes {meta['unit']}." if meta.get("unit") else ""
            flags.append(ConfigFlag(
                path=(*prefix, f.name), flag=meta.get("flag") or
                "--" + f.name.replace("_", "-"), kind=scalar[0],
                help=docs.get(f.name, "") + unit, choices=scalar[1], scale=meta.get("scale"),
                shared=meta.get("shared", False)))

    walk(cls, ())
    seen: dict[str, tuple] = {}
    for flag in flags:
        if flag.flag in seen:
            raise ConfigError(f"{cls.__name__}: {'.'.join(seen[flag.flag])} and "
                              f"{'.'.join(flag.path)} both make {flag.flag}; name one "
                              f"with cli(flag=...) metadata")
        seen[flag.flag] = flag.path
    return tuple(flags)


def _default(config, path: tuple[str, ...]):
    """The value at `path` (one or two names deep) in `config`; a part that is None
    (autoscaling off) gives its class's default."""
    if len(path) == 1:
        return getattr(config, path[0])
    part = getattr(config, path[0])
    if part is None:
        part = _part(_field_types(type(config))[path[0]])()
    return getattr(part, path[1])


def add_config_flags(parser: argparse.ArgumentParser, defaults, *,
                     group: tuple[str, str] | None = None) -> None:
    """Add a flag for each of `defaults`' fields (a config instance whose values the
    help states as the defaults); a part's in a group of its name, and the top-level
    ones in `group` (title, description) when one is given."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    cls = type(defaults)
    types_ = _field_types(cls)
    top = parser.add_argument_group(*group) if group else parser
    for flag in config_flags(cls):
        if flag.shared:
            continue
        target = top
        if len(flag.path) > 1:
            name = flag.path[0]
            if name not in groups:
                part = _part(types_[name])
                groups[name] = parser.add_argument_group(name, inspect.getdoc(part))
            target = groups[name]
        shown = flag.shown(_default(defaults, flag.path))
        text = f"{flag.help} (default: {shown})".replace("%", "%%")
        if flag.kind is bool:
            target.add_argument(flag.flag, dest=flag.dest, default=None, help=text,
                                action=argparse.BooleanOptionalAction)
        elif flag.kind is tuple:
            target.add_argument(flag.flag, dest=flag.dest, metavar="N,N,...", help=text)
        else:
            target.add_argument(flag.flag, dest=flag.dest, type=flag.kind,
                                choices=flag.choices, help=text,
                                metavar=None if flag.choices else _METAVARS[flag.kind])


def config_from_flags(args, base):
    """`base` (a config) with the fields whose flags were given in `args` (argparse's
    namespace) changed; FlagError names the flag or the part a value is refused by."""
    top: dict[str, object] = {}
    parts: dict[str, dict[str, object]] = {}
    for flag in config_flags(type(base)):
        raw = getattr(args, flag.dest, None)
        if raw is None:
            continue
        if len(flag.path) == 1:
            top[flag.path[0]] = flag.value(raw)
        else:
            parts.setdefault(flag.path[0], {})[flag.path[1]] = flag.value(raw)
    types_ = _field_types(type(base))
    for name, values in parts.items():
        current = getattr(base, name)
        try:
            top[name] = (_part(types_[name])(**values) if current is None
                         else dataclasses.replace(current, **values))
        except ConfigError as exc:
            raise FlagError(f"bad {name} flag: {exc}") from None
    try:
        return dataclasses.replace(base, **top) if top else base
    except ConfigError as exc:
        raise FlagError(f"bad flag: {exc}") from None
