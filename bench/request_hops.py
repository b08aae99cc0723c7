"""How many of dynvm's functions and files one inference request crosses, from the
replica's entry to the interpreter: `python -m bench.request_hops`.

One model replica (the recommender, `ReplicaServer` without Serve, in this process) gets
warm-up requests, then one HTTP request (JSON, to `ReplicaServer.__call__`, which Serve's
direct-ingress HTTP server calls) and one gRPC request (`ReplicaServer.ModelInfer`, which
Serve's gRPC proxy calls) under `sys.setprofile` on every thread. Counted, between the
entry and the first call of `Interpreter.run`: calls of functions in dynvm's own files
(a coroutine resumed after an await is not a new call), the distinct functions and files
among them, and the file visits (a call in another file than the call before). What
runs before the entry (the HTTP server, Serve's proxy) and inside the interpreter is
not dynvm's request path and is not counted. Not timed: the counts follow from the code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("cluster", "dynvm", "vm", "jit", "arena", "shape_cluster")


class _Recorder:
    """sys.setprofile's hook: dynvm's calls from `entry` until `Interpreter.run`."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.on = False
        self.done = False
        self.calls: list[tuple[str, str, str]] = []   # (thread, file, function)
        self.stack: list[str] = []   # dynvm's frames under Interpreter.run, outermost first
        self._live: set[int] = set()
        self._frames: list = []   # kept alive, so that an id is not reused

    def __call__(self, frame, event, arg):
        if event != "call" or self.done:
            return
        code = frame.f_code
        path = Path(code.co_filename)
        if not self.on:
            if code.co_name == self.entry and path.name == "_replica.py":
                self.on = True
            else:
                return
        if code.co_name == "run" and path.name == "interpreter.py":
            self.done = True
            self.stack = _awaiting(self.entry) + _dynvm_stack(frame.f_back)
            return
        if id(frame) in self._live:   # a coroutine resumed, not a call
            return
        self._live.add(id(frame))
        self._frames.append(frame)
        try:
            relative = path.resolve().relative_to(ROOT)
        except ValueError:
            return
        if relative.parts[0] in _PACKAGES:
            self.calls.append((threading.current_thread().name, str(relative),
                               code.co_qualname))


