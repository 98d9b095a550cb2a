"""Auth on a real loopback server: shared token, TLS and mTLS with certificates made here."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from transfer.control import (
    ControlConfig,
    ControlError,
    HandshakeReply,
    TicketStore,
    compat_hash,
    make_compat,
)
from transfer.control.aio_server import serve_router
from transfer.control.auth import TlsConfig, token_metadata
from transfer.control.client import RouterClient, TransferClient
from transfer.control.server import serve
from transfer.control.types import GenerateRequest, TokenEvent

COMPAT = make_compat(geometry="tiny/tp1", dtypes="bf16", block_size=4, layout_version=1)
IDENTITY = HandshakeReply("p0", COMPAT, compat_hash(COMPAT), (b"md",), (b"layout",))
TOKEN = "s3cret-token"


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str, key, issuer_name, issuer_key, *, ca: bool = False, server: bool = False
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key or key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki():
    """A CA with a server and a client certificate, and a rogue CA with its own client certificate."""
    out = {}
    for name in ("ca", "rogue"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[name] = (key, _cert(f"pdxfer test {name}", key, None, None, ca=True))
    for name, issuer, server in (
        ("server", "ca", True),
        ("client", "ca", False),
        ("rogue_client", "rogue", False),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        ca_key, ca_cert = out[issuer]
        out[name] = (key, _cert(f"pdxfer {name}", key, ca_cert.subject, ca_key, server=server))
    return {name: (_pem_key(key), _pem(cert)) for name, (key, cert) in out.items()}


@pytest.fixture
def start():
    running = []

    def _start(**kwargs):
        freed = []
        store = TicketStore(
            ControlConfig(8, 2, 4, 2), lambda t, r: freed.append(t.request_id), instance_id="p0"
        )
        server = serve("127.0.0.1:0", store=store, identity=IDENTITY, **kwargs)
        running.append(server)
        store.publish("r1", [0, 1], 0, 5, 1)
        return store, server, freed

    yield _start
    for server in running:
        server.stop(0)


def expect_code(code: str, fn) -> ControlError:
    with pytest.raises(ControlError) as info:
        fn()
    assert info.value.code == code, info.value
    return info.value


def test_token_required_except_for_health(start):
    store, server, freed = start(token=TOKEN)
    for token in (None, "wrong", TOKEN + "x"):
        with TransferClient(server.address, token=token, timeout_s=5) as client:
            assert client.health() == "SERVING"  # open for Kubernetes probes
            expect_code("UNAUTHENTICATED", lambda c=client: c.handshake("d0", COMPAT))
            expect_code("UNAUTHENTICATED", lambda c=client: c.acquire("r1", "d0"))
            expect_code("UNAUTHENTICATED", lambda c=client: c.abort("r1", ""))
            expect_code(
                "UNAUTHENTICATED", lambda c=client: c.acquire("unknown", "d0")
            )  # no probing for ids
    assert freed == [] and store.holder("r1") == ""
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub = channel.unary_unary("/pdxfer.v1.TransferService/Abort")
        with pytest.raises(grpc.RpcError) as info:  # the token must be the only authorization value
            stub(b"\x0a\x02r1", metadata=token_metadata(TOKEN) + token_metadata("x"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with TransferClient(server.address, token=TOKEN, timeout_s=5) as client:
        assert client.acquire("r1", "d0").block_ids == (0, 1)
        client.release("r1", "d0", (0, 1), 0)
    assert freed == ["r1"]


def test_tls(start, pki):
    server_key, server_cert = pki["server"]
    _, ca = pki["ca"]
    _, rogue_ca = pki["rogue"]
    _, server, _ = start(tls=TlsConfig(server_cert, server_key))
    with TransferClient(server.address, tls=TlsConfig(ca=ca), timeout_s=5) as client:
        assert client.handshake("d0", COMPAT).rank_metadata == (b"md",)
    with TransferClient(
        server.address, tls=TlsConfig(ca=ca, server_name="localhost"), timeout_s=5
    ) as client:
        assert client.acquire("r1", "d0").slot_id == 0
    with TransferClient(server.address, timeout_s=5) as client:  # plaintext to a TLS port
        expect_code("UNAVAILABLE", lambda: client.acquire("r1", "d0"))
    with TransferClient(
        server.address, tls=TlsConfig(ca=rogue_ca), timeout_s=5
    ) as client:  # untrusted server
        expect_code("UNAVAILABLE", lambda: client.acquire("r1", "d0"))


def test_mtls_with_token(start, pki):
    server_key, server_cert = pki["server"]
    _, ca = pki["ca"]
    client_key, client_cert = pki["client"]
    rogue_key, rogue_cert = pki["rogue_client"]
    store, server, freed = start(tls=TlsConfig(server_cert, server_key, ca=ca), token=TOKEN)
    for tls in (
        TlsConfig(ca=ca),
        TlsConfig(rogue_cert, rogue_key, ca=ca),
    ):  # no client cert; one from another CA
        with TransferClient(server.address, tls=tls, token=TOKEN, timeout_s=5) as client:
            expect_code("UNAVAILABLE", lambda c=client: c.abort("r1", ""))
    assert freed == [] and len(store) == 1
    good = TlsConfig(client_cert, client_key, ca=ca)
    with TransferClient(server.address, tls=good, timeout_s=5) as client:
        expect_code("UNAUTHENTICATED", lambda: client.abort("r1", ""))
    with TransferClient(server.address, tls=good, token=TOKEN, timeout_s=5) as client:
        client.abort("r1", store.get("r1").abort_key, "test")
    assert freed == ["r1"]


async def _no_tokens(request: GenerateRequest):
    return
    yield


async def _one_token(request: GenerateRequest):
    yield TokenEvent(request.request_id, 7, 0, True)


def test_router_server_takes_mtls_and_token(pki):
    server_key, server_cert = pki["server"]
    _, ca = pki["ca"]
    client_key, client_cert = pki["client"]
    server = serve_router(
        "127.0.0.1:0", _one_token, token=TOKEN, tls=TlsConfig(server_cert, server_key, ca=ca)
    )
    try:
        request = GenerateRequest("r1", (1,), 1)
        good = TlsConfig(client_cert, client_key, ca=ca)
        with RouterClient(server.address, tls=TlsConfig(ca=ca), token=TOKEN, timeout_s=5) as c:
            expect_code("UNAVAILABLE", lambda: list(c.generate(request)))  # no client cert
        with RouterClient(server.address, tls=good, timeout_s=5) as client:
            assert client.health() == "SERVING"  # open for Kubernetes probes
            expect_code("UNAUTHENTICATED", lambda: list(client.generate(request)))
        with RouterClient(server.address, tls=good, token=TOKEN, timeout_s=5) as client:
            assert [e.token for e in client.generate(request)] == [7]
    finally:
        server.stop(0)


def test_tls_config_validation():
    with pytest.raises(ValueError, match="cert_chain and private_key"):
        TlsConfig(cert_chain=b"x")
    with pytest.raises(ValueError, match="tls.cert_chain"):
        serve(
            "127.0.0.1:0",
            store=TicketStore(ControlConfig(1, 1, 1, 1), print),
            identity=IDENTITY,
            tls=TlsConfig(),
        )
    with pytest.raises(ValueError, match="address"):
        serve("no-port", decode=lambda request: iter(()))
    with pytest.raises(ValueError, match="address"):
        serve_router("no-port", _no_tokens)
    with pytest.raises(ValueError, match="store/identity"):
        serve("127.0.0.1:0", store=TicketStore(ControlConfig(1, 1, 1, 1), print))
