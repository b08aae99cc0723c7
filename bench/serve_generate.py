"""Generation served under a mixed trace: dynvm's generator replica (continuous
batching, dynvm.cluster.serving._generate_replica, as `dynvm serve GENERATOR_DIR` deploys it)
against the same random-weight model in CTranslate2 behind a plain Ray Serve deployment.

    flock /tmp/dynvm_bench.lock python -m bench.serve_generate --clients 8 --requests 96 --rate 64
    ... --passes 4          # passes per system, in turn (default 3, Note [Passes in turn])
    ... --step-token-budget 16,64   # a dynvm replica per budget, in the same passes
    ... --thread-slice-ms 0,0.5     # a dynvm replica per slice (Note [Short slices for
                                    # the step's threads]), in the same passes
    ... --ingress proxy     # both systems behind Serve's proxy instead

Note [Serving trace]
~~~~~~~~~~~~~~~~~~~~
One trace for both systems, fixed by --seed: arrivals a Poisson process of --rate
requests/s, prompt lengths uniform in [--prompt-min, --prompt-max] tokens, output lengths
uniform in [--new-min, --new-max] tokens, greedy, every output made to its full length
(dynvm: ignore_eos; CTranslate2: min_length = max_length). C client threads take the
trace in order: a request is sent at its arrival time or as soon as a client is free
after it, and streamed (server-sent events); TTFT is send -> first token event, ITL the
gaps between a request's token events (as the client sees them: the ingress's
hop included), tokens/s all tokens / the run's wall time, lost the requests that ended
without every token. Both systems sit in one Ray cluster, behind the same ingress
(--ingress: `direct`, the default, is what `dynvm serve` runs, Note [Direct ingress] in
dynvm.cluster.protocol.ingress, and each system's replica then answers on its own port;
`proxy`, Serve's proxy in front of both), one replica each with num_cpus 1 (Ray gives
each 1 OpenMP thread; CTranslate2 gets intra_threads=1); they run one after the other,
each after a warm-up pass of the same trace's first requests (dynvm's replica has also
warmed its JIT before it was ready, Note [Warm before ready]). The CTranslate2
deployment is what a plain Ray Serve app does:
each request runs `generate_tokens` on a thread of a pool, the model shared (its own
queue; no batching across requests). The model: a Llama-style decoder, --width,
--layers, --vocab (random weights, nothing downloaded). The 1-minute load average is
printed with every row: the host is shared.

Note [Connections kept by the clients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
LLM clients keep their connections: the openai package (httpx) pools them, and so does
any HTTP client that sends one request after another. A client thread here does the
same by default (--keep-alive 1, for both systems alike): it reads each response to its
end and sends its next request on the same connection, so a request's end is the end of
a chunked body, not a TCP close and a new accept on the replica's event loop. With
--keep-alive 0 every request opens a connection of its own (the bench's way before).

Note [Passes in turn]
~~~~~~~~~~~~~~~~~~~~~
On a shared 2-core host one pass of a system after the other compares two moments of
the host's load as much as the two systems (dynvm / CTranslate2 read 0.95x and 1.26x ten
minutes apart). With --passes N, after each system's warm-up, the trace is played N
times per system, the systems in turn and the order reversed every pass (A B, B A, ...);
each pass's ratio compares neighbours in time, and the table after the rows gives each
pass's ratio and the median over them (3 passes by default: a bar met "reliably" is met
in every pass). Each dynvm row also counts the JIT compiles of its pass (a compile
beside the trace costs the step the host's second core and the GIL).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path

CT2_PREFIX = "/ct2"


def build_model(width: int, layers: int, vocab: int):
    """A random-weight Llama-style causal LM (4 query heads per key/value head)."""
    from tests.zoo._schemas import declare_torchvision_schemas

    declare_torchvision_schemas()
    import torch
    import transformers as hf

    torch.manual_seed(0)
    heads = max(4, width // 64)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(
        hidden_size=width, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        num_hidden_layers=layers, intermediate_size=width * 8 // 3, vocab_size=vocab,
        max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.config._attn_implementation = "sdpa"
    return model.eval()


def make_trace(args) -> list[dict]:
    """The trace (Note [Serving trace]): arrival offset, prompt ids, new tokens."""
    rng = random.Random(args.seed)
    at, trace = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        prompt = [rng.randrange(3, args.vocab) for _ in range(
            rng.randint(args.prompt_min, args.prompt_max))]
        trace.append({"at": at, "prompt": prompt,
                      "new": rng.randint(args.new_min, args.new_max)})
    return trace


def _ct2_deployment():
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve
    from starlette.responses import StreamingResponse

    @serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 1})
    class Ct2Completions:
        """CTranslate2 behind a plain Serve deployment: SSE per token, one request per
        generate_tokens call on a pool thread."""

        def __init__(self, folder: str) -> None:
            import ctranslate2

            self.model = ctranslate2.Generator(folder, device="cpu", intra_threads=1)
            self.pool = ThreadPoolExecutor(16)

        async def __call__(self, request):
            doc = json.loads(await request.body())
            prompt = [f"t{t}" for t in doc["prompt"]]
            new = int(doc["max_tokens"])
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()

            def run():
                try:
                    for step in self.model.generate_tokens(prompt, max_length=new,
                                                           min_length=new, sampling_topk=1):
                        loop.call_soon_threadsafe(queue.put_nowait, step.token_id)
                finally:
                    loop.call_soon_threadsafe(queue.put_nowait, None)

            self.pool.submit(run)

            async def events():
                while (token := await queue.get()) is not None:
                    yield f'data: {{"choices": [{{"token_ids": [{token}]}}]}}\n\n'
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    return Ct2Completions


def _stream(port: int, path: str, body: dict, conn: http.client.HTTPConnection | None = None
            ) -> tuple[float, list[float], int, bool]:
    """(TTFT, token arrival times, tokens, ended with [DONE]) of one streamed request, on
    `conn` if given (kept open after it: the response is read to its end), else on a
    connection of its own, closed after it."""
    own = conn is None
    if own:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    times, tokens, done = [], 0, False
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            break
        got = len(json.loads(data)["choices"][0].get("token_ids", []))
        if got:
            tokens += got
            times.append(time.perf_counter())
    if own:
        conn.close()
    else:
        response.read()   # the rest of the body (its chunked end): the connection is reused
    ttft = times[0] - start if times else float("nan")
    return ttft, times, tokens, done and response.status == 200


def _steps(port: int, prefix: str) -> tuple[int, int, int, float, dict]:
    """(decode steps, specialized steps, the step's JIT compiles, their seconds, the
    slices its threads got) a dynvm replica has counted."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", prefix + "/v2/models/gen/stats")
        stats = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    counters = stats["scheduler"]
    jit = stats.get("jit", {})
    return (counters["decode_steps"], counters["specialized_steps"], jit.get("compiles", 0),
            jit.get("compile_seconds", 0.0), stats.get("thread_slice_s", {}))


