"""overlays/vllm (and vllm-rdma): vLLM prefill and decode pools that load PdxferConnector,
behind pdxfer's router. Each vLLM container's --kv-transfer-config, expanded as the
kubelet would, is JSON naming the connector; the pools and the router agree on ports,
probes, mounts and TP."""

from __future__ import annotations

import json

import pytest
from k8s_manifests import (
    MODELS,
    POD_IP,
    CommandLine,
    command_lines,
    container_env,
    container_ports,
    flag_value,
    geometry_of,
    is_vllm,
    mount_holding,
    objects_of,
    parse_pdxfer,
    rendered,
    selects,
)

VLLM_OVERLAYS = ("vllm", "vllm-rdma")
CONNECTOR = "PdxferConnector"
CONNECTOR_MODULE = "transfer.vllm"
SECRET = "pdxfer-auth"
GPU = "nvidia.com/gpu"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _vllm_lines(name: str) -> list[CommandLine]:
    lines = [line for line in command_lines(rendered(name)) if is_vllm(line)]
    assert lines, f"{name}: no vLLM container"
    return lines


def _role(line: CommandLine) -> str:
    """prefill or decode, from the pod's component label (vllm-ROLE[-worker])."""
    component = line.pod.labels["app.kubernetes.io/component"]
    return component.removeprefix("vllm-").removesuffix("-worker")


def _kv_transfer_config(line: CommandLine) -> dict:
    text = flag_value(line.argv, "--kv-transfer-config")
    assert text is not None, f"{line.label}: no --kv-transfer-config"
    assert not line.missing, f"{line.label}: undefined references {line.missing}"
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{line.label}: --kv-transfer-config is not JSON: {exc}") from exc


@pytest.mark.parametrize("name", VLLM_OVERLAYS)
def test_every_vllm_container_loads_pdxfer_connector(name):
    roles = set()
    for line in _vllm_lines(name):
        config = _kv_transfer_config(line)
        assert config["kv_connector"] == CONNECTOR, line.label
        assert config["kv_connector_module_path"] == CONNECTOR_MODULE, line.label
        assert config["kv_role"] == "kv_both", line.label
        extra = config["kv_connector_extra_config"]
        assert extra["transport"] in ("nixl", "ucx"), line.label
        # The control server's port is declared, so a peer (or RDMA's host network)
        # finds it; the token file lies in the read-only mount of the Secret.
        assert isinstance(extra["control_port"], int), line.label
        assert extra["control_port"] in container_ports(line.container), line.label
        # Tickets advertise control_host: the pod's own address, not the loopback default
        # that a decode pod could never reach.
        assert extra["control_host"] == POD_IP, line.label
        mount, volume = mount_holding(line, extra["auth_token_file"])
        assert mount.get("readOnly") is True and volume["secret"]["secretName"] == SECRET
        relative = extra["auth_token_file"][len(mount["mountPath"].rstrip("/")) + 1 :]
        assert relative in [item["path"] for item in volume["secret"]["items"]], line.label
        roles.add(_role(line))
    assert roles == {"prefill", "decode"}, f"{name}: vLLM pools {sorted(roles)}"


@pytest.mark.parametrize("name", VLLM_OVERLAYS)
def test_vllm_reads_the_model_from_the_read_only_volume(name):
    for line in _vllm_lines(name):
        model = flag_value(line.argv, "--model")
        if model is None:  # `vllm serve MODEL`: the positional after `serve`
            model = line.argv[2]
        assert model.startswith(MODELS + "/"), f"{line.label}: model {model}"
        mount, volume = mount_holding(line, model)
        assert mount["mountPath"] == MODELS and mount.get("readOnly") is True, line.label
        assert volume["persistentVolumeClaim"] == {
            "claimName": "pdxfer-models",
            "readOnly": True,
        }, line.label


@pytest.mark.parametrize("name", VLLM_OVERLAYS)
def test_vllm_groups_span_nodes_with_tp_matching_gpus(name):
    """LeaderWorkerSet groups: TP = nodes x GPUs per pod, a TP the model allows; the
    leader runs the OpenAI server at node rank 0 and declares the rendezvous port, the
    others run headless with the ranks 1..size-1."""
    ranks: dict[str, list[int]] = {}
    for line in _vllm_lines(name):
        owner = line.pod.owner
        assert owner["kind"] == "LeaderWorkerSet", line.label
        size = owner["spec"]["leaderWorkerTemplate"]["size"]
        nnodes = int(flag_value(line.argv, "--nnodes"))
        rank = int(flag_value(line.argv, "--node-rank"))
        tp = int(flag_value(line.argv, "--tensor-parallel-size"))
        resources = line.container["resources"]
        gpus = int(resources["limits"][GPU])
        assert gpus == int(resources["requests"][GPU]), line.label
        assert nnodes == size and gpus * nnodes == tp, f"{line.label}: {gpus} x {nnodes} != {tp}"
        geometry_of(flag_value(line.argv, "--model") or line.argv[2]).check_tp(tp)
        leader = line.pod.name.endswith(" leader")
        assert (rank == 0) == leader, line.label
        assert ("--headless" in line.argv) == (not leader), line.label
        if leader:
            port = int(flag_value(line.argv, "--master-port"))
            assert port in container_ports(line.container), f"{line.label}: --master-port"
        ranks.setdefault(owner["metadata"]["name"], []).append(rank)
    for set_name, seen in ranks.items():
        assert sorted(seen) == list(range(len(seen))), (set_name, seen)


