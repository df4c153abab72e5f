"""TLS for every gRPC hop (edge -> router or verifier, router -> verifier, verifier -> router when it
registers): credentials from PEM files, and channels that use them. Plaintext where no CA is given."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def check_files(what: str, cert: str | None, key: str | None, ca: str | None = None, needs_ca: bool = False) -> None:
    """Clear errors for a half-given certificate, and (`needs_ca`) a certificate given without the CA that
    says TLS is wanted at all."""
    if bool(cert) != bool(key):
        raise ValueError(f"{what}: a certificate and its key go together")
    if needs_ca and cert and not ca:
        raise ValueError(f"{what}: a client certificate is only presented over TLS; give the server's CA too")
    for path in (cert, key, ca):
        if path and not Path(path).is_file():
            raise ValueError(f"{what}: no such file: {path}")


def check_serving(cert: str | None, key: str | None, client_ca: str | None) -> None:
    """`check_files` for a server's --tls-cert, --tls-key and --tls-client-ca."""
    check_files("--tls-cert/--tls-key", cert, key, client_ca)
    if client_ca and not cert:
        raise ValueError("--tls-client-ca: mutual TLS needs TLS: give --tls-cert and --tls-key")


def add_port(server, address: str, cert: str | None, key: str | None, client_ca: str | None) -> int:
    """Listen on `address`: TLS with this certificate where given; with `client_ca`, mutual TLS, every caller
    presenting a certificate that CA signed (its common name is then the caller's identity, cloud/identity.py).
    The port bound (0: none)."""
    if not cert:
        return server.add_insecure_port(address)
    ca = _read(client_ca)
    credentials = grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=ca,
                                              require_client_auth=ca is not None)
    return server.add_secure_port(address, credentials)


def channel_options(server_name: str | None = None) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 16 << 20)]
    if server_name:  # the name the server's certificate holds, where it differs from the address dialled
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def channel_credentials(ca: str, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """Trust servers whose certificate `ca` signed; present `cert` where the server asks (mutual TLS)."""
    return grpc.ssl_channel_credentials(_read(ca), _read(key), _read(cert))


def channel(target: str, ca: str | None = None, cert: str | None = None, key: str | None = None,
            server_name: str | None = None) -> grpc.Channel:
    """A blocking channel: TLS where `ca` is given, else plaintext."""
    options = channel_options(server_name)
    if ca is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, channel_credentials(ca, cert, key), options=options)


def aio_channel(target: str, ca: str | None = None, cert: str | None = None, key: str | None = None,
                server_name: str | None = None) -> grpc.aio.Channel:
    """`channel` for asyncio (the router's channels to its verifiers, a verifier's to the router)."""
    options = channel_options(server_name)
    if ca is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, channel_credentials(ca, cert, key), options=options)
