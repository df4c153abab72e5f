"""Bearer-token authentication for gRPC servers (verifier and router)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc


class BearerAuth(grpc.aio.ServerInterceptor):
    """Every call to the guarded services needs `authorization: Bearer <token>` with one of `tokens`; health
    checks do not."""

    def __init__(self, tokens: Iterable[str], guarded: tuple[str, ...]) -> None:
        self.expected = {f"Bearer {token}" for token in tokens}
        self.guarded = guarded

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if not details.method.startswith(self.guarded):
            return handler
        if dict(details.invocation_metadata or ()).get("authorization") in self.expected:
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def accepted_tokens(auth_token: str | None, named: dict[str, str]) -> set[str]:
    """Every token a server takes: its one shared token, and those of its `--auth-tokens` file."""
    return ({auth_token} if auth_token else set()) | set(named)
