"""Render deploy/k8s with `kubectl kustomize` and look inside: pod templates, their
command lines expanded as the kubelet would, and their ports."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from transfer.cli import build_parser
from transfer.geometry import ModelGeometry
from transfer.presets import load_geometry

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"

# Stand-ins for values only a running pod has. 192.0.2.0/24 is TEST-NET-1 (RFC 5737):
# nothing here ever connects to it, the parser only sees the text.
POD_IP = "192.0.2.10"
NAMESPACE = "default"

# Where the manifests mount the checkpoint volume, and the presets whose geometry equals
# the checkpoints the ConfigMaps name there (the tests have no /models to read).
MODELS = "/models"
CHECKPOINTS = {
    "Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b",
    "Qwen3-Next-80B-A3B-Thinking": "qwen3-next-80b-a3b",
    "Kimi-Linear-48B-A3B-Instruct": "kimi-linear-48b-a3b",
    "NVIDIA-Nemotron-Nano-12B-v2": "nemotron-nano-12b-v2",
}
SHELL = ("sh", "-c")
# How the vLLM pods start vLLM: the OpenAI server (single node, or a group's leader) and
# `vllm serve --headless` (a multi-node group's other pods).
VLLM_SERVER = ("python3", "-m", "vllm.entrypoints.openai.api_server")
VLLM_SERVE = ("vllm", "serve")

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def kustomizations() -> dict[str, Path]:
    """The base and every overlay, by name."""
    found = {"base": K8S / "base"}
    for path in sorted((K8S / "overlays").iterdir()):
        if (path / "kustomization.yaml").is_file():
            found[path.name] = path
    return found


def kubectl() -> str | None:
    """$PDXFER_KUBECTL (e.g. another kubectl release to check), else kubectl on PATH."""
    return os.environ.get("PDXFER_KUBECTL") or shutil.which("kubectl")


@functools.cache
def render(name: str) -> tuple[Any, ...]:
    """Every YAML document `kubectl kustomize` prints for kustomization `name`."""
    binary = kubectl()
    if binary is None:
        raise FileNotFoundError("kubectl: not found (deploy/tools/ensure-kubectl.sh installs it)")
    proc = subprocess.run(
        [binary, "kustomize", str(kustomizations()[name])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {name}: exit {proc.returncode}\n{proc.stderr}")
    return tuple(yaml.safe_load_all(proc.stdout))


def rendered(name: str) -> tuple[Any, ...]:
    """`render(name)`, or skip the test when kubectl is missing."""
    if kubectl() is None:
        pytest.skip("kubectl not found: run deploy/tools/ensure-kubectl.sh (`make test` does)")
    return render(name)


def where(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@dataclass(frozen=True)
class PodTemplate:
    """One pod template of a workload. `variants` holds, for each distinct pod it
    stamps out, the env its controller adds (e.g. JOB_COMPLETION_INDEX)."""

    owner: dict
    name: str
    template: dict
    variants: tuple[dict[str, str], ...]

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.template.get("metadata", {}).get("labels", {})

    @property
    def annotations(self) -> dict[str, str]:
        return self.template.get("metadata", {}).get("annotations", {})

    def containers(self) -> list[dict]:
        return self.spec.get("containers", []) + self.spec.get("initContainers", [])


def pod_templates(objects: tuple[Any, ...]) -> list[PodTemplate]:
    found = []
    for obj in objects:
        kind, spec = obj["kind"], obj.get("spec", {})
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
            found.append(PodTemplate(obj, where(obj), spec["template"], ({},)))
        elif kind == "Job":
            variants: tuple[dict[str, str], ...] = ({},)
            if spec.get("completionMode") == "Indexed":
                count = spec.get("completions", 1)
                variants = tuple({"JOB_COMPLETION_INDEX": str(i)} for i in range(count))
            found.append(PodTemplate(obj, where(obj), spec["template"], variants))
        elif kind == "LeaderWorkerSet":
            group = spec["leaderWorkerTemplate"]
            size = group.get("size", 1)
            set_name = obj["metadata"]["name"]
            common = {
                "LWS_LEADER_ADDRESS": f"{set_name}-0.{set_name}.{NAMESPACE}",
                "LWS_GROUP_SIZE": str(size),
                "LWS_GROUP_INDEX": "0",
            }
            workers = tuple({**common, "LWS_WORKER_INDEX": str(i)} for i in range(1, size))
            leader = group.get("leaderTemplate", group["workerTemplate"])
            found.append(
                PodTemplate(
                    obj, f"{where(obj)} leader", leader, ({**common, "LWS_WORKER_INDEX": "0"},)
                )
            )
            if workers:
                found.append(
                    PodTemplate(obj, f"{where(obj)} worker", group["workerTemplate"], workers)
                )
    return found


def objects_of(objects: tuple[Any, ...], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def expand(text: str, env: dict[str, str], missing: list[str]) -> str:
    """Kubernetes' $(VAR) expansion: `$$` is a literal `$`; an undefined reference
    stays as written (and is appended to `missing`)."""

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        if name in env:
            return env[name]
        missing.append(name)
        return match.group(0)

    return _REFERENCE.sub(substitute, text)


def _field_value(path: str, pod: PodTemplate, variant: dict[str, str]) -> str:
    samples = {
        "metadata.name": f"{pod.owner['metadata']['name']}-0",
        "metadata.namespace": NAMESPACE,
        "status.podIP": POD_IP,
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": variant.get(
            "JOB_COMPLETION_INDEX", ""
        ),
        "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']": variant.get(
            "LWS_WORKER_INDEX", ""
        ),
    }
    if path not in samples or samples[path] == "":
        raise ValueError(f"{pod.name}: fieldRef {path!r} has no sample value in the tests")
    return samples[path]


def container_env(
    container: dict, pod: PodTemplate, variant: dict[str, str], objects: tuple[Any, ...]
) -> dict[str, str]:
    """The environment the kubelet gives `container`: envFrom, then env, then what the
    controller adds for names the manifest does not declare."""
    configmaps = objects_of(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref is None:
            raise ValueError(f"{pod.name}: only configMapRef envFrom sources are understood")
        if ref["name"] not in configmaps:
            raise ValueError(f"{pod.name}: envFrom ConfigMap {ref['name']!r} is not rendered")
        prefix = source.get("prefix", "")
        env.update({prefix + k: str(v) for k, v in configmaps[ref["name"]]["data"].items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env, [])
            continue
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            env[var["name"]] = _field_value(source["fieldRef"]["fieldPath"], pod, variant)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = str(configmaps[ref["name"]]["data"][ref["key"]])
        elif "secretKeyRef" in source:
            env[var["name"]] = f"<secret {source['secretKeyRef']['name']}>"
        else:
            raise ValueError(f"{pod.name}: env {var['name']!r} has an unknown source")
    declared = {var["name"] for var in container.get("env", [])}
    env.update({k: v for k, v in variant.items() if k not in declared})
    return env


@dataclass(frozen=True)
class CommandLine:
    pod: PodTemplate
    container: dict
    variant: dict[str, str]
    argv: tuple[str, ...]
    missing: tuple[str, ...]

    @property
    def label(self) -> str:
        index = ",".join(f"{k}={v}" for k, v in self.variant.items() if "INDEX" in k)
        return f"{self.pod.name} container {self.container['name']}" + (
            f" [{index}]" if index else ""
        )


def command_lines(objects: tuple[Any, ...]) -> Iterator[CommandLine]:
    """Every container of every pod variant, with command + args expanded."""
    for pod in pod_templates(objects):
        for container in pod.containers():
            for variant in pod.variants:
                env = container_env(container, pod, variant, objects)
                missing: list[str] = []
                argv = [
                    expand(str(a), env, missing)
                    for a in container.get("command", []) + container.get("args", [])
                ]
                yield CommandLine(pod, container, variant, tuple(argv), tuple(missing))


@functools.cache
def _cli() -> argparse.ArgumentParser:
    return build_parser()


def parse_pdxfer(argv: tuple[str, ...]) -> argparse.Namespace:
    """Parse `pdxfer ...` with the real CLI parser; ValueError carries argparse's message."""
    if not argv or argv[0] != "pdxfer":
        raise ValueError(f"not a pdxfer command line: {list(argv)}")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return _cli().parse_args(list(argv[1:]))
    except SystemExit as exc:
        raise ValueError(f"{list(argv)} does not parse:\n{stderr.getvalue()}") from exc


