"""Compiled artifacts and their one cache key.

Every compiled artifact has exactly one cache key, built here and only here, from
everything that affects what it computes: program hash, region, family key (for an
exact specialization: the signature), backend, target, toolchain versions and options
(docs/ARCHITECTURE.md, Invariants). Two processes that would build the same code compute the same
key; anything that could change the code changes the key.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from importlib.metadata import version

import torch

from dynvm.jit.artifact_keys import tagged_key

# dynvm's own version from its installed metadata (pyproject.toml), the source of
# `dynvm.__version__` too; importing the top package from here would be an upward edge
# (Note [Lazy top level] in dynvm/__init__.py). Read once: a metadata lookup costs ~0.5 ms.
DYNVM_VERSION = version("dynvm")


def toolchain_versions() -> dict[str, str]:
    """The versions of everything that shapes generated code, for `cache_key`."""
    versions = {"dynvm": DYNVM_VERSION, "torch": torch.__version__,
                "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:  # the CPU backend does not need it
        versions["triton"] = "none"
    return versions


def cache_key(program_hash: str, region: int, family_key: str, backend: str, target: str,
              options: dict | None = None, toolchain: dict | None = None) -> str:
    """The one cache key of a compiled artifact (module docstring): a sha256 of
    everything that affects its code, tagged with its program (Note [Program hash tags]);
    `toolchain` defaults to this process's versions."""
    material = {
        "program": program_hash,
        "region": region,
        "family": family_key,
        "backend": backend,
        "target": target,
        "toolchain": toolchain if toolchain is not None else toolchain_versions(),
        "options": options or {},
    }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return tagged_key(hashlib.sha256(blob.encode()).hexdigest(), program_hash)


@dataclass(frozen=True)
class Artifact:
    """What a compile produced: the key, the generated source and how it was made."""

    key: str
    backend: str
    target: str
    kernel_name: str
    source: str
    guard: str
    notes: tuple[str, ...] = ()
    compile_seconds: float = 0.0
    metadata: dict = field(default_factory=dict)