def _where(code) -> str | None:
    """`file:function` of a code object in dynvm's own files, else None."""
    try:
        relative = Path(code.co_filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return f"{relative}:{code.co_qualname}" if relative.parts[0] in _PACKAGES else None


def _dynvm_stack(frame) -> list[str]:
    """dynvm's frames from `frame` outwards (through awaiting coroutines), outermost
    first."""
    found = []
    while frame is not None:
        where = _where(frame.f_code)
        if where is not None:
            found.append(where)
        frame = frame.f_back
    return found[::-1]


def _awaiting(entry: str) -> list[str]:
    """The dynvm coroutines of the request's task (the one whose outermost dynvm frame
    is `entry`), outermost first, when it is not the task running now: the request
    awaits a batch another task runs."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:   # not on the loop's thread
        return []
    for task in tasks:
        if task is asyncio.current_task():
            continue
        chain, coro = [], task.get_coro()
        while coro is not None and hasattr(coro, "cr_frame"):
            if coro.cr_frame is not None:
                where = _where(coro.cr_frame.f_code)
                if where is not None:
                    chain.append(where)
            coro = coro.cr_await
        if chain and chain[0].endswith(entry):
            return chain
    return []


def _profiled(entry: str, run) -> _Recorder:
    recorder = _Recorder(entry)
    threading.setprofile(recorder)
    sys.setprofile(recorder)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return recorder


def _report(name: str, recorder: _Recorder) -> dict:
    calls = recorder.calls
    files = [f for _, f, _ in calls]
    visits = sum(1 for i, f in enumerate(files) if i == 0 or f != files[i - 1])
    per_file = Counter()
    for i, f in enumerate(files):
        if i == 0 or f != files[i - 1]:
            per_file[f] += 1
    functions = {(f, q) for _, f, q in calls}
    print(f"{name}: {len(calls)} calls of dynvm functions, {len(functions)} distinct, in "
          f"{len(set(files))} files; {visits} file visits; threads "
          f"{sorted({t for t, _, _ in calls})}; reached Interpreter.run: {recorder.done}")
    for f, n in per_file.most_common():
        print(f"  {n:3d} visit(s)  {f}")
    stack_files = [w.split(":")[0] for w in recorder.stack]
    stack_visits = sum(1 for i, f in enumerate(stack_files)
                       if i == 0 or f != stack_files[i - 1])
    print(f"  the way to Interpreter.run (the request's awaiting coroutines, then the "
          f"frames under the call): {len(recorder.stack)} dynvm frames in "
          f"{len(set(stack_files))} files, {stack_visits} file visits:")
    for where in recorder.stack:
        print(f"    {where}")
    return {"calls": len(calls), "functions": len(functions), "files": len(set(files)),
            "file_visits": visits, "visits_per_file": dict(per_file),
            "stack": recorder.stack,
            "path": [f"{f}:{q}" for _, f, q in calls]}


def main(argv=None) -> int:
    """Build the replica, warm it up, count one HTTP and one gRPC request's path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write the counts and paths")
    args = parser.parse_args(argv)
    from starlette.requests import Request

    import dynvm
    from dynvm.cluster import ServingConfig
    from dynvm.cluster.protocol.grpc_v2 import protos
    from dynvm.cluster.serving._replica import ReplicaServer
    from dynvm.models import recommender

    demo = recommender()
    example = tuple(t[:2] for t in demo.example_inputs)   # batch 2
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rec.dvm"
        dynvm.save(dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes,
                                 name="rec"), path)
        replica = ReplicaServer("rec", str(path), ServingConfig(device="cpu"))
        inputs = [{"name": spec.name, "datatype": "FP32" if t.is_floating_point() else "INT64",
                   "shape": list(t.shape), "data": t.flatten().tolist()}
                  for spec, t in zip(replica.program.inputs, example, strict=True)]
        body = json.dumps({"inputs": inputs}).encode()

        async def http_call() -> int:
            sent = False

            async def receive():
                nonlocal sent
                if sent:
                    return {"type": "http.disconnect"}
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}

            scope = {"type": "http", "method": "POST", "path": "/v2/models/rec/infer",
                     "root_path": "/v2/models/rec", "query_string": b"", "scheme": "http",
                     "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1),
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())]}
            response = await replica(Request(scope, receive))
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.body[:300]!r}")
            return response.status_code

        message = protos().ModelInferRequest(model_name="rec")
        for spec, t in zip(replica.program.inputs, example, strict=True):
            tensor = message.inputs.add(name=spec.name, shape=list(t.shape),
                                        datatype="FP32" if t.is_floating_point() else "INT64")
            if t.is_floating_point():
                tensor.contents.fp32_contents.extend(t.flatten().tolist())
            else:
                tensor.contents.int64_contents.extend(t.flatten().tolist())

        async def grpc_call():
            return await replica.ModelInfer(message)

        loop = asyncio.new_event_loop()
        try:
            for _ in range(20):   # warm: lazy imports, the JIT's first calls
                assert loop.run_until_complete(http_call()) == 200
                loop.run_until_complete(grpc_call())
            # A batch may run on the batcher's worker thread, which was started before
            # the profile was set: take a request whose batch ran on the loop (Note
            # [Inline fast batches]), as a small request's does once its shape ran fast.
            for _ in range(20):
                http = _profiled("__call__", lambda: loop.run_until_complete(http_call()))
                if http.done:
                    break
            for _ in range(20):
                grpc = _profiled("ModelInfer", lambda: loop.run_until_complete(grpc_call()))
                if grpc.done:
                    break
        finally:
            loop.close()
        results = {"http": _report("HTTP (JSON, direct ingress entry)", http),
                   "grpc": _report("gRPC", grpc)}
        replica.__del__()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