def container_ports(container: dict) -> dict[str | int, int]:
    """Declared ports, by number and by name -> number."""
    ports: dict[str | int, int] = {}
    for port in container.get("ports", []):
        ports[port["containerPort"]] = port["containerPort"]
        if "name" in port:
            ports[port["name"]] = port["containerPort"]
    return ports


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def geometry_of(model: str) -> ModelGeometry:
    """The geometry of a --model value: a checkpoint under /models (by its directory's
    name, see CHECKPOINTS) or a preset."""
    if model.startswith(MODELS + "/"):
        name = model[len(MODELS) + 1 :].rstrip("/")
        if name not in CHECKPOINTS:
            raise KeyError(f"{model}: add its preset to CHECKPOINTS in {Path(__file__).name}")
        return load_geometry(CHECKPOINTS[name])
    return load_geometry(model)


def is_shell(line: CommandLine) -> bool:
    """A `sh -c SCRIPT` container (the smoke and model-fill Jobs)."""
    return line.argv[:2] == SHELL and len(line.argv) == 3


def is_vllm(line: CommandLine) -> bool:
    """A vLLM server: the OpenAI server or `vllm serve` (overlays/vllm)."""
    return line.argv[: len(VLLM_SERVER)] == VLLM_SERVER or line.argv[:2] == VLLM_SERVE


def flag_value(argv: tuple[str, ...], flag: str) -> str | None:
    """The last value of `flag` in argv, as `--flag=V` or `--flag V`."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def mount_holding(line, path: str) -> tuple[dict, dict]:
    """(volumeMount, volume) of the single mount holding `path` in `line`'s container."""
    mounts = [
        m
        for m in line.container.get("volumeMounts", [])
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert len(mounts) == 1, f"{line.label}: {path} is in {len(mounts)} volume mounts"
    volumes = {v["name"]: v for v in line.pod.spec.get("volumes", [])}
    return mounts[0], volumes[mounts[0]["name"]]
