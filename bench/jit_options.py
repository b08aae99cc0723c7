"""`--jit-option KEY=VALUE`: a benchmark's JIT under a config other than the default.

A published figure that compares the JIT with a feature on and off (channels-last
chains, fusion, the arena) must be one command a reader can run again, not a patched
default; so the benchmarks take JitConfig fields by name. Values are read as the
field's default is typed (bool, int, float, str); JitConfig's own checks then apply,
so a misspelt choice is refused with JitConfig's message.
"""

from __future__ import annotations

import dataclasses

import dynvm

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class JitOptionError(ValueError):
    """A --jit-option that names no JitConfig field or has a value of the wrong kind."""


def _value(name: str, text: str, default):
    if isinstance(default, bool):
        lowered = text.lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise JitOptionError(f"--jit-option {name}: expected true or false, got {text!r}")
    if isinstance(default, int | float):
        try:
            return type(default)(text)
        except ValueError:
            raise JitOptionError(f"--jit-option {name}: expected a {type(default).__name__}, "
                                 f"got {text!r}") from None
    if isinstance(default, str):
        return text
    raise JitOptionError(f"--jit-option {name}: not settable from the command line")


def jit_config(options: list[str] | None) -> dynvm.JitConfig:
    """JitConfig with the `KEY=VALUE` overrides in `options` (none: the default)."""
    defaults = dynvm.JitConfig()
    fields = {f.name for f in dataclasses.fields(defaults)}
    changes = {}
    for option in options or ():
        name, sep, text = option.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise JitOptionError(f"--jit-option {option!r}: expected KEY=VALUE")
        if name not in fields:
            raise JitOptionError(f"--jit-option {name!r}: JitConfig has no such field; "
                                 f"known: {', '.join(sorted(fields))}")
        changes[name] = _value(name, text.strip(), getattr(defaults, name))
    try:
        return dataclasses.replace(defaults, **changes)
    except (TypeError, ValueError) as exc:
        raise JitOptionError(f"--jit-option: {exc}") from None
