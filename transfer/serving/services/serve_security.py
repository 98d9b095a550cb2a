"""Who may talk to a serve process: the control-plane token, TLS, and the refusal to serve
a non-loopback address with neither."""

from __future__ import annotations

import ipaddress
import socket

from transfer.control.auth import TlsConfig, load_token
from transfer.serving.engine.serve_options import ServeOptions


def auth_token(options: ServeOptions) -> str | None:
    """--auth-token-file (or PDXFER_AUTH_TOKEN_FILE), else PDXFER_AUTH_TOKEN, else none."""
    return load_token(options.auth_token_file)


def tls_configs(options: ServeOptions) -> tuple[TlsConfig | None, TlsConfig | None]:
    """(server TLS, client TLS for calls to other instances). The certificate doubles as
    the client certificate, so `--tls-ca` on every instance gives mutual TLS."""
    if bool(options.tls_cert) != bool(options.tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    server = (
        TlsConfig.from_files(options.tls_cert, options.tls_key, options.tls_ca)
        if options.tls_cert
        else None
    )
    client = None
    if options.tls_cert or options.tls_ca:
        client = TlsConfig.from_files(options.tls_cert, options.tls_key, options.tls_ca)
    return server, client


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_exposure(options: ServeOptions, token: str | None, tls) -> None:
    """Serving beyond this machine needs a token or mutual TLS: without either, anyone who
    reaches the port gets the arena's transport metadata and can drive the ranks. ValueError
    (exit 2) unless `--insecure`."""
    hosts = [options.host, options.data_host or options.host]
    exposed = [h for h in hosts if not is_loopback(h)]
    mutual = tls is not None and tls.ca is not None
    if exposed and not (token or mutual) and not options.insecure:
        raise ValueError(
            f"--host {exposed[0]}: serving a non-loopback address needs --auth-token-file "
            "(or PDXFER_AUTH_TOKEN) or mutual TLS (--tls-cert/--tls-key/--tls-ca); "
            "--insecure serves it without"
        )


def check_http_exposure(host: str, key: str | None, insecure: bool) -> None:
    """The same rule for the OpenAI HTTP API: off loopback, anyone who reaches the port
    gets completions, so it needs an API key. ValueError (exit 2) unless `--insecure`."""
    if not is_loopback(host) and not key and not insecure:
        raise ValueError(
            f"--host {host}: serving the HTTP API on a non-loopback address needs "
            "--api-key-file (or PDXFER_API_KEY); --insecure serves it without"
        )
