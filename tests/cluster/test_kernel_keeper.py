"""A single process's kernels kept in a kernel store (Note [Kept kernels]): a restarted
Runtime installs what the store holds and compiles nothing for the shapes it held; a
forged entry is never installed. Real stores: the local directory and a real
redis-server."""

from __future__ import annotations

import secrets

import pytest
import torch

import dynvm
from dynvm.cluster import StoreConfig
from dynvm.vm.errors import ConfigError
from tests.cluster._redis_server import REDIS_SERVER, RedisServer, redis_config
from tests.jit._jit_helpers import assert_same, compiled, demo, eager, eager_config

SHAPES = [(2, 8), (4, 8), (2, 16)]


def _inputs(batch: int, seq: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(batch * 100 + seq)
    return (torch.randn(batch, seq, 64, generator=gen),)


def _serve_shapes(runtime, rounds: int = 3) -> None:
    module = demo("transformer").module
    for _ in range(rounds):
        for shape in SHAPES:
            inputs = _inputs(*shape)
            assert_same(runtime(*inputs), eager(module, inputs), what=str(shape))


@pytest.fixture(params=["local", "redis"])
def store(request, tmp_path):
    secret = secrets.token_bytes(32)
    if request.param == "local":
        yield StoreConfig(secret=secret, local_dir=str(tmp_path / "kernels"))
        return
    assert REDIS_SERVER is not None, "redis-server is not installed (run scripts/setup)"
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield StoreConfig(secret=secret, redis=redis_config(server))
    finally:
        server.stop()


def test_a_restarted_runtime_installs_its_kernels_instead_of_compiling(store):
    program = compiled("transformer")
    first = dynvm.Runtime(program, jit=eager_config(), kernel_store=store)
    assert first.kernel_keeper.stats()["installed"] == 0   # an empty store
    _serve_shapes(first)
    compiled_first = first.stats().compiles
    kept = first.kernel_keeper.stats()
    assert compiled_first > 0 and kept["published"] == compiled_first, (compiled_first, kept)

    restarted = dynvm.Runtime(program, jit=eager_config(), kernel_store=store)
    installed = restarted.kernel_keeper.stats()["installed"]
    assert installed == compiled_first
    _serve_shapes(restarted)
    stats = restarted.stats()
    print(f"\nfirst run: {compiled_first} compiles; restarted: {installed} installed, "
          f"{stats.compiles} compiles, specialized share {stats.specialized_ratio:.2f}")
    assert stats.compiles == 0
    assert stats.specialized_ratio > 0.5


def test_a_forged_kept_kernel_is_not_installed(tmp_path):
    program = compiled("transformer")
    directory = str(tmp_path / "kernels")
    store = StoreConfig(secret=secrets.token_bytes(32), local_dir=directory)
    _serve_shapes(dynvm.Runtime(program, jit=eager_config(), kernel_store=store), rounds=1)
    # The same directory opened with another secret: every entry (the index included)
    # fails its MAC, so nothing is installed and the JIT compiles as if it were empty.
    other = StoreConfig(secret=secrets.token_bytes(32), local_dir=directory)
    runtime = dynvm.Runtime(program, jit=eager_config(), kernel_store=other)
    assert runtime.kernel_keeper.stats()["installed"] == 0
    assert runtime.kernel_keeper.cache.stats()["rejected"] >= 1
    _serve_shapes(runtime, rounds=1)
    assert runtime.stats().compiles > 0


def test_kept_kernels_need_the_jit(tmp_path):
    program = compiled("transformer")
    store = StoreConfig(secret=secrets.token_bytes(32), local_dir=str(tmp_path / "k"))
    assert dynvm.Runtime(program, jit=False, kernel_store=store).kernel_keeper is None
    from dynvm.cluster.fleet._kernel_keeper import KernelKeeper

    with pytest.raises(ConfigError, match="JIT on"):
        KernelKeeper(dynvm.Runtime(program, jit=False), store)
