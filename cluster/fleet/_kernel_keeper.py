"""`KernelKeeper`: one process's compiled kernels kept in a kernel store, so that a
restarted Runtime installs them instead of compiling them again.

    keeper = keep_kernels(runtime, StoreConfig(secret=..., local_dir="~/.cache/dynvm"))
    # or: dynvm.Runtime(program, kernel_store=StoreConfig(...))

Note [Kept kernels]
~~~~~~~~~~~~~~~~~~~
A Runtime's JIT compiles what its traffic repeats and forgets it on exit: a restarted
process pays every compile again (seconds of a core each on the zoo's models) and runs
those calls in the interpreter meanwhile. A fleet does not, its replicas install what
the store lists; a single process gets the same from a store of its own (a local
directory, or Redis) through the same seams and records, with no compile service:

- at start, what the store's index lists for this program and target is fetched,
  verified (sealed entries, Note [Signed artifacts]) and installed with
  `Jit.install_portable`: code re-emitted from the portable record (Note [Portable
  specializations]), nothing specialized or compiled;
- every specialization this JIT compiles is sealed into the store and the index
  rewritten (the JIT's compile listener, on the compile thread, never on a call), at
  most `max_specializations_per_region` keys per region, newest last, as the compile
  service keeps it.

Several processes may share one store: what one publishes another installs at its next
start (they do not follow each other while running; that is the fleet's link and
announcements). The index is rewritten whole by whoever compiled last, so two processes
compiling at once can drop each other's newest key from it: a later start compiles that
shape again, never installs a wrong one (every listed key is verified when fetched).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from dynvm.cluster.fleet._compiler import TARGET
from dynvm.cluster.fleet._records import (
    index_key,
    keys_from_index,
    portable_from_fields,
    specialization_fields,
    write_index,
)
from dynvm.cluster.store._signed import ArtifactCache
from dynvm.cluster.store._store_config import StoreConfig
from dynvm.jit.artifact import toolchain_versions
from dynvm.jit.portable import PortableError
from dynvm.vm.errors import ConfigError

logger = logging.getLogger(__name__)


class KernelKeeper:
    """Installs a Runtime's kept kernels from a kernel store and keeps what its JIT
    compiles there (Note [Kept kernels])."""

    def __init__(self, runtime, store: StoreConfig) -> None:
        if runtime.jit is None:
            raise ConfigError("keeping kernels needs a Runtime with its JIT on")
        if str(runtime.device) != TARGET:
            raise ConfigError(f"kept kernels are CPU kernels; this Runtime runs on "
                              f"{runtime.device}")
        self.jit = runtime.jit
        self.program = runtime.program
        self.program_hash = self.program.content_hash
        self.cache = ArtifactCache(store.open_store(), store.secret,
                                   {"target": TARGET, "toolchain": toolchain_versions()})
        self._per_region = self.jit.config.max_specializations_per_region
        self._index: dict[int, OrderedDict[str, None]] = {}
        self._lock = threading.Lock()
        self.installed = 0
        self.published = 0
        self.publish_failures = 0

    def start(self) -> KernelKeeper:
        """Install what the store lists for this program, then keep what compiles."""
        key = index_key(self.program_hash, TARGET)
        fields = self.cache.fetch([key]).get(key)
        listed = keys_from_index(fields, self.program_hash) if fields is not None else []
        for artifact_key, artifact in self.cache.fetch(listed).items():
            try:
                portable = portable_from_fields(artifact, self.program)
                spec = self.jit.install_portable(portable, artifact_key)
            except PortableError as error:
                logger.warning("kept kernel %s not installed: %s", artifact_key[:16], error)
                continue
            self._index.setdefault(portable.region, OrderedDict())[artifact_key] = None
            self.installed += spec is not None
        self.jit.add_compile_listener(self._keep)
        return self

    def _keep(self, region_jit, spec) -> None:
        """Seal a specialization this JIT compiled into the store, then the index."""
        if not self.cache.publish(spec.artifact.key,
                                  specialization_fields(spec, self.program_hash)):
            self.publish_failures += 1
            return
        with self._lock:
            keys = self._index.setdefault(spec.ir.region_index, OrderedDict())
            keys[spec.artifact.key] = None
            while len(keys) > self._per_region:
                keys.popitem(last=False)
            listed = [k for region_keys in self._index.values() for k in region_keys]
            written = write_index(self.cache, self.program_hash, TARGET, listed)
        if written is None:
            self.publish_failures += 1
        else:
            self.published += 1

    def stats(self) -> dict[str, int]:
        """Kernels installed from the store at start, published since, failed writes."""
        return {"installed": self.installed, "published": self.published,
                "publish_failures": self.publish_failures}


def keep_kernels(runtime, store: StoreConfig) -> KernelKeeper:
    """Install `runtime`'s kernels kept in `store` and keep what its JIT compiles there
    from now on (Note [Kept kernels])."""
    return KernelKeeper(runtime, store).start()
