"""`dynvm top`: a live table of a running dynvm cluster, read over its HTTP API.

Each refresh GETs /v2/models/<name>/stats for every model: the JSON of
`RuntimeStats.to_dict()` (dynvm._runtime_stats) plus the replica's request and batching
counters (dynvm.cluster._counters). It is read back through those types
(`dynvm._runtime_stats.read`), by attribute: a renamed field changes what is read here
too, or fails when the name is checked (`field_of`: at import for RuntimeStats, at the
first table for RequestCounters, whose module loads dynvm.cluster and Redis's client,
which only `dynvm top` itself should pay, not every `dynvm` command). Reading is
tolerant (a model total, or an older server, may lack some keys: they show as '-').
Those stats are one replica's: Serve routes each GET to one replica of the model. So
each model is polled `--samples` times per refresh; when the stats carry a "replica" id,
every replica seen gets its own row (the latest stats it answered with) and the model a
total row; without one, the row is a sample: one replica's counters, and the table says
so.

Models come from --model, or else from the repository index (POST /v2/repository/index,
the Open Inference Protocol's repository extension), when the server has it.

Latency percentiles are shown when the stats carry "latency_ms": {"p50": ..,
"p99": ..}; otherwise '-'.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dynvm._run_cmd import CliError
from dynvm._runtime_stats import RegionStats, RuntimeStats, field_of, read
from dynvm._top_generate import generation_lines

_CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class Row:
    """One line of the table: a replica's stats, a model's total, or an error."""

    model: str
    """The model's name."""
    replica: str
    """A replica id, "all" for a model's total, or "sample" when replicas are unnamed."""
    stats: Mapping = field(default_factory=dict)
    """The stats dict the row shows (for a total: summed counters)."""
    error: str | None = None
    """Why there are no stats (the server's message)."""


