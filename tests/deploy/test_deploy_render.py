"""Every kustomization renders, and each one holds what it is for."""

from __future__ import annotations

from k8s_manifests import (
    command_lines,
    container_env,
    objects_of,
    pod_templates,
    rendered,
    where,
)

from transfer.presets import load_geometry

SECRET = "pdxfer-auth"


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
            repository = container["image"].rsplit(":", 1)[0]
            assert repository.rsplit("/", 1)[-1] == "pdxfer", (pod.name, container["image"])
            assert container.get("command") == ["pdxfer"], pod.name
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, pod.name
            assert "ALL" in container["securityContext"]["capabilities"]["drop"], pod.name


def test_base_router_pools_config():
    objects = rendered("base")
    services = objects_of(objects, "Service")
    assert "pdxfer-router" in objects_of(objects, "Deployment")
    assert services["pdxfer-router"]["spec"].get("clusterIP") != "None"
    for role in ("prefill", "decode"):
        pool = objects_of(objects, "StatefulSet")[f"pdxfer-{role}"]
        assert services[pool["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    config = objects_of(objects, "ConfigMap")["pdxfer-config"]["data"]
    load_geometry(model=config["PDXFER_MODEL"])  # raises on an unknown preset


def test_serving_pods_mount_the_auth_secret(objects):
    for line in command_lines(objects):
        if line.argv[1:2] != ("serve",):
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
