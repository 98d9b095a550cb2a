"""Every kustomization renders, and each one holds what it is for."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import yaml
from k8s_manifests import (
    K8S,
    MODELS,
    SHELL,
    command_lines,
    container_env,
    container_ports,
    geometry_of,
    is_shell,
    kustomizations,
    mount_holding,
    objects_of,
    parse_pdxfer,
    pod_templates,
    rendered,
    where,
)

SECRET = "pdxfer-auth"
API_KEY_SECRET = "pdxfer-api-key"
MODELS_CLAIM = "pdxfer-models"
# Fields kustomize v5 deprecates (each render warns about them).
DEPRECATED = ("bases", "patchesStrategicMerge", "patchesJson6902", "commonLabels", "vars")


def test_renders_whole_unique_objects(kustomization):
    docs = rendered(kustomization)
    assert docs, f"{kustomization}: renders nothing"
    for doc in docs:
        # kustomize v2 (kubectl 1.20) renders a `$patch: delete` as an empty document.
        assert doc, f"{kustomization}: an empty document"
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name")
    ids = [where(doc) for doc in docs]
    assert len(ids) == len(set(ids)), f"{kustomization}: duplicate objects {ids}"


def test_pods_run_pdxfer_image_unprivileged(objects):
    pods = pod_templates(objects)
    assert pods
    for pod in pods:
        context = pod.spec.get("securityContext", {})
        assert context.get("runAsNonRoot") is True, pod.name
        assert context.get("runAsUser", 0) > 0, pod.name
        for container in pod.containers():
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, pod.name
            assert "ALL" in container["securityContext"]["capabilities"]["drop"], pod.name
            repository = container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]
            if container["name"] == "vllm":
                # deploy/docker/Dockerfile.vllm: vLLM's image with pdxfer added.
                assert repository == "pdxfer-vllm", (pod.name, container["image"])
                assert container.get("command", [])[:1] in (["python3"], ["vllm"]), pod.name
                continue
            assert repository == "pdxfer", (pod.name, container["image"])
            if pod.owner["kind"] == "Job" and container.get("command") == list(SHELL):
                pass  # smoke, model-fill: scripts, in the same image
            else:
                assert container.get("command") == ["pdxfer"], pod.name


def test_base_router_pools_config():
    objects = rendered("base")
    services = objects_of(objects, "Service")
    assert "pdxfer-router" in objects_of(objects, "Deployment")
    assert services["pdxfer-router"]["spec"].get("clusterIP") != "None"
    for role in ("prefill", "decode"):
        pool = objects_of(objects, "StatefulSet")[f"pdxfer-{role}"]
        assert services[pool["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    config = objects_of(objects, "ConfigMap")["pdxfer-config"]["data"]
    assert config["MODEL"].startswith(MODELS + "/")
    geometry = geometry_of(config["MODEL"])  # raises on a checkpoint the tests do not know
    for role in ("PREFILL", "DECODE"):
        geometry.check_tp(int(config[f"PDXFER_{role}_TP"]))


def test_serving_pods_mount_the_auth_secret(objects):
    for line in command_lines(objects):
        if line.argv[:2] != ("pdxfer", "serve"):
            continue
        token = next(a.split("=", 1)[1] for a in line.argv if a.startswith("--auth-token-file="))
        volumes = {v["name"]: v for v in line.pod.spec["volumes"]}
        mounts = [
            m
            for m in line.container["volumeMounts"]
            if token.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        assert len(mounts) == 1, f"{line.label}: {token} is in no single volume mount"
        secret = volumes[mounts[0]["name"]]["secret"]
        assert secret["secretName"] == SECRET and mounts[0]["readOnly"] is True
        relative = token[len(mounts[0]["mountPath"].rstrip("/")) + 1 :]
        assert relative in [item["path"] for item in secret["items"]], line.label


def test_single_node_is_1p1d_on_one_node():
    objects = rendered("single-node")
    pools = objects_of(objects, "StatefulSet")
    assert [pools[f"pdxfer-{r}"]["spec"]["replicas"] for r in ("prefill", "decode")] == [1, 1]
    for pod in pod_templates(objects):
        term = pod.spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term[0]["topologyKey"] == "kubernetes.io/hostname", pod.name
        # The first pod scheduled must match its own term, or none can be placed.
        selector = term[0]["labelSelector"]["matchLabels"]
        assert all(pod.labels.get(k) == v for k, v in selector.items()), pod.name


def test_multi_node_uses_leader_worker_sets():
    objects = rendered("multi-node")
    assert not objects_of(objects, "StatefulSet")
    sets = objects_of(objects, "LeaderWorkerSet")
    for role in ("prefill", "decode"):
        group = sets[f"pdxfer-{role}-lws"]["spec"]["leaderWorkerTemplate"]
        assert group["size"] >= 2
        assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
        # The LWS controller makes a headless Service named after the set.
        assert f"pdxfer-{role}-lws" not in objects_of(objects, "Service")


def test_rdma_workers_get_devices_host_network_and_ucx():
    objects = rendered("rdma")
    workers = [p for p in pod_templates(objects) if p.owner["kind"] == "StatefulSet"]
    assert len(workers) == 2
    for pod in workers:
        assert pod.spec["hostNetwork"] is True and pod.spec["hostIPC"] is True, pod.name
        assert pod.spec["dnsPolicy"] == "ClusterFirstWithHostNet", pod.name
        container = pod.containers()[0]
        resources = container["resources"]
        rdma = [k for k in resources["limits"] if k.startswith("rdma/")]
        assert rdma and all(resources["requests"][k] == resources["limits"][k] for k in rdma)
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"], pod.name
        env = container_env(container, pod, {}, objects)
        assert "rc" in env["UCX_TLS"].split(","), pod.name
        assert env["PDXFER_TRANSPORT"] == "nixl", pod.name
        anti = pod.spec["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname", pod.name


def test_bench_is_an_indexed_job_over_two_nodes():
    objects = rendered("bench")
    assert not objects_of(objects, "Deployment") and not objects_of(objects, "StatefulSet")
    job = objects_of(objects, "Job")["pdxfer-bench"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    pod = pod_templates(objects)[0]
    anti = pod.spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    selector = anti[0]["labelSelector"]["matchLabels"]
    assert all(pod.labels.get(k) == v for k, v in selector.items())
    lines = list(command_lines(objects))
    assert {line.argv[1:3] for line in lines} == {("bench", "transfer")}
    assert len(lines) == 2


def test_every_server_reads_its_model_from_the_read_only_volume(objects):
    for line in command_lines(objects):
        if line.argv[:2] != ("pdxfer", "serve"):
            continue
        args = parse_pdxfer(line.argv)
        assert args.model.startswith(MODELS + "/"), f"{line.label}: --model {args.model}"
        mount, volume = mount_holding(line, args.model)
        assert mount["mountPath"] == MODELS and mount.get("readOnly") is True, line.label
        claim = volume["persistentVolumeClaim"]
        assert claim == {"claimName": MODELS_CLAIM, "readOnly": True}, line.label


def test_models_claim_is_read_only_many_and_the_same_everywhere(kustomization):
    objects = rendered(kustomization)
    claims = objects_of(objects, "PersistentVolumeClaim")
    serves = any(line.argv[:2] == ("pdxfer", "serve") for line in command_lines(objects))
    if not serves and MODELS_CLAIM not in claims:
        return  # bench, smoke: no model volume
    # Applying two overlays must never try to change the claim: its spec is immutable.
    assert (
        claims[MODELS_CLAIM] == objects_of(rendered("base"), "PersistentVolumeClaim")[MODELS_CLAIM]
    ), kustomization
    assert claims[MODELS_CLAIM]["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_model_fill_writes_the_checkpoint_the_workers_read():
    objects = rendered("model-fill")
    assert set(objects_of(objects, "PersistentVolumeClaim")) == {MODELS_CLAIM}
    assert not objects_of(objects, "Deployment") and not objects_of(objects, "StatefulSet")
    (line,) = command_lines(objects)
    assert is_shell(line)
    env = container_env(line.container, line.pod, {}, objects)
    served = objects_of(rendered("base"), "ConfigMap")["pdxfer-config"]["data"]["MODEL"]
    assert env["MODEL"] == served, "model-fill fills another directory than --model reads"
    assert "MODEL_SOURCE" in env and "huggingface" not in env["MODEL_SOURCE"]
    mount, volume = mount_holding(line, env["MODEL"])
    assert mount["mountPath"] == MODELS and not mount.get("readOnly")
    assert volume["persistentVolumeClaim"]["claimName"] == MODELS_CLAIM


def test_router_api_key_comes_from_its_own_secret(objects):
    for line in command_lines(objects):
        if line.argv[1:3] != ("serve", "router"):
            continue
        args = parse_pdxfer(line.argv)
        assert args.api_key_file, f"{line.label}: no --api-key-file"
        mount, volume = mount_holding(line, args.api_key_file)
        secret = volume["secret"]
        assert secret["secretName"] == API_KEY_SECRET != SECRET, line.label
        assert mount["readOnly"] is True, line.label
        relative = args.api_key_file[len(mount["mountPath"].rstrip("/")) + 1 :]
        assert relative in [item["path"] for item in secret["items"]], line.label


def test_no_secret_value_is_a_literal_in_any_manifest():
    """Secrets are referenced, never shipped: no Secret objects, no key in env values or
    flags (PDXFER_API_KEY and PDXFER_AUTH_TOKEN may only come from a secretKeyRef)."""
    for name in kustomizations():
        objects = rendered(name)
        assert not objects_of(objects, "Secret"), name
        for line in command_lines(objects):
            for arg in line.argv:
                assert not re.match(r"--(api-key|auth-token)(=|$)", arg), (line.label, arg)
            for var in line.container.get("env", []):
                if var["name"] in ("PDXFER_API_KEY", "PDXFER_AUTH_TOKEN"):
                    assert "secretKeyRef" in var.get("valueFrom", {}), (line.label, var)
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Kustomization":
                for generator in doc.get("secretGenerator", []):
                    assert not generator.get("literals"), f"{path}: a secret literal"


def test_no_deprecated_kustomize_fields():
    for path in K8S.rglob("kustomization.yaml"):
        fields = set(yaml.safe_load(path.read_text()))
        assert not fields & set(DEPRECATED), f"{path}: {sorted(fields & set(DEPRECATED))}"


def test_smoke_job_calls_the_routers_http_service():
    objects = rendered("smoke")
    job = objects_of(objects, "Job")["pdxfer-smoke"]["spec"]
    assert job["backoffLimit"] == 0 and job["activeDeadlineSeconds"] > 0
    (line,) = command_lines(objects)
    assert is_shell(line)
    env = container_env(line.container, line.pod, {}, objects)
    url = urlsplit(env["PDXFER_URL"])
    base = rendered("base")
    service = objects_of(base, "Service")[url.hostname]["spec"]
    (port,) = [p for p in service["ports"] if p["port"] == url.port]
    assert port["name"] == "http"
    (router,) = [
        (router, parse_pdxfer(router.argv))
        for router in command_lines(base)
        if router.argv[1:3] == ("serve", "router")
    ]
    ports = container_ports(router[0].container)
    assert ports[port["targetPort"]] == router[1].http_port
    key_mount, key_volume = mount_holding(line, env["PDXFER_API_KEY_FILE"])
    assert key_volume["secret"]["secretName"] == API_KEY_SECRET
    assert key_mount["readOnly"] is True
