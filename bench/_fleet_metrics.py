"""What the fleet simulator measures, from the hosts' results and the servers' own
counters (bench/fleet_sim.py): propagation times, message rates, CPU and memory."""

from __future__ import annotations

import math
import statistics

import psutil

from dynvm.cluster.fleet._announce import CHANNEL_PREFIX


def process_usage(pids: list[int]) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) summed over `pids` (the compile service's actors)."""
    cpu, rss = 0.0, 0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            times = process.cpu_times()
            cpu += times.user + times.system
            rss += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return cpu, rss


def redis_counters(client) -> dict:
    """Commands run so far (all kinds), PUBLISHes, memory and announce subscribers."""
    stats = client.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k.startswith("cmdstat_"))
    publish = stats.get("cmdstat_publish", {}).get("calls", 0)
    memory = client.info("memory")
    # One channel per program (Note [Announcement channels]): subscribers over them all.
    channels = client.pubsub_channels(f"{CHANNEL_PREFIX}*")
    subscribers = sum(count for _, count in client.pubsub_numsub(*channels)) \
        if channels else 0
    by_command = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()
                  if k.startswith("cmdstat_")}
    return {"commands": calls, "publish": publish, "by_command": by_command,
            "used_memory": memory["used_memory"],
            "used_memory_rss": memory["used_memory_rss"], "subscribers": subscribers}


def _reach_time(times: list[float], population: int, fraction: float,
                since: float) -> float | None:
    """Seconds from `since` until `fraction` of `population` had a time in `times`
    (None: not reached before the run ended)."""
    needed = max(1, math.ceil(fraction * population))
    if len(times) < needed:
        return None
    return sorted(times)[needed - 1] - since


def _summary(values: list[float | None]) -> dict:
    reached = [v for v in values if v is not None]
    if not reached:
        return {"median": None, "p90": None, "max": None, "reached": 0, "of": len(values)}
    reached.sort()
    return {"median": statistics.median(reached),
            "p90": reached[min(len(reached) - 1, int(0.9 * len(reached)))],
            "max": reached[-1], "reached": len(reached), "of": len(values)}


def propagation(hosts: list[dict]) -> dict:
    """Per hot shape: first fleet-wide sighting -> served specialized on one replica and
    on 50% / 99% of its program's replicas; per artifact: first announcement heard ->
    installed on 50% / 99%."""
    replicas = [r for host in hosts for r in host["replicas"]]
    population: dict[int, int] = {}
    for replica in replicas:
        population[replica["program"]] = population.get(replica["program"], 0) + 1
    sighted: dict[str, float] = {}
    for host in hosts:
        for key, t in host["first_sighting"].items():
            sighted[key] = min(t, sighted.get(key, t))
    served: dict[str, list[float]] = {}
    for replica in replicas:
        for shape, t in replica["served_at"].items():
            served.setdefault(f"{replica['program']}:{shape}", []).append(t)
    shape_1, shape_50, shape_99 = [], [], []
    for key, times in served.items():
        if key not in sighted:
            continue   # served by a kernel, never asked for: not a sighting
        program = int(key.split(":")[0])
        shape_1.append(min(times) - sighted[key])   # promotion + compile + publish + 1
        shape_50.append(_reach_time(times, population[program], 0.5, sighted[key]))
        shape_99.append(_reach_time(times, population[program], 0.99, sighted[key]))
    announced: dict[str, float] = {}
    for host in hosts:
        for key, t in host["announced_first_seen"].items():
            announced[key] = min(t, announced.get(key, t))
    installed: dict[str, list[float]] = {}
    program_of_key: dict[str, int] = {}
    for replica in replicas:
        for key, t in replica["installed_at"].items():
            installed.setdefault(key, []).append(t)
            program_of_key[key] = replica["program"]
    key_50, key_99 = [], []
    for key, times in installed.items():
        if key in announced:
            total = population[program_of_key[key]]
            key_50.append(_reach_time(times, total, 0.5, announced[key]))
            key_99.append(_reach_time(times, total, 0.99, announced[key]))
    return {"sighting_to_first": _summary(shape_1), "sighting_to_50": _summary(shape_50),
            "sighting_to_99": _summary(shape_99),
            "announce_to_50": _summary(key_50), "announce_to_99": _summary(key_99),
            "shapes_sighted": len(sighted), "shapes_served": len(shape_99),
            "keys_announced": len(announced)}
