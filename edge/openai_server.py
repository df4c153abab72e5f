"""`specedge edge-serve`'s HTTP side: the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions,
streamed as server-sent events) answered by an EdgeClient, so an app that speaks the API gets edge
drafting without code changes.

Starlette and uvicorn (the `serve` extra) are a small, well-kept ASGI pair (FastAPI is Starlette plus
pydantic, which the edge would not use). Each request is one generation of the shared EdgeClient; at most
as many run at once as the verifier lets one client open sessions, the rest wait their turn. A streaming
client that hangs up ends its generation at the next round (edge/streaming.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import time

import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from specedge.edge.client import ClientResult, EdgeClient
from specedge.edge.openai_protocol import ApiError, Limits, Request, Response, finish_reason, parse_request, usage
from specedge.edge.streaming import astream_events

# The status an app sees when the verifier answers a generation with a gRPC error.
VERIFIER_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def verifier_error(e: grpc.RpcError) -> ApiError:
    status = VERIFIER_STATUS.get(e.code(), 502)  # e.g. the edge's own credentials refused: a gateway error
    return ApiError(status, f"verifier error {e.code().name}: {e.details()}",
                    kind="invalid_request_error" if status < 500 else "server_error")


def create_app(client: EdgeClient, served_model: str | None = None, api_key: str | None = None,
               max_concurrent: int = 64) -> Starlette:
    """The API over `client`. `served_model`: the name apps ask for (default: the verifier's model name);
    `api_key`: if set, requests must carry `Authorization: Bearer <api_key>`."""
    info = client.verifier.info
    limits = Limits(served_model or info.model, info.limits.max_prompt_tokens, info.limits.max_new_tokens)
    if info.limits.max_sessions_per_client > 0:
        max_concurrent = min(max_concurrent, info.limits.max_sessions_per_client)
    turns = asyncio.Semaphore(max_concurrent)
    started = int(time.time())

    def check_key(http: HttpRequest) -> None:
        given = http.headers.get("authorization", "")
        if api_key is not None and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", None,
                           "authentication_error", "invalid_api_key")

    async def models(http: HttpRequest) -> JSONResponse:
        check_key(http)
        return JSONResponse({"object": "list", "data": [
            {"id": limits.served_model, "object": "model", "created": started, "owned_by": "specedge"}]})

    async def health(http: HttpRequest) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": limits.served_model, "verifier": client.verifier.target})

    async def answer(http: HttpRequest, chat: bool):
        check_key(http)
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON")
        request = parse_request(body, chat, client.tokenizer, limits)
        response = Response(chat, limits.served_model)
        if request.stream:
            return StreamingResponse(_sse(request, response), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async with turns:
            result = None
            try:
                async for item in astream_events(client, request.prompt_ids, **_generation_args(request)):
                    if isinstance(item, ClientResult):
                        result = item
            except grpc.RpcError as e:
                raise verifier_error(e)
        return JSONResponse(response.whole(result.text, finish_reason(result.stats.stopped_by),
                                           usage(len(request.prompt_ids), result.stats.num_tokens), _stats(result)))

    async def _sse(request: Request, response: Response):
        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        async with turns:
            try:
                if request.chat:
                    yield event(response.chunk(first=True))
                async for item in astream_events(client, request.prompt_ids, **_generation_args(request)):
                    if isinstance(item, str):
                        yield event(response.chunk(item))
                    else:
                        result = item
                yield event(response.chunk(reason=finish_reason(result.stats.stopped_by)))
                if request.include_usage:
                    yield event(response.usage_chunk(usage(len(request.prompt_ids), result.stats.num_tokens)))
            except grpc.RpcError as e:  # the status line has gone out: the error travels as an event
                yield event(verifier_error(e).body())
            yield "data: [DONE]\n\n"

    async def completions(http: HttpRequest):
        return await answer(http, chat=False)

    async def chat_completions(http: HttpRequest):
        return await answer(http, chat=True)

    async def api_error(http: HttpRequest, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def http_error(http: HttpRequest, e: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, f"{http.method} {http.url.path}: {e.detail}").body(),
                            status_code=e.status_code)

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error})


def _generation_args(request: Request) -> dict:
    p = request.params
    return {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                "seed": p.seed, "stop": p.stop}


def _stats(result: ClientResult) -> dict:
    s = result.stats
    return {"rounds": s.rounds, "mean_accepted": round(s.mean_accepted, 3), "tokens_per_s": round(s.tokens_per_s, 2),
            "wall_s": round(s.wall_s, 3), "ttft_s": round(s.ttft_s, 3)}


class HttpServer:
    """uvicorn serving `app` on a socket bound and listening now (port 0: any free port; `port` tells which)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        # Listening from now on: a client that connects before uvicorn has started waits in the backlog
        # instead of being refused (the command prints its URL before serving).
        self.socket.listen(socket.SOMAXCONN)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        """Serve on this thread until SIGINT/SIGTERM (or `stop`)."""
        self.server.run(sockets=[self.socket])

    def start(self) -> HttpServer:
        """Serve from a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="edge-serve", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server stopped while starting (see its log)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self.socket.close()
