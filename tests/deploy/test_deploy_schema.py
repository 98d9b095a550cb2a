"""Rendered objects validate strictly (no unknown fields) against the Kubernetes JSON
schemas shipped by kubernetes-validate: of the oldest Kubernetes the manifests support
and of the newest it ships. A LeaderWorkerSet validates against an excerpt of its
published CRD schema, and its pod templates against core PodTemplateSpec."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_manifests import objects_of, rendered, where
from kubernetes_validate.utils import latest_version

# grpc probes are GA from 1.27 and LeaderWorkerSet needs 1.26; the README says 1.29.
OLDEST_SUPPORTED = "1.29"
VERSIONS = (OLDEST_SUPPORTED, latest_version())
LWS_SCHEMA = Path(__file__).parent / "schemas" / "leaderworkerset-v1.yaml"


def _closed(schema: Any) -> Any:
    """A copy with every object that lists `properties` closed to other keys, as the API
    server's strict field validation treats them; the test-only x-pdxfer-* marks dropped."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _closed(v) for k, v in schema.items() if not k.startswith("x-pdxfer-")}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


@functools.cache
def _lws_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_closed(yaml.safe_load(LWS_SCHEMA.read_text())))


def _validate_leader_worker_set(obj: dict, version: str) -> None:
    _lws_validator().validate(obj)
    group = obj["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        if key in group:
            # Wrapped as a core PodTemplate: its `template` is a PodTemplateSpec, and the
            # set's metadata is checked as ObjectMeta on the way.
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": obj["metadata"],
                "template": group[key],
            }
            kubernetes_validate.validate(wrapped, version, strict=True)


CUSTOM_RESOURCES = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): _validate_leader_worker_set}


def validate(obj: dict, version: str) -> None:
    """Raise jsonschema.ValidationError (or SchemaNotFoundError for a kind nobody knows)."""
    custom = CUSTOM_RESOURCES.get((obj["apiVersion"], obj["kind"]))
    if custom is not None:
        custom(obj, version)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


def _explain(exc: jsonschema.ValidationError) -> str:
    return f"{'.'.join(str(p) for p in exc.absolute_path)}: {exc.message}"


@pytest.mark.parametrize("version", VERSIONS)
def test_objects_validate_strictly(objects, version):
    errors = []
    for obj in objects:
        try:
            validate(obj, version)
        except jsonschema.ValidationError as exc:
            errors.append(f"{where(obj)} against {version}: {_explain(exc)}")
    assert not errors, "\n".join(errors)


def _first(kustomization: str, kind: str) -> dict:
    return copy.deepcopy(next(iter(objects_of(rendered(kustomization), kind).values())))


def test_strict_validation_rejects_unknown_and_mistyped_fields():
    pool = _first("base", "StatefulSet")
    validate(pool, latest_version())
    typo = copy.deepcopy(pool)
    container = typo["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        validate(typo, latest_version())
    wrong_type = copy.deepcopy(pool)
    wrong_type["spec"]["replicas"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        validate(wrong_type, latest_version())


def test_leader_worker_set_schema_rejects_unknown_and_mistyped_fields():
    lws = _first("multi-node", "LeaderWorkerSet")
    validate(lws, latest_version())
    cases = []
    unknown = copy.deepcopy(lws)
    unknown["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    cases.append(unknown)
    mistyped = copy.deepcopy(lws)
    mistyped["spec"]["leaderWorkerTemplate"]["size"] = "2"
    cases.append(mistyped)
    bad_enum = copy.deepcopy(lws)
    bad_enum["spec"]["startupPolicy"] = "WhenReady"
    cases.append(bad_enum)
    pod_typo = copy.deepcopy(lws)
    worker = pod_typo["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    worker["containers"][0]["comand"] = worker["containers"][0].pop("command")
    cases.append(pod_typo)
    template_metadata = copy.deepcopy(lws)
    template_metadata["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["uid"] = "x"
    cases.append(template_metadata)
    for case in cases:
        with pytest.raises(jsonschema.ValidationError):
            validate(case, latest_version())