def _play(trace: list[dict], clients: int, one) -> tuple[list, float]:
    """Play `trace` from `clients` threads, each request at its arrival time through
    `one(item)` -> (ttft, token times, tokens, done); (results, wall seconds)."""
    lock, results = threading.Lock(), []
    order = iter(range(len(trace)))
    start = time.perf_counter()

    def client():
        while True:
            with lock:
                index = next(order, None)
            if index is None:
                return
            item = trace[index]
            delay = start + item["at"] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            outcome = one(item)
            with lock:
                results.append((item, outcome))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


def _summary(results: list, wall: float, clients: int, requests: int) -> dict:
    """TTFT/ITL percentiles, tokens/s and lost requests of a played trace."""
    ttfts = sorted(o[0] for _, o in results if o[1])
    itls = sorted(b - a for _, o in results for a, b in zip(o[1], o[1][1:]))
    tokens = sum(o[2] for _, o in results)
    lost = sum(1 for item, o in results if not o[3] or o[2] != item["new"])

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else None

    return {"clients": clients, "requests": requests, "wall_s": wall,
            "tokens_per_s": tokens / wall, "tokens": tokens, "lost": lost,
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
            "itl_p50_ms": pct(itls, 0.5), "itl_p99_ms": pct(itls, 0.99),
            "load_1min": os.getloadavg()[0]}


