"""Every probe, scrape annotation, Service and peer address points at a port that the
container both declares and, by its own command line, serves."""

from __future__ import annotations

from k8s_manifests import (
    command_lines,
    container_ports,
    flag_value,
    objects_of,
    parse_pdxfer,
    pod_templates,
    selects,
    split_host_port,
)

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _serving(objects):
    """(line, parsed args) of every `pdxfer serve` container."""
    for line in command_lines(objects):
        if line.argv[:2] == ("pdxfer", "serve"):
            yield line, parse_pdxfer(line.argv)


def test_workers_have_grpc_probes_on_their_grpc_port(objects):
    """A worker's gRPC health answers SERVING only once its ranks are up (weights
    loaded, handshake identity made): the probes hold it out of its pool until then."""
    for line, args in _serving(objects):
        if args.role == "router":
            continue
        ports = container_ports(line.container)
        for name in PROBES:
            probe = line.container.get(name)
            assert probe and "grpc" in probe, f"{line.label}: no native gRPC {name}"
            port = probe["grpc"]["port"]
            assert port in ports, f"{line.label}: {name} port {port} is not declared"
            assert port == args.port, f"{line.label}: {name} port {port}, --port {args.port}"


def test_router_probes_are_http_gets_on_its_http_port(objects):
    routers = 0
    for line, args in _serving(objects):
        if args.role != "router":
            continue
        routers += 1
        assert args.http_port, f"{line.label}: no --http-port"
        ports = container_ports(line.container)
        paths = {}
        for name in PROBES:
            probe = line.container.get(name)
            assert probe and "httpGet" in probe, f"{line.label}: {name} is not an httpGet"
            get = probe["httpGet"]
            assert get.get("scheme", "HTTP") == "HTTP", f"{line.label}: {name} {get}"
            assert ports.get(get["port"]) == args.http_port, (
                f"{line.label}: {name} port {get['port']}, --http-port {args.http_port}"
            )
            paths[name] = get["path"]
        # Ready only while a prefill and a decode instance serve.
        assert paths["readinessProbe"] == "/health", line.label
        assert set(paths.values()) <= {"/health", "/metrics"}, paths
    assert routers <= 1


def test_every_probe_targets_a_declared_port(objects):
    for pod in pod_templates(objects):
        for container in pod.containers():
            ports = container_ports(container)
            for name in PROBES:
                probe = container.get(name, {})
                for action in ("grpc", "httpGet", "tcpSocket"):
                    if action in probe:
                        assert probe[action]["port"] in ports, (pod.name, name, probe)


def test_scrape_annotations_point_at_the_metrics_port(objects):
    scraped = 0
    for pod in pod_templates(objects):
        notes = pod.annotations
        if notes.get("prometheus.io/scrape") != "true":
            continue
        scraped += 1
        port = int(notes["prometheus.io/port"])
        assert notes.get("prometheus.io/path", "/metrics") == "/metrics", pod.name
        owners = [c for c in pod.containers() if port in container_ports(c)]
        assert len(owners) == 1, f"{pod.name}: scrape port {port} declared by {len(owners)}"
        for line, args in _serving(objects):
            if line.pod == pod and line.container is owners[0]:
                # The router serves /metrics on its HTTP port; workers on --metrics-port.
                served = args.http_port if args.role == "router" else args.metrics_port
                assert served == port, f"{line.label}: scrape port {port}, serves {served}"
    servers = {line.pod.name for line, _ in _serving(objects)}
    assert scraped >= len(servers), "a pdxfer server without scrape annotations"


def test_services_reach_declared_ports_of_their_pods(objects):
    pods = pod_templates(objects)
    for name, service in objects_of(objects, "Service").items():
        selector = service["spec"].get("selector", {})
        chosen = [p for p in pods if selects(selector, p.labels)]
        assert chosen, f"Service/{name} selects no pod template"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in chosen:
                served = [c for c in pod.containers() if target in container_ports(c)]
                assert served, f"Service/{name} port {target} is not declared by {pod.name}"


def test_router_targets_are_headless_pools_on_their_grpc_port(objects):
    services = objects_of(objects, "Service")
    servers = list(_serving(objects))
    for line, args in servers:
        if args.role != "router" or args.engine == "vllm":
            continue  # vLLM backends: test_deploy_vllm
        for role, addresses in (("prefill", args.prefill), ("decode", args.decode)):
            assert addresses, f"{line.label}: no --{role}"
            for address in addresses:
                host, port = split_host_port(address)
                service = services[host]["spec"]
                assert service["clusterIP"] == "None", f"Service/{host} is not headless"
                assert port in [p["port"] for p in service["ports"]], address
                backends = [
                    (peer, peer_args)
                    for peer, peer_args in servers
                    if selects(service["selector"], peer.pod.labels)
                ]
                assert backends, f"Service/{host} selects no pdxfer server"
                for peer, peer_args in backends:
                    assert peer_args.role == role, f"--{role} {address} reaches {peer.label}"
                    assert peer_args.port in container_ports(peer.container)
                    target = next(p for p in service["ports"] if p["port"] == port)
                    target_port = container_ports(peer.container)[target.get("targetPort", port)]
                    assert target_port == peer_args.port, f"{address} -> {peer.label}"


def test_multi_node_leaders_declare_the_rendezvous_port(objects):
    for line, args in _serving(objects):
        if args.nnodes > 1 and args.node_rank == 0:
            _, port = split_host_port(args.dist_addr)
            assert port in container_ports(line.container), f"{line.label}: --dist-addr {port}"


def test_bench_peer_is_index_zero_on_a_declared_port(objects):
    services = objects_of(objects, "Service")
    for line in command_lines(objects):
        if line.argv[1:3] != ("bench", "transfer"):
            continue
        peer = flag_value(line.argv, "--peer")
        assert peer, f"{line.label}: no --peer"
        host, port = split_host_port(peer)
        job = line.pod.owner["metadata"]["name"]
        subdomain = line.pod.spec["subdomain"]
        assert host == f"{job}-0.{subdomain}", f"{line.label}: --peer {host}"
        service = services[subdomain]["spec"]
        assert service["clusterIP"] == "None" and selects(service["selector"], line.pod.labels)
        assert port in container_ports(line.container), f"{line.label}: port {port}"
