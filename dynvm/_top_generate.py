"""`dynvm top`'s lines for generator replicas (dynvm.cluster.serving._generate_replica): time to
first token, inter-token latency, tokens/s, sequences running and waiting, cache
occupancy and how sequences ended, from the same /v2/models/<name>/stats it polls.
A row whose stats carry no "tokens_per_s" is not a generator's and gets no line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

COLUMNS = ("MODEL", "REPLICA", "TOK/S", "TTFT p50/p99 ms", "ITL p50/p99 ms", "RUN", "WAIT",
           "CACHE%", "CACHE", "ENDED stop/len/cancel/err")


def _ms(stats: Mapping, key: str) -> str:
    p50, p99 = stats.get(f"{key}_p50_s"), stats.get(f"{key}_p99_s")
    if not isinstance(p50, int | float) or not isinstance(p99, int | float):
        return "-"
    return f"{1e3 * p50:.1f}/{1e3 * p99:.1f}"


def generation_lines(rows: Sequence) -> list[str]:
    """A second table, one line per generator row (rows: dynvm._top_cmd.Row); [] when
    no row is a generator's."""
    lines = []
    for row in rows:
        s = row.stats
        if row.error is not None or not isinstance(s.get("tokens_per_s"), int | float):
            continue
        cache = s.get("cache_tokens") or 0
        occupancy = f"{100 * s.get('reserved_tokens', 0) / cache:.0f}" if cache else "-"
        ended = s.get("sequences") if isinstance(s.get("sequences"), Mapping) else {}
        lines.append([row.model, row.replica, f"{s['tokens_per_s']:.1f}", _ms(s, "ttft"),
                      _ms(s, "itl"), str(s.get("running", "-")), str(s.get("waiting", "-")),
                      occupancy, str(s.get("cache", "-")),
                      "/".join(str(ended.get(k, 0)) for k in ("stop", "length", "cancelled",
                                                             "error"))])
    if not lines:
        return []
    widths = [max(len(c), *(len(cells[i]) for cells in lines)) for i, c in enumerate(COLUMNS)]

    def render(cells) -> str:
        return "  ".join([cells[0].ljust(widths[0]), cells[1].ljust(widths[1]),
                          *(c.rjust(w) for c, w in zip(cells[2:], widths[2:]))])

    return ["", "generation", render(COLUMNS), *map(render, lines)]
