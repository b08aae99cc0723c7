"""The server-level v2 application (route prefix /v2): server metadata, health, the
repository index, and a 404 naming the served models for any unknown model."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi.responses import Response
from ray import serve

import dynvm
from dynvm.cluster.protocol import _v2 as v2
from dynvm.cluster.protocol._http_errors import error_response, json_response
from dynvm.cluster.protocol._http_front import MODEL_VERSION, model_app_name, protocol_app

server_api = protocol_app("dynvm server")


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(server_api)
class ServerFront:
    """Server-level routes, and 404 for models that are not deployed."""

    def __init__(self, model_names: Sequence[str], ready_timeout_s: float = 5.0) -> None:
        self.model_names = list(model_names)
        self.ready_timeout_s = ready_timeout_s

    @server_api.get("/")
    async def get_server(self) -> Response:
        return json_response(v2.server_metadata(dynvm.__version__))

    @server_api.get("/health/live")
    async def get_live(self) -> Response:
        return json_response({"live": True})

    @server_api.get("/health/ready")
    async def get_ready(self) -> Response:
        not_ready = []
        for name in self.model_names:
            try:
                handle = serve.get_app_handle(model_app_name(name))
                ok = await asyncio.wait_for(handle.is_ready.remote(), self.ready_timeout_s)
            except Exception:  # not deployed, unhealthy or too slow: not ready
                ok = False
            if not ok:
                not_ready.append(name)
        if not_ready:
            return json_response({"ready": False, "not_ready": not_ready}, status=503)
        return json_response({"ready": True})

    @server_api.post("/repository/index")
    async def repository_index(self) -> Response:
        """The model repository extension's index: every served model, READY."""
        return json_response([{"name": n, "version": MODEL_VERSION, "state": "READY"}
                              for n in self.model_names])

    @server_api.api_route("/models/{rest:path}", methods=["GET", "POST"])
    async def unknown_model(self, rest: str) -> Response:
        asked = rest.split("/", 1)[0]
        name = v2.cut(repr(asked))  # the client's: cut before echoing
        if asked in self.model_names:
            # Through the proxy a served model's routes reach its own application; here
            # only when sent to this application's own port (Note [Direct ingress]).
            return error_response(f"model {name} is served by its own application, not "
                                  f"this one: send its requests to its replicas' "
                                  f"addresses (direct ingress) or through Serve's proxy",
                                  404)
        return error_response(f"unknown model {name}; served models: "
                              f"{', '.join(repr(n) for n in self.model_names) or 'none'}", 404)
