"""Every exception class dynvm defines derives from DynvmError (DESIGN.md, Conventions 11),
so `except dynvm.DynvmError` catches whatever dynvm raises on purpose; the classes keep
their builtin bases (ValueError, TimeoutError, ...) so existing `except` clauses work."""

from __future__ import annotations

import importlib

import pytest

from dynvm.vm.errors import DynvmError
from tests.dynvm._shipped import shipped_modules


def exception_classes() -> dict[str, type]:
    """module.Class -> class, for every exception class a shipped module defines."""
    found = {}
    for name in sorted(shipped_modules()):
        if name.endswith("__main__"):  # runs the command line when imported
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, BaseException)
                    and value.__module__ == name):
                found[f"{name}.{value.__qualname__}"] = value
    return found


def test_every_exception_class_derives_from_dynvm_error():
    classes = exception_classes()
    # The search sees the families it must (a broken search would pass vacuously).
    assert {"dynvm.vm.errors.ShapeError", "dynvm.cluster.store_base.StoreError",
            "dynvm.jit.specialize.SpecializationError",
            "dynvm.cluster.precompile.PrecompileError"} <= set(classes)
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, DynvmError))
    assert not outside, f"exception classes outside DynvmError: {outside}"


@pytest.mark.parametrize(("name", "builtin"), [
    ("dynvm.cluster.config.StoreConfigError", ValueError),
    ("dynvm.cluster.store_base.InvalidKey", ValueError),
    ("dynvm.jit.queue.CompileTimeout", TimeoutError),
    ("dynvm.jit.portable.PortableError", ValueError),
    ("dynvm.arena.planner.ArenaPlanError", ValueError),
    ("dynvm.cluster.local_redis.LocalRedisError", RuntimeError),
    ("dynvm._env.EnvVarError", ValueError),
])
def test_rebased_classes_keep_their_builtin_base(name, builtin):
    module, cls = name.rsplit(".", 1)
    assert issubclass(getattr(importlib.import_module(module), cls), builtin)