class _Client:
    def __init__(self, url: str, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def request(self, method: str, path: str) -> tuple[int, object]:
        req = urllib.request.Request(self.url + path, method=method,
                                     data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, _json(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach {self.url}: {reason}") from None


def _json(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _error_text(status: int, doc: object) -> str:
    if isinstance(doc, Mapping):
        message = doc.get("error") or doc.get("detail")
        if message:
            return f"HTTP {status}: {message}"
    return f"HTTP {status}"


def discover_models(client: _Client) -> list[str]:
    """The served model names from the repository index, or a CliError saying to pass
    --model when the server has no index."""
    status, doc = client.request("POST", "/v2/repository/index")
    if status == 200 and isinstance(doc, list):
        names = [m.get("name") for m in doc if isinstance(m, Mapping)]
        names = [n for n in names if isinstance(n, str)]
        if names:
            return names
        raise CliError(f"{client.url} serves no models (POST /v2/repository/index)")
    raise CliError(f"{client.url} does not list its models (POST /v2/repository/index: "
                   f"{_error_text(status, doc)}); name them with --model NAME", 2)


def check_server(client: _Client) -> None:
    """Raise CliError unless the URL answers GET /v2 as a dynvm server."""
    status, doc = client.request("GET", "/v2")
    if status == 200 and isinstance(doc, Mapping) and doc.get("name") == "dynvm":
        return
    why = _error_text(status, doc) if status != 200 else \
        "HTTP 200 but not dynvm's server metadata"
    raise CliError(f"{client.url} is not a dynvm server (GET /v2: {why})")


def poll(client: _Client, models: Sequence[str], samples: int) -> list[Row]:
    """Rows for one refresh: per model, every replica seen in `samples` GETs (plus a
    total when there are several), or one sampled row, or the error."""
    rows: list[Row] = []
    for model in models:
        path = f"/v2/models/{urllib.parse.quote(model, safe='')}/stats"
        seen: dict[str, Mapping] = {}
        unnamed: Mapping | None = None
        error = None
        for _ in range(samples):
            status, doc = client.request("GET", path)
            if status != 200 or not isinstance(doc, Mapping):
                error = _error_text(status, doc)
                continue
            replica = doc.get("replica")
            if isinstance(replica, str) and replica:
                seen[replica] = doc
            else:
                unnamed = doc
                break  # replicas cannot be told apart: more samples would not help
        if seen:
            rows.extend(Row(model, replica, stats) for replica, stats in sorted(seen.items()))
            if len(seen) > 1:
                rows.append(Row(model, "all", total(seen.values())))
        elif unnamed is not None:
            rows.append(Row(model, "sample", unnamed))
        else:
            rows.append(Row(model, "-", error=error or "no answer"))
    return rows


# What a model's total sums over its replicas: fields of the types that write /stats
# (the last two RequestCounters's, checked by _request_counters).
_SUMMED = (*(field_of(RuntimeStats, name) for name in (
               "calls", "specialized_region_calls", "interpreted_region_calls", "compiles",
               "guard_failures", "deopts", "specialize_failures_total", "queue_length")),
           "requests", "errors")
_FAMILY_KERNELS = field_of(RegionStats, "family_kernels")


def _request_counters(stats: Mapping):
    """The replica's RequestCounters in `stats` (module docstring: imported here)."""
    from dynvm.cluster._counters import RequestCounters

    for name in _SUMMED[-2:]:
        field_of(RequestCounters, name)
    return read(RequestCounters, stats)


def total(replicas) -> dict:
    """A model's total over its replicas: counters summed, families the largest (each
    replica installs the kernels it uses), percentiles not combinable (left out)."""
    replicas = list(replicas)
    _request_counters({})  # the summed request counters' names are RequestCounters's
    summed = {key: sum(s.get(key) or 0 for s in replicas) for key in _SUMMED
              if any(isinstance(s.get(key), int | float) for s in replicas)}
    summed["families"] = max((families(s) or 0) for s in replicas)
    return summed


def families(stats: Mapping) -> int | None:
    """The number of code families in a model's stats (summed over its regions when
    the total is absent); None when the stats do not say."""
    if "families" in stats:
        return stats["families"]
    regions = stats.get("regions")
    if not isinstance(regions, Mapping):
        return None
    return sum(r.get(_FAMILY_KERNELS, 0) for r in regions.values() if isinstance(r, Mapping))


def specialized_ratio(stats: Mapping) -> float | None:
    """The share of region calls that ran specialized code, or None before any
    (or when the stats lack the counters)."""
    return read(RuntimeStats, stats).specialized_ratio


def _latency(stats: Mapping, key: str) -> str:
    latency = stats.get("latency_ms")
    value = latency.get(key) if isinstance(latency, Mapping) else None
    return f"{value:.2f}" if isinstance(value, int | float) else "-"


def _count(value) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "-"


COLUMNS = ("MODEL", "REPLICA", "CALLS", "REQS", "SPEC%", "P50 ms", "P99 ms", "COMPILES",
           "FAMILIES", "GUARD FAIL", "DEOPTS", "SPEC FAIL", "QUEUE")


def format_table(rows: Sequence[Row]) -> str:
    """The table, one line per row; errors span the stats columns."""
    lines: list[list[str]] = []
    for row in rows:
        if row.error is not None:
            lines.append([row.model, row.replica, row.error])
            continue
        s = row.stats
        runtime, requests = read(RuntimeStats, s), _request_counters(s)
        ratio = runtime.specialized_ratio
        lines.append([row.model, row.replica, _count(runtime.calls),
                      _count(requests.requests),
                      "-" if ratio is None else f"{100 * ratio:.1f}",
                      _latency(s, "p50"), _latency(s, "p99"), _count(runtime.compiles),
                      _count(families(s)), _count(runtime.guard_failures),
                      _count(runtime.deopts),
                      # Note [Failure accounting]: anything but 0 is a dynvm bug
                      _count(runtime.specialize_failures_total),
                      _count(runtime.queue_length)])
    full = [cells for cells in lines if len(cells) == len(COLUMNS)]
    widths = [max([len(c), *(len(cells[i]) for cells in full)]) for i, c in enumerate(COLUMNS)]
    for i in (0, 1):  # error rows share the first two columns
        widths[i] = max([widths[i], *(len(cells[i]) for cells in lines)])

    def render(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        if len(cells) != len(COLUMNS):
            return "  ".join(parts + [cells[2]]).rstrip()
        parts += [cell.rjust(width) for cell, width in zip(cells[2:], widths[2:])]
        return "  ".join(parts)

    return "\n".join([render(COLUMNS), *map(render, lines)])


def _notes(rows: Sequence[Row]) -> list[str]:
    notes = []
    if any(r.replica == "sample" for r in rows):
        notes.append("sample: the stats carry no replica id, so a row is whichever replica\n"
                     "        Serve routed the poll to (with several replicas, rows jump).")
    if not any(isinstance(r.stats.get("latency_ms"), Mapping) for r in rows):
        notes.append("P50/P99: the replicas do not report latency percentiles.")
    return notes


def top_command(args, out=None) -> int:
    """`dynvm top`: poll the server's models and print their table, once or every
    interval until Ctrl-C; the exit status."""
    out = sys.stdout if out is None else out
    client = _Client(args.url or default_url(), args.timeout)
    check_server(client)
    models = list(dict.fromkeys(args.model)) if args.model else discover_models(client)
    live = not args.once and out.isatty()
    try:
        while True:
            rows = poll(client, models, args.samples)
            header = f"dynvm top  {client.url}  {time.strftime('%H:%M:%S')}"
            if not args.once:
                header += f"  every {args.interval:g} s (Ctrl-C to quit)"
            text = "\n".join([header, "", format_table(rows), *generation_lines(rows), "",
                              *_notes(rows)]).rstrip()
            # A terminal redraws in place; a pipe gets one table after another, as top -b.
            out.write((_CLEAR if live else "") + text + "\n")
            if args.once:
                out.flush()
                return 0
            if not live:
                out.write("\n")
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def default_url() -> str:
    """Where `dynvm serve` listens by default (dynvm.cluster.serving.serving_config.HTTP_PORT:
    the port is stated there once; imported here, not at the CLI's start)."""
    from dynvm.cluster.serving.serving_config import HTTP_PORT

    return f"http://127.0.0.1:{HTTP_PORT}"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(sub) -> None:
    """The `top` subcommand, for dynvm.cli's parser."""
    p = sub.add_parser("top", help="live table of a running dynvm cluster",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="""\
Poll a dynvm server (Ray Serve, Open Inference Protocol v2) and show per model and
replica: calls, requests, specialized-call ratio, p50/p99 when the replicas report them,
compiles, code families, guard failures, deopts, specialization failures (SPEC FAIL:
a dynvm bug whenever not 0; the replica's /stats names the reasons) and the compile
queue.

Stats are per replica and Serve sends each poll to one replica: each model is polled
--samples times a refresh; replicas that name themselves get a row each, otherwise a
row is a sample of one replica.

  dynvm top http://127.0.0.1:8000 --model recommender --model gnn
  dynvm top --once > snapshot.txt""")
    p.add_argument("url", metavar="URL", nargs="?",
                   help="the server's HTTP address (default: where `dynvm serve` listens "
                   "by default, http://127.0.0.1 at ServingConfig's HTTP_PORT)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="a model to show (repeatable; default: the server's repository "
                   "index, when it has one)")
    p.add_argument("--interval", type=_seconds, default=2.0, metavar="S",
                   help="seconds between refreshes (default 2)")
    p.add_argument("--samples", type=_positive, default=3, metavar="N",
                   help="stats requests per model and refresh (default 3)")
    p.add_argument("--timeout", type=_seconds, default=5.0, metavar="S",
                   help="HTTP timeout in seconds (default 5)")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.set_defaults(handler=top_command)