@pytest.mark.parametrize("name", VLLM_OVERLAYS)
def test_vllm_servers_are_probed_and_scraped_on_their_http_port(name):
    for line in _vllm_lines(name):
        if "--headless" in line.argv:
            assert not any(p in line.container for p in PROBES), f"{line.label}: no HTTP here"
            continue
        port = int(flag_value(line.argv, "--port"))
        ports = container_ports(line.container)
        for probe in PROBES:
            get = line.container[probe]["httpGet"]
            assert get["path"] == "/health" and ports[get["port"]] == port, (line.label, probe)
        # The startup probe covers loading a checkpoint: at least 20 minutes.
        startup = line.container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, line.label
        # vllm:pdxfer_* are on vLLM's own /metrics.
        notes = line.pod.annotations
        assert notes["prometheus.io/scrape"] == "true", line.label
        assert int(notes["prometheus.io/port"]) == port, line.label
        assert notes["prometheus.io/path"] == "/metrics", line.label


@pytest.mark.parametrize("name", VLLM_OVERLAYS)
def test_router_fronts_the_vllm_pools(name):
    """`pdxfer serve router --engine vllm --prefill URL --decode URL`: each URL names a
    headless Service whose pods are that role's vLLM OpenAI servers, on their port."""
    objects = rendered(name)
    services = objects_of(objects, "Service")
    (router,) = [line for line in command_lines(objects) if line.argv[1:3] == ("serve", "router")]
    args = parse_pdxfer(router.argv)
    assert args.engine == "vllm", router.label
    servers = [line for line in _vllm_lines(name) if "--headless" not in line.argv]
    for role, urls in (("prefill", args.prefill), ("decode", args.decode)):
        assert urls, f"{router.label}: no --{role}"
        for url in urls:
            scheme, _, rest = url.partition("://")
            assert scheme == "http", url
            host, _, port = rest.rstrip("/").partition(":")
            service = services[host]["spec"]
            assert service["clusterIP"] == "None", f"Service/{host} is not headless"
            (target,) = [p for p in service["ports"] if p["port"] == int(port)]
            backends = [s for s in servers if selects(service["selector"], s.pod.labels)]
            assert backends, f"{url} selects no vLLM server"
            for server in backends:
                assert _role(server) == role, f"--{role} {url} reaches {server.label}"
                served = int(flag_value(server.argv, "--port"))
                assert container_ports(server.container)[target["targetPort"]] == served
    env = container_env(router.container, router.pod, {}, objects)
    names = {flag_value(s.argv, "--served-model-name") for s in servers}
    assert names == {args.served_model_name} and args.served_model_name, (names, env["MODEL"])


def test_vllm_rdma_adds_devices_host_network_and_ucx():
    objects = rendered("vllm-rdma")
    for line in _vllm_lines("vllm-rdma"):
        spec = line.pod.spec
        assert spec["hostNetwork"] is True and spec["hostIPC"] is True, line.label
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet", line.label
        resources = line.container["resources"]
        rdma = [k for k in resources["limits"] if k.startswith("rdma/")]
        assert rdma and all(resources["requests"][k] == resources["limits"][k] for k in rdma)
        assert "IPC_LOCK" in line.container["securityContext"]["capabilities"]["add"]
        env = container_env(line.container, line.pod, line.variant, objects)
        assert "rc" in env["UCX_TLS"].split(","), line.label
        assert _kv_transfer_config(line)["kv_connector_extra_config"]["transport"] == "nixl"
        anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        values = anti[0]["labelSelector"]["matchExpressions"][0]["values"]
        # One vLLM pod per node: its own label is among those it repels.
        assert line.pod.labels["app.kubernetes.io/component"] in values, line.label
    # The same pods as overlays/vllm, only patched.
    plain = {(line.pod.name, line.container["name"]) for line in _vllm_lines("vllm")}
    assert {(line.pod.name, line.container["name"]) for line in _vllm_lines("vllm-rdma")} == plain
