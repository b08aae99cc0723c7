"""Start-up time to the first answered request: `dynvm serve` vs plain Ray Serve.

    python bench/serve_startup.py [--repeats 2] [--json out.json]

Each run is a fresh process started from nothing (its own local Ray), timed from the
moment it is launched until a v2 JSON infer request (the recommender, batch 2) gets a
200; then it is stopped with SIGINT and the next one starts. Runs alternate (dynvm,
plain, dynvm, plain, ...) so both see the same host load.

- dynvm: `dynvm serve rec.dvm` (local Ray, a private redis-server, the compile service,
  Serve's proxy with dynvm's guard, one replica); its own log lines, with the seconds
  since launch at which each appeared, say where its time went;
- plain: a script that starts Ray and Serve and deploys the same nn.Module in eager
  (bench/serve_compare.py's plain deployment), what a Serve user writes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PLAIN_SCRIPT = """
import os, sys, threading
sys.path.insert(0, {root!r})
import ray
from ray import serve
from bench.serve_compare import _model, _plain_deployment
ray.init(include_dashboard=False, log_to_driver=False)
serve.start(http_options={{"host": "127.0.0.1", "port": {port}}})
serve.run(_plain_deployment().bind(_model("recommender").module), name="plain",
          route_prefix="/v2/models/rec")
print("deployed", flush=True)
threading.Event().wait()
"""


def _free_port() -> int:
    from dynvm.cluster.store._local_redis import free_port

    return free_port()


def _first_200(port: int, body: bytes, started: float, limit_s: float) -> float | None:
    """Seconds from `started` until POST /v2/models/rec/infer answers 200."""
    while time.perf_counter() - started < limit_s:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", "/v2/models/rec/infer", body=body,
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            conn.close()
            if response.status == 200:
                return time.perf_counter() - started
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.1)
    return None


def _run(command: list[str], port: int, body: bytes, limit_s: float) -> dict:
    lines: list[tuple[float, str]] = []
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)

    def read() -> None:
        for line in process.stdout:
            lines.append((round(time.perf_counter() - started, 2), line.rstrip()[:100]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seconds = _first_200(port, body, started, limit_s)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    reader.join(5)
    return {"seconds": None if seconds is None else round(seconds, 2),
            "log": [f"{t:6.2f} s  {text}" for t, text in lines
                    if text and not text.startswith(" ")][:12]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--limit", type=float, default=180.0, help="seconds per run at most")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)

    import dynvm
    from bench.serve_compare import _bodies, _model

    demo = _model("recommender")
    program = dynvm.compile(demo.module.eval(), demo.example_inputs,  # safe: nn.Module.eval
                            demo.dynamic_shapes, name="rec")
    path = os.path.join(tempfile.mkdtemp(prefix="serve-startup-"), "rec.dvm")
    dynvm.save(program, path)
    body = _bodies(demo, "recommender", [s.name for s in program.inputs], False, 2)[1][0]
    runs = []
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for repeat in range(args.repeats):
        for system in ("dynvm", "plain"):
            port = _free_port()
            if system == "dynvm":
                command = [sys.executable, "-m", "dynvm.cli", "serve", path, "--port",
                           str(port)]
            else:
                command = [sys.executable, "-c", PLAIN_SCRIPT.format(root=ROOT, port=port)]
            load = round(os.getloadavg()[0], 1)
            result = _run(command, port, body, args.limit)
            runs.append({"system": system, "repeat": repeat, "load": load, **result})
            print(f"{system:6} run {repeat}: first 200 after {result['seconds']} s "
                  f"(load {load})", flush=True)
            for line in result["log"]:
                print(f"    {line}", flush=True)
    for system in ("dynvm", "plain"):
        got = [r["seconds"] for r in runs if r["system"] == system and r["seconds"]]
        if got:
            print(f"{system}: median {statistics.median(got):.2f} s over {len(got)} runs")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
