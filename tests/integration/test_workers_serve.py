"""`pdxfer serve prefill|decode|router` as a deployment runs it: fixed ports, a token file,
mutual TLS, Prometheus endpoints, an instance id, a data-plane host. A request through
the router returns the colocated TP=1 tokens; what is not allowed is refused."""

from __future__ import annotations

import datetime
import ipaddress
import urllib.request
import uuid

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.support.launch import processes_with_env
from transfer.control.auth import TlsConfig
from transfer.control.client import RouterClient
from transfer.control.errors import ControlError
from transfer.control.types import GenerateRequest
from transfer.model.reference import reference_generate
from transfer.net import free_port
from transfer.presets import get_preset
from transfer.serving.launch.procs import (
    LAUNCH_ID_ENV,
    start_serve,
    stop_all,
    wait_ready,
)

pytestmark = pytest.mark.slow

MODEL = "tiny-kimi-linear"
SEED = 3
PROMPT = [5, 77, 301, 12, 9, 420, 33, 150, 2, 64, 18, 499, 7, 256, 81, 3]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(folder) -> dict[str, str]:
    """A CA, and one certificate every instance uses as server and as client (mTLS)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def build(subject, public_key, **extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(subject))
            .issuer_name(_name("pdxfer test ca"))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
        )
        for extension, critical in extensions.values():
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    ca = build("pdxfer test ca", ca_key.public_key(), ca=(x509.BasicConstraints(True, None), True))
    cert = build(
        "pdxfer worker",
        key.public_key(),
        san=(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False),
        eku=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False),
    )  # fmt: skip
    files = {
        "ca": ca.public_bytes(serialization.Encoding.PEM),
        "cert": cert.public_bytes(serialization.Encoding.PEM),
        "key": key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = str(folder / f"{name}.pem")
        (folder / f"{name}.pem").write_bytes(data)
    return paths


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_serve_trio_with_every_deployment_flag(tmp_path):
    pki = make_pki(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("tok-" + uuid.uuid4().hex + "\n")
    security = ["--auth-token-file", str(token_file), "--tls-cert", pki["cert"],
                "--tls-key", pki["key"], "--tls-ca", pki["ca"]]  # fmt: skip
    ports = {role: (free_port(), free_port()) for role in ("prefill", "decode", "router")}
    worker = ["--model", MODEL, "--transport", "nixl", "--data-host", "127.0.0.1",
              "--gpu-mem", "16MiB", "--max-seqs", "2", "--block-size", "64", "--seed", str(SEED),
              "--lease-seconds", "20", "--tp", "1", "--device", "cpu"]  # fmt: skip

    def args(role: str, *extra: str) -> list[str]:
        grpc_port, metrics_port = ports[role]
        return ["--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port",
                str(metrics_port), "--instance-id", f"{role}-test", *security, *extra]  # fmt: skip

    launch_id = uuid.uuid4().hex
    env = {LAUNCH_ID_ENV: launch_id}
    procs = [
        start_serve(role, args(role, *worker), tmp_path, env) for role in ("prefill", "decode")
    ]
    try:
        wait_ready(procs, 240)
        route = ["--prefill", procs[0].address, "--decode", procs[1].address]
        procs.append(start_serve("router", args("router", *route), tmp_path, env))
        wait_ready(procs, 60)
        assert [p.address for p in procs] == [f"127.0.0.1:{ports[r][0]}" for r in ports]
        tls = TlsConfig.from_files(pki["cert"], pki["key"], pki["ca"])
        token = token_file.read_text().strip()
        request = GenerateRequest("serve-1", tuple(PROMPT), 5)
        with RouterClient(procs[2].address, token=token, tls=tls) as client:
            assert client.health() == "SERVING"
            events = list(client.generate(request))
        with RouterClient(procs[2].address, tls=tls) as anonymous, pytest.raises(ControlError) as denied:  # fmt: skip
            list(anonymous.generate(request))
        assert denied.value.code == "UNAUTHENTICATED"
        decode_metrics = scrape(ports["decode"][1])
        prefill_metrics = scrape(ports["prefill"][1])
        router_metrics = scrape(ports["router"][1])
    finally:
        stop_all(procs)
    assert [e.token for e in events] == reference_generate(get_preset(MODEL), PROMPT, 5, SEED)
    assert 'pdxfer_transfers_total{status="done"} 1.0' in decode_metrics
    assert "pdxfer_tickets_active 0.0" in prefill_metrics
    assert 'pdxfer_router_requests_total{status="ok"} 1.0' in router_metrics
    for text in (decode_metrics, prefill_metrics):
        total = next(
            line for line in text.splitlines() if line.startswith("pdxfer_kv_blocks_total")
        )
        free = next(line for line in text.splitlines() if line.startswith("pdxfer_kv_blocks_free"))
        assert float(total.split()[1]) == float(free.split()[1]) > 0
    assert not processes_with_env(LAUNCH_ID_ENV, launch_id)
