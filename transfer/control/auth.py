"""Auth for the control plane: an optional shared token in call metadata, and TLS / mTLS.

The token travels as `authorization: Bearer <token>`. Health checks stay open
(Kubernetes gRPC probes cannot send metadata); every other method, reflection
included, answers UNAUTHENTICATED without the token.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from transfer.errors import InvalidInput

AUTH_METADATA_KEY = "authorization"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes for one side of a TLS connection.

    Server: `cert_chain` + `private_key` are required; `ca` set means mTLS (clients
    must present a certificate signed by it). Client: `ca` verifies the server
    (None: system roots); `cert_chain` + `private_key` are the client's own
    certificate for mTLS; `server_name` overrides the name checked against the
    server certificate.
    """

    cert_chain: bytes | None = None
    private_key: bytes | None = None
    ca: bytes | None = None
    server_name: str = ""

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise InvalidInput("tls: cert_chain and private_key must be given together")

    @classmethod
    def from_files(
        cls,
        cert_chain: str | None = None,
        private_key: str | None = None,
        ca: str | None = None,
        server_name: str = "",
    ) -> TlsConfig:
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(read(cert_chain), read(private_key), read(ca), server_name)


def load_token(path: str | None) -> str | None:
    """The shared token: the file at `path` (or $PDXFER_AUTH_TOKEN_FILE), else
    $PDXFER_AUTH_TOKEN, else None. An empty file is an error naming --auth-token-file."""
    path = path or os.environ.get("PDXFER_AUTH_TOKEN_FILE")
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise InvalidInput(f"--auth-token-file {path}: the file is empty")
        return token
    return os.environ.get("PDXFER_AUTH_TOKEN", "").strip() or None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    if tls.cert_chain is None or tls.private_key is None:
        raise InvalidInput("tls.cert_chain: a server needs a certificate and private key")
    return grpc.ssl_server_credentials(
        [(tls.private_key, tls.cert_chain)],
        root_certificates=tls.ca,
        require_client_auth=tls.ca is not None,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.private_key, certificate_chain=tls.cert_chain
    )


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (empty when there is none)."""
    return () if not token else ((AUTH_METADATA_KEY, f"Bearer {token}"),)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str, open_methods: frozenset[str] = OPEN_METHODS):
        if not token:
            raise InvalidInput("token: must be a non-empty string")
        self._expected = f"Bearer {token}".encode()
        self._open = open_methods

    def allows(self, handler_call_details: grpc.HandlerCallDetails) -> bool:
        if handler_call_details.method in self._open:
            return True
        sent = [
            v for k, v in handler_call_details.invocation_metadata or () if k == AUTH_METADATA_KEY
        ]
        return (
            len(sent) == 1
            and isinstance(sent[0], str)
            and hmac.compare_digest(sent[0].encode(), self._expected)
        )

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        return handler if self.allows(handler_call_details) else _deny(handler, _reject)


class AsyncTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """TokenAuthInterceptor for a grpc.aio server."""

    def __init__(self, token: str, open_methods: frozenset[str] = OPEN_METHODS):
        self._check = TokenAuthInterceptor(token, open_methods)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return handler if self._check.allows(handler_call_details) else _deny(handler, _areject)


_DENIED = "missing or invalid token in 'authorization' metadata"


def _reject(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


async def _areject(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


def _deny(handler: grpc.RpcMethodHandler | None, reject) -> grpc.RpcMethodHandler:
    # The denying handler must have the same streaming shape as the method it replaces.
    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(reject)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(reject)
    return grpc.unary_stream_rpc_method_handler(reject)
