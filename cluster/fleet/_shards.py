"""Which compile service shard serves a program.

Note [Compile service shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One compile service actor reads every observation of every replica of every program;
past a few hundred replicas it is the fleet's bottleneck (bench/fleet_sim.py, "Fleet
at scale" in docs/bench_log.md). The service is therefore split by program: with n
shards, the actors are named `<service>-0` .. `<service>-<n-1>` and program P is served
by shard int(P[:16], 16) mod n, a pure function of the content hash that every process
computes alike, so replicas of P, and only they, talk to that shard. A program's
promotion state lives whole in one shard, so a shape is still compiled once fleet-wide.
Each shard is its own Ray actor with its own restarts: a restarted shard has forgotten
its programs, answers "unknown", the replicas re-register, and it resumes from the
store's index (Note [Fleet promotion]) while the other shards carry on untouched.
One shard (the default) is the single actor named `<service>` as before.
"""

from __future__ import annotations

from dynvm.vm.errors import ConfigError


def shard_of(program_hash: str, shards: int) -> int:
    """The shard (0 .. shards-1) that serves `program_hash` (a hex content hash)."""
    if shards < 1:
        raise ConfigError(f"shards must be >= 1, got {shards}")
    return int(program_hash[:16], 16) % shards


def shard_actor_name(service_name: str, program_hash: str, shards: int) -> str:
    """The actor name of `program_hash`'s shard of the service named `service_name`."""
    if shards == 1:
        return service_name
    return f"{service_name}-{shard_of(program_hash, shards)}"


def shard_names(service_name: str, shards: int) -> list[str]:
    """Every shard's actor name, in shard order."""
    if shards == 1:
        return [service_name]
    return [f"{service_name}-{i}" for i in range(shards)]
