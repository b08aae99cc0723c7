"""`dynvm top`'s lines for generator replicas (dynvm.cluster.serving._generate_replica): time to
first token, inter-token latency, tokens/s, sequences running and waiting, cache
occupancy and how sequences ended, from the same /v2/models/<name>/stats it polls.
A row whose stats carry no "tokens_per_s" is not a generator's and gets no line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

COLUMNS = ("MODEL", "REPLICA", "TOK/S", "TTFT p50/p99 ms", "ITL p50/p99 ms", "RUN", "WAIT",
           "CACHE%", "CACHE", "ENDED stop/len/cancel/err")


def _ms(p50: float | None, p99: float | None) -> str:
    if p50 is None or p99 is None:
        return "-"
    return f"{1e3 * p50:.1f}/{1e3 * p99:.1f}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def generation_lines(rows: Sequence) -> list[str]:
    """A second table, one line per generator row (rows: dynvm._top_cmd.Row); [] when
    no row is a generator's. Its stats are read through GenerationRates and
    GenerationOccupancy, whose field names are the keys."""
    # Loaded on first use: the CLI does not import the serving layer to start.
    from dynvm.cluster._counters import GenerationOccupancy as occupancy_type
    from dynvm.cluster._counters import GenerationRates as rates_type
    from dynvm.cluster._counters import field_of, read

    sequences_key = field_of(rates_type, "sequences")
    cache_key = field_of(occupancy_type, "cache")
    lines = []
    for row in rows:
        s = row.stats
        if row.error is not None or not isinstance(s, Mapping):
            continue
        rates, occupancy = read(rates_type, s), read(occupancy_type, s)
        if rates.tokens_per_s is None:   # not a generator's row
            continue
        cache = occupancy.cache_tokens or 0
        occupancy_pct = (f"{100 * (occupancy.reserved_tokens or 0) / cache:.0f}"
                         if cache else "-")
        ended = s.get(sequences_key) if isinstance(s.get(sequences_key), Mapping) else {}
        lines.append([row.model, row.replica, f"{rates.tokens_per_s:.1f}",
                      _ms(rates.ttft_p50_s, rates.ttft_p99_s),
                      _ms(rates.itl_p50_s, rates.itl_p99_s), _count(occupancy.running),
                      _count(occupancy.waiting), occupancy_pct, str(s.get(cache_key, "-")),
                      "/".join(str(ended.get(k, 0)) for k in ("stop", "length", "cancelled",
                                                             "error"))])
    if not lines:
        return []
    widths = [max(len(c), *(len(cells[i]) for cells in lines)) for i, c in enumerate(COLUMNS)]

    def render(cells) -> str:
        return "  ".join([cells[0].ljust(widths[0]), cells[1].ljust(widths[1]),
                          *(c.rjust(w) for c, w in zip(cells[2:], widths[2:]))])

    return ["", "generation", render(COLUMNS), *map(render, lines)]