def run_trace(port: int, path: str, trace: list[dict], clients: int, model: str,
              keep_alive: bool = True) -> dict:
    """Play the trace with `clients` client threads; TTFT/ITL percentiles, tokens/s. With
    `keep_alive` each client thread sends its requests over one connection it keeps (as
    the openai client does: Note [Connections kept by the clients]), else one connection
    a request."""
    held, opened = threading.local(), []

    def one(item):
        body = {"model": model, "prompt": item["prompt"], "max_tokens": item["new"],
                "temperature": 0, "ignore_eos": True, "stream": True}
        for attempt in range(2):
            conn = None
            if keep_alive:
                conn = getattr(held, "conn", None)
                reused = conn is not None
                if conn is None:
                    conn = held.conn = http.client.HTTPConnection("127.0.0.1", port,
                                                                  timeout=300)
                    opened.append(conn)
            try:
                return _stream(port, path, body, conn)
            except (OSError, http.client.HTTPException) as exc:
                if conn is not None:   # a fresh connection for this thread's next request
                    conn.close()
                    held.conn = None
                # A kept connection the server closed while idle: once more, on a new one.
                if not (attempt == 0 and conn is not None and reused and isinstance(
                        exc, http.client.RemoteDisconnected | ConnectionError)):
                    break
        return (float("nan"), [], 0, False)

    cpu = time.process_time()
    try:
        results, wall = _play(trace, clients, one)
    finally:
        for conn in opened:
            conn.close()
    # the client's own CPU seconds: it shares the host's cores with the servers
    return {**_summary(results, wall, clients, len(trace)), "keep_alive": keep_alive,
            "client_cpu_s": time.process_time() - cpu}


def run_in_process(generator, config, trace: list[dict], clients: int) -> dict:
    """The trace played straight into a GenerateScheduler over `generator` (no HTTP, no
    Ray; one process, the scheduler's thread beside the clients'): the same row as
    run_trace, token times taken in the scheduler's sink."""
    from dynvm.cluster.serving._generate_scheduler import GenerateScheduler, GenerationRequest

    scheduler = GenerateScheduler(generator, config)

    def one(item):
        times, ended, outcome = [], threading.Event(), {"done": False}

        def sink(event):
            if event[0] == "token":
                times.append(time.perf_counter())
            else:
                outcome["done"] = event[0] == "end"
                ended.set()

        sent = time.perf_counter()
        scheduler.submit(GenerationRequest(tuple(item["prompt"]), item["new"],
                                           stop_token_ids=()), sink)
        ended.wait(300)
        return (times[0] - sent if times else float("nan"), times, len(times),
                outcome["done"])

    try:
        results, wall = _play(trace, clients, one)
        scheduler.wait_idle(30)
        freed = not scheduler.held and scheduler._slots is not None and \
            scheduler._slots.used_tokens() == 0 and len(scheduler._slots) == 0
    finally:
        scheduler.close()
    return {**_summary(results, wall, clients, len(trace)), "all_freed": freed,
            "steps": dict(scheduler.counters)}


