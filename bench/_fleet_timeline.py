"""Where a shape's time goes in the fleet simulator (bench/fleet_sim.py): per artifact,
the compile service's own clock (promoted, compile started, compiled, published), read
inside the real service actors; per shape, the chain from its first sighting to
installed on 99% of its program's replicas.

Note [Fleet stage clock]
~~~~~~~~~~~~~~~~~~~~~~~~
Every time is wall clock (time.time()) on the one machine, so the service actors' and
the host processes' stamps compare directly. Per (program, shape) sighted and served:

  sighted     first request for the shape anywhere in the fleet (any host)
  promoted    the service's JIT queued the compile of the artifact that first served
              it (Jit.promote -> CompileQueue.submit; the first submit of that key)
  started     a compile worker took it off the queue
  compiled    the compile returned (the worker then publishes, on the same thread)
  published   stored, index rewritten and PUBLISHed (the listener after the
              service's publish listener)
  heard       the first simulated replica read the announcement off its subscription
  first       the first replica served the shape (the artifact fetched, verified and
              installed there), then 50% and 99% of the program's replicas.

Traffic starts once every host has started its replicas (registered, warm-started from
the index, subscribed) and every shard has finished its warm-up (Note [Warm compile
service]), at N = 10 as at N = 1000: no start-up cost lands in one N's figures and not
the other's.

`sight -> promoted` is the fleet's recurrence (K sightings of the shape counted at the
service, reports every 50 ms) and so depends on traffic: at N = 10 a rare shape comes
back seconds after its first sighting, at N = 1000 within one report. The stage medians
are taken per stage over the shapes that reached it, so they need not add up to the
end-to-end median (their means do, over the shapes that have every stage). A shape
served by an artifact compiled for another shape (a family kernel) before it was
promoted itself has no promoted/started stage of its own; it counts in the stages it
has.

The instrumentation runs inside the real service actor (Ray's `__ray_call__`): it wraps
each program JIT's queue `submit` to stamp the key and its task, and adds a compile
listener after the service's own. It changes no decision the service makes.
"""

from __future__ import annotations

import math
import statistics
import time

STAGES = ("promoted", "started", "compiled", "published", "heard")


def instrument(service) -> bool:
    """Run in a CompileService actor (`handle.__ray_call__.remote(instrument)`): stamp
    every program the service loads from now on (Note [Fleet stage clock])."""
    compiler = service.compiler
    timeline: dict[str, dict] = {}
    service.fleet_timeline = timeline
    register = compiler.register

    def timed_register(program_hash: str, dvm_bytes: bytes) -> None:
        known = compiler.knows(program_hash)
        register(program_hash, dvm_bytes)
        if not known:
            _stamp(compiler._programs[program_hash].jit, timeline)

    compiler.register = timed_register
    return True


def _stamp(jit, timeline: dict) -> None:
    queue = jit.queue
    submit = queue.submit

    def timed_submit(key, benefit, task):
        record = timeline.setdefault(key, {"promoted": time.time(), "queued": len(queue)})

        def timed_task():
            record.setdefault("started", time.time())
            try:
                return task()
            finally:
                record.setdefault("compiled", time.time())

        return submit(key, benefit, timed_task)

    queue.submit = timed_submit
    jit.add_compile_listener(lambda region_jit, spec: timeline.setdefault(
        spec.artifact.key, {}).setdefault("published", time.time()))


def read(service) -> dict:
    """Run in a CompileService actor: the stamps taken so far."""
    return dict(getattr(service, "fleet_timeline", {}))


def shape_stages(hosts: list[dict], timelines: list[dict]) -> dict:
    """Per stage of Note [Fleet stage clock], the median seconds from the stage before
    (over the shapes that have both), with how many shapes that is; plus the median
    queue length met at promotion and the first compile's time per shard."""
    service: dict[str, dict] = {}
    for shard in timelines:
        service.update(shard)
    heard: dict[str, float] = {}
    for host in hosts:
        for key, t in host["announced_first_seen"].items():
            heard[key] = min(t, heard.get(key, t))
    sighted: dict[str, float] = {}
    first_keys: dict[str, list[str]] = {}
    for host in hosts:
        for shape, t in host["first_sighting"].items():
            sighted[shape] = min(t, sighted.get(shape, t))
        first_keys.update(host.get("first_keys", {}))
    served: dict[str, list[float]] = {}
    population: dict[int, int] = {}
    for host in hosts:
        for replica in host["replicas"]:
            population[replica["program"]] = population.get(replica["program"], 0) + 1
            for shape, t in replica["served_at"].items():
                served.setdefault(f"{replica['program']}:{shape}", []).append(t)
    steps: dict[str, list[float]] = {}
    chains: dict[str, dict[str, float]] = {}   # shape -> stage -> seconds since sighted
    for shape, times in served.items():
        if shape not in sighted or shape not in first_keys:
            continue
        times.sort()
        keys = first_keys[shape]
        chain = [("sighted", sighted[shape])]
        for stage in STAGES:
            source = heard if stage == "heard" else None
            stamps = [source.get(k) if source is not None else service.get(k, {}).get(stage)
                      for k in keys]
            if all(s is not None for s in stamps):
                chain.append((stage, max(stamps)))
        total = population[int(shape.split(":")[0])]
        chain.append(("first", times[0]))
        for label, fraction in (("50%", 0.5), ("99%", 0.99)):
            needed = max(1, math.ceil(fraction * total))
            if len(times) >= needed:
                chain.append((label, times[needed - 1]))
        for (a, ta), (b, tb) in zip(chain, chain[1:]):
            steps.setdefault(f"{a}->{b}", []).append(tb - ta)
        chains[shape] = {stage: round(t - sighted[shape], 4) for stage, t in chain}
    queued = [r["queued"] for r in service.values() if "queued" in r]
    compile_s = [r["compiled"] - r["started"] for r in service.values()
                 if "compiled" in r and "started" in r]
    return {"stages": {name: {"median": statistics.median(v), "mean": statistics.fmean(v),
                              "p90": sorted(v)[int(0.9 * (len(v) - 1))], "n": len(v)}
                       for name, v in steps.items()},
            "shape_chains": chains,
            "queue_at_promotion_median": statistics.median(queued) if queued else None,
            "compile_s_median": statistics.median(compile_s) if compile_s else None,
            "compile_s_first_per_shard": [
                min(((r["started"], r["compiled"] - r["started"]) for r in shard.values()
                     if "compiled" in r and "started" in r), default=(0, None))[1]
                for shard in timelines]}