def in_process(args, programs) -> list[dict]:
    """--in-process: the dynvm scheduler alone, one JIT thread (Note [Serving trace]'s
    trace; the replica's warm-up, Note [Warm before ready], then a warm-up pass first),
    rows as main prints them."""
    import torch

    import dynvm
    from dynvm.cluster.serving._generate_scheduler import GenerateScheduler
    from dynvm.cluster.serving._generate_warm import warm_scheduler

    torch.set_num_threads(1)
    budgets = _budgets(args)
    trace, rows = make_trace(args), []
    with dynvm.Generator(programs, compile_ahead=False) as generator:
        for budget in budgets:
            scheduler = GenerateScheduler(generator, _scheduler_config(budget))
            try:
                print(f"warm: {warm_scheduler(scheduler, scheduler.config.warm_seconds)}",
                      flush=True)
            finally:
                scheduler.close()
        for clients in [int(c) for c in args.clients.split(",")]:
            for index in range(args.passes):   # Note [Passes in turn]
                for budget in (budgets if index % 2 == 0 else budgets[::-1]):
                    if index == 0:
                        run_in_process(generator, _scheduler_config(budget),
                                       trace[:min(8, len(trace))], clients)
                    row = {"system": "dynvm-in-process" + ("-packed" if args.packed else "")
                           + (f"-b{budget}" if len(budgets) > 1 else ""), "pass": index + 1,
                           "step_token_budget": budget,
                           **run_in_process(generator, _scheduler_config(budget), trace,
                                            clients)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def _budgets(args) -> list[int]:
    """--step-token-budget's values (0: SchedulerConfig's default)."""
    return [int(b) for b in str(args.step_token_budget).split(",")]


def _scheduler_config(budget: int, slice_ms: float | None = None):
    from dynvm.cluster.serving._generate_scheduler import SchedulerConfig

    return SchedulerConfig(**({"step_token_budget": budget} if budget else {}),
                           **({} if slice_ms is None else {"thread_slice_s": slice_ms / 1e3}))


def _replicas(args) -> list[tuple[str, int, float | None]]:
    """The dynvm replicas to serve, (system name, budget, slice in ms or None: the
    default): one per --step-token-budget and --thread-slice-ms value, all played in
    the same passes; named `dynvm` when there is one, else by what differs."""
    budgets = _budgets(args)
    slices = [None] if not args.thread_slice_ms else [
        float(v) for v in str(args.thread_slice_ms).split(",")]
    replicas = []
    for budget in budgets:
        for slice_ms in slices:
            name = "dynvm" + (f"-b{budget}" if len(budgets) > 1 else "") + (
                f"-s{slice_ms:g}" if len(slices) > 1 else "")
            replicas.append((name, budget, slice_ms))
    return replicas


def main(argv=None) -> int:
    """Build the model, deploy both systems in one Ray cluster, play the trace."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,8")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=64)
    p.add_argument("--new-min", type=int, default=16)
    p.add_argument("--new-max", type=int, default=96)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-token-budget", default="16",
                   help="dynvm scheduler's tokens per step (0: SchedulerConfig's default, "
                        "16); "
                        "a comma list (16,64): one dynvm replica per budget, systems "
                        "dynvm-b16, dynvm-b64, ..., played in the same passes")
    p.add_argument("--thread-slice-ms", default="",
                   help="the dynvm scheduler's and loop's time slice (SchedulerConfig."
                        "thread_slice_s; empty: its default); a comma list (0,0.5): one "
                        "dynvm replica per value, systems dynvm-s0, dynvm-s0.5, played in "
                        "the same passes")
    p.add_argument("--systems", default="dynvm,ctranslate2")
    p.add_argument("--out", default="")
    p.add_argument("--packed", type=int, default=1,
                   help="1: the packed step, one call per scheduler step (Note [One packed "
                        "call per step]); 0: rows of one T per call")
    p.add_argument("--passes", type=int, default=3,
                   help="passes of the trace per system and client count, the systems in "
                        "turn, the order reversed every pass (Note [Passes in turn])")
    p.add_argument("--keep-alive", type=int, default=1,
                   help="1: each client thread keeps its connection across requests (Note "
                        "[Connections kept by the clients]); 0: one connection a request")
    p.add_argument("--in-process", action="store_true",
                   help="the dynvm scheduler alone in this process, no HTTP or Ray")
    p.add_argument("--ingress", choices=("direct", "proxy"), default="direct",
                   help="direct: each system's replica on its own port (what `dynvm serve` "
                        "runs); proxy: both behind Serve's proxy")
    args = p.parse_args(argv)
    import ray
    from ray import serve

    import dynvm
    from dynvm._serve_generate_bundle import save_generator
    from dynvm.cluster.serving._generate_replica import generator_application
    from dynvm.cluster.serving.serving_config import ServingConfig

    systems = args.systems.split(",")
    folder = Path(tempfile.mkdtemp(prefix="dynvm-serve-generate-"))
    model = build_model(args.width, args.layers, args.vocab)
    started = time.perf_counter()
    programs = dynvm.compile_generator(model, max_batch=args.max_batch,
                                       max_length=args.prompt_max + args.new_max + 8,
                                       jit=False, kv_state=True,
                                       packed=bool(args.packed)).programs
    print(f"exported in {time.perf_counter() - started:.0f} s", flush=True)
    if args.in_process:
        rows = in_process(args, programs)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        print(report(rows))
        return 0
    save_generator(programs, folder / "gen")
    from bench.generate import convert_to_ct2

    ct2 = convert_to_ct2(model, folder) if "ctranslate2" in systems else None
    port = 8000 + random.Random().randrange(1000)
    from dynvm.cluster.protocol.ingress import direct_addresses, ingress_environment

    os.environ.update(ingress_environment(args.ingress))   # read when Ray starts
    replicas = _replicas(args) if "dynvm" in systems else []
    # Ray's CPUs are logical: one per replica, as each system's deployment asks.
    ray.init(num_cpus=max(2, len(replicas) + 1), include_dashboard=False,
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        targets, apps, prefixes = {}, {}, {}
        for index, (system, budget, slice_ms) in enumerate(replicas):
            # several replicas: one per budget and slice, compared in the same passes
            tag = system.removeprefix("dynvm-")
            apps[system] = "dynvm-gen" if index == 0 else f"dynvm-gen-{tag}"
            prefixes[system] = "" if index == 0 else f"/{tag}"
            serve.run(generator_application("gen", str(folder / "gen"), ServingConfig(
                device="cpu", num_cpus=1), _scheduler_config(budget, slice_ms)),
                name=apps[system], route_prefix=prefixes[system] or "/")
            targets[system] = prefixes[system] + "/v1/completions"
        if ct2 is not None:
            serve.run(_ct2_deployment().bind(str(ct2)), name="ct2", route_prefix=CT2_PREFIX)
            targets["ctranslate2"] = CT2_PREFIX
            apps["ctranslate2"] = "ct2"
        ports = dict.fromkeys(targets, port)
        if args.ingress == "direct":   # each application's replica port
            found = direct_addresses([apps[system] for system in targets])
            ports = {system: found[apps[system]][0][1] for system in targets}
        trace = make_trace(args)
        rows = []
        keep = bool(args.keep_alive)
        for clients in [int(c) for c in args.clients.split(",")]:
            for system, path in targets.items():
                run_trace(ports[system], path, trace[:min(8, len(trace))], clients,
                          "gen", keep)  # warm-up
            order = list(targets)
            for index in range(args.passes):   # Note [Passes in turn]
                for system in (order if index % 2 == 0 else order[::-1]):
                    ours = system.startswith("dynvm")
                    before = _steps(ports[system], prefixes[system]) if ours else None
                    row = {"system": system, "ingress": args.ingress, "pass": index + 1,
                           **run_trace(ports[system], targets[system], trace, clients,
                                       "gen", keep)}
                    if before is not None:   # decode steps of the pass, specialized
                        after = _steps(ports[system], prefixes[system])
                        row.update(steps=after[0] - before[0],
                                   specialized_steps=after[1] - before[1],
                                   jit_compiles=after[2] - before[2],
                                   jit_compile_s=round(after[3] - before[3], 3),
                                   thread_slice_s=after[4])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        print(report(rows))
        print(pass_ratios(rows))
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def pass_ratios(rows: list[dict]) -> str:
    """Per client count and pass: dynvm's tokens/s over CTranslate2's in the same pass,
    and dynvm's ITL p99 / p50; then the medians over the passes."""
    lines = ["| clients, system | pass | tokens/s / CT2's | ITL p99 / p50 | load |",
             "|---:|---:|---:|---:|---:|"]
    by_pass: dict = {}
    for r in rows:
        by_pass.setdefault((r["clients"], r.get("pass", 1)), {})[r["system"]] = r
    summary: dict = {}
    for (clients, index), systems in sorted(by_pass.items()):
        theirs = systems.get("ctranslate2")
        for name, ours in systems.items():
            if not name.startswith("dynvm") or not ours["itl_p50_ms"]:
                continue
            itl = ours["itl_p99_ms"] / ours["itl_p50_ms"]
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs else None
            summary.setdefault((clients, name), []).append((ratio, itl))
            lines.append(f"| {clients} {name} | {index} | "
                         f"{'-' if ratio is None else f'{ratio:.3f}'} | {itl:.2f} | "
                         f"{ours['load_1min']:.1f} |")
    for (clients, name), pairs in summary.items():
        ratios = sorted(r for r, _ in pairs if r is not None)
        itls = sorted(i for _, i in pairs)
        median = (lambda v: v[len(v) // 2] if v else None)
        text = "-" if not ratios else f"{median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        lines.append(f"| {clients} {name} | median | {text} | {median(itls):.2f} "
                     f"({itls[0]:.2f}-{itls[-1]:.2f}) | |")
    return "\n".join(lines)


def report(rows: list[dict]) -> str:
    """A markdown table of the rows."""
    lines = ["| system | clients | tokens/s | TTFT p50/p99 ms | ITL p50/p99 ms | lost | load |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def f(v):
            return "-" if v is None else f"{v:.1f}"
        system = r["system"] + (f" ({r['ingress']})" if r.get("ingress") else "")
        lines.append(f"| {system} | {r['clients']} | {r['tokens_per_s']:.1f} | "
                     f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'])} / "
                     f"{f(r['itl_p99_ms'])} | {r['lost']} | {r['load_1min']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

