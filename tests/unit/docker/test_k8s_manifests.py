"""The Kubernetes files under ``docker/k8s/`` hold only fields, types and values their schemas define.

- Core objects (the ServiceAccount, and every pod template inside the KubeRay resources, wrapped as a
  ``PodTemplate``) are validated strictly against the Kubernetes API's own JSON schemas (``kubernetes-validate``,
  Kubernetes ``K8S_VERSION``): an unknown or misspelt field is an error, as ``kubectl apply --validate=strict``.
- The KubeRay ``RayCluster`` / ``RayJob`` and the Airflow Helm chart's values are checked against a compact table
  of the fields and types their published schemas define (``KUBERAY_VERSION``: the CRDs
  ``ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs}.yaml``, version ``ray.io/v1``; the chart:
  ``chart/values.schema.json`` of the official chart, ``AIRFLOW_CHART_SCHEMA``). Only the fields these manifests
  use are listed; a field outside the table is refused, so a misspelling fails here instead of being dropped by the
  API server (CRDs prune unknown fields silently).

Notation of the tables: a type is ``"string" | "integer" | "number" | "boolean"``, ``("enum", values)``,
``("list", item)``, ``("map", value type)``, ``("or", *types)``, ``POD_TEMPLATE`` (a core ``PodTemplateSpec``), or a
dict ``{"fields": {name: type}, "required": (...)}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[3] / "docker" / "k8s"
K8S_VERSION = "1.33.0"
KUBERAY_VERSION = "1.7.0"
AIRFLOW_CHART_SCHEMA = "apache/airflow chart/values.schema.json (commit 8b69b1c)"
POD_TEMPLATE = "pod_template"
STR, INT, NUM, BOOL = "string", "integer", "number", "boolean"
INT_OR_NULL = ("or", INT, "null")
STR_OR_NULL = ("or", STR, "null")

# KubeRay ray.io/v1, from the CRDs' openAPIV3Schema (rayStartParams: additionalProperties string).
_HEAD_GROUP = {
    "fields": {"rayStartParams": ("map", STR), "serviceType": STR, "template": POD_TEMPLATE, "enableIngress": BOOL},
    "required": ("template",),
}
_WORKER_GROUP = {
    "fields": {
        "groupName": STR,
        "replicas": INT,
        "minReplicas": INT,
        "maxReplicas": INT,
        "idleTimeoutSeconds": INT,
        "numOfHosts": INT,
        "rayStartParams": ("map", STR),
        "template": POD_TEMPLATE,
        "suspend": BOOL,
    },
    "required": ("groupName", "maxReplicas", "minReplicas", "template"),
}
RAY_CLUSTER_SPEC = {
    "fields": {
        "rayVersion": STR,
        "enableInTreeAutoscaling": BOOL,
        "suspend": BOOL,
        "authOptions": {
            "fields": {"mode": ("enum", ("disabled", "token")), "secretName": STR, "enableK8sTokenAuth": BOOL}
        },
        "headGroupSpec": _HEAD_GROUP,
        "workerGroupSpecs": ("list", _WORKER_GROUP),
    },
    "required": ("headGroupSpec",),
}
RAY_JOB_SPEC = {
    "fields": {
        "entrypoint": STR,
        "submissionMode": STR,
        "shutdownAfterJobFinishes": BOOL,
        "ttlSecondsAfterFinished": INT,
        "activeDeadlineSeconds": INT,
        "backoffLimit": INT,
        "runtimeEnvYAML": STR,
        "entrypointNumCpus": NUM,
        "entrypointNumGpus": NUM,
        "suspend": BOOL,
        "rayClusterSpec": RAY_CLUSTER_SPEC,
        "clusterSelector": ("map", STR),
    }
}
# The official chart's values.schema.json (its root has additionalProperties: false).
_IMAGE = {
    "fields": {
        "repository": STR_OR_NULL,
        "tag": STR_OR_NULL,
        "pullPolicy": ("enum", ("Always", "Never", "IfNotPresent")),
    }
}
AIRFLOW_VALUES = {
    "fields": {
        "executor": (
            "enum",
            (
                "LocalExecutor",
                "LocalKubernetesExecutor",
                "CeleryExecutor",
                "KubernetesExecutor",
                "CeleryKubernetesExecutor",
            ),
        ),
        "defaultAirflowRepository": STR,
        "defaultAirflowTag": STR,
        "airflowVersion": STR,
        "images": {"fields": {"airflow": _IMAGE}},
        "data": {"fields": {"metadataSecretName": STR_OR_NULL, "resultBackendSecretName": STR_OR_NULL}},
        "fernetKeySecretName": STR_OR_NULL,
        "webserverSecretKeySecretName": STR_OR_NULL,
        "env": ("list", {"fields": {"name": STR, "value": STR}, "required": ("name", "value")}),
        "secret": (
            "list",
            {"fields": {"envName": STR, "secretName": STR, "secretKey": STR}, "required": ("envName", "secretName")},
        ),
        "extraEnv": STR_OR_NULL,
        "extraEnvFrom": STR_OR_NULL,
        "workers": {
            "fields": {
                "replicas": INT,
                "persistence": {"fields": {"enabled": BOOL, "size": STR}},
                "resources": ("map", ("map", STR)),
                "terminationGracePeriodSeconds": INT,
            }
        },
    }
}
_PY_TYPES: dict[str, tuple[type, ...]] = {
    STR: (str,),
    INT: (int,),
    NUM: (int, float),
    BOOL: (bool,),
    "null": (type(None),),
}


def _pod_template_problems(template: Any, where: str) -> list[str]:
    """Strict validation of a PodTemplateSpec by the Kubernetes API schema (wrapped in a core PodTemplate)."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    try:
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{where}: {err.message} (at {'.'.join(str(p) for p in err.path)})"]
    return []


def problems(value: Any, kind: Any, where: str) -> list[str]:
    """Every way ``value`` breaks the type ``kind`` of the tables above, each naming its dotted path."""
    if kind == POD_TEMPLATE:
        return _pod_template_problems(value, where)
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        found = [f"{where}.{k}: not a field of the schema" for k in value if k not in kind["fields"]]
        found += [f"{where}.{k}: required" for k in kind.get("required", ()) if k not in value]
        for key, sub in value.items():
            if key in kind["fields"]:
                found += problems(sub, kind["fields"][key], f"{where}.{key}")
        return found
    if isinstance(kind, tuple):
        tag, *args = kind
        if tag == "enum":
            return [] if value in args[0] else [f"{where}: {value!r} is not one of {list(args[0])}"]
        if tag == "or":
            return (
                []
                if any(not problems(value, arm, where) for arm in args)
                else [f"{where}: {value!r} is none of {args}"]
            )
        if tag == "list":
            if not isinstance(value, list):
                return [f"{where}: expected a list"]
            return [p for i, item in enumerate(value) for p in problems(item, args[0], f"{where}[{i}]")]
        if tag == "map":
            if not isinstance(value, dict):
                return [f"{where}: expected a mapping"]
            return [p for k, v in value.items() for p in problems(v, args[0], f"{where}.{k}")]
    ok = isinstance(value, _PY_TYPES[kind]) and not (kind in (INT, NUM) and isinstance(value, bool))
    return [] if ok else [f"{where}: expected {kind}, got {type(value).__name__} {value!r}"]


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((K8S / name).read_text())
    return data


def _custom_resource_problems(doc: dict[str, Any], kind: str, spec: dict[str, Any]) -> list[str]:
    found = [] if doc.get("apiVersion") == "ray.io/v1" else [f"apiVersion: {doc.get('apiVersion')!r}, want ray.io/v1"]
    found += [] if doc.get("kind") == kind else [f"kind: {doc.get('kind')!r}, want {kind}"]
    found += problems(
        doc.get("metadata"), {"fields": {"name": STR, "namespace": STR, "labels": ("map", STR)}}, "metadata"
    )
    return found + problems(doc.get("spec"), spec, "spec")


def test_core_objects_validate_strictly_against_the_kubernetes_api_schema() -> None:
    kubernetes_validate.validate(_load("serviceaccount.yaml"), K8S_VERSION, strict=True)


def test_raycluster_matches_the_kuberay_crd_and_its_pods_the_core_schema() -> None:
    assert _custom_resource_problems(_load("raycluster.yaml"), "RayCluster", RAY_CLUSTER_SPEC) == []


def test_rayjob_matches_the_kuberay_crd_and_its_pods_the_core_schema() -> None:
    assert _custom_resource_problems(_load("rayjob.yaml"), "RayJob", RAY_JOB_SPEC) == []


def test_airflow_chart_values_match_the_chart_schema() -> None:
    assert problems(_load("airflow-values.yaml"), AIRFLOW_VALUES, "values") == []


def test_every_ray_pod_uses_the_cluster_identity_and_the_token_secret() -> None:
    """The Ray pods reach S3 with the service account's identity; the token comes from the KubeRay auth Secret."""
    spec = _load("raycluster.yaml")["spec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    assert {t["spec"]["serviceAccountName"] for t in templates} == {_load("serviceaccount.yaml")["metadata"]["name"]}
    assert spec["authOptions"] == {"mode": "token", "secretName": "rlhf-ray-auth"}
    env = [e for t in templates for c in t["spec"]["containers"] for e in c.get("env", [])]
    assert not [e["name"] for e in env if "SECRET" in e["name"] or "PASSWORD" in e["name"] or "TOKEN" in e["name"]]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["spec"].update(workerGroupSpec=[]), "spec.workerGroupSpec: not a field of the schema"),
        (
            lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="2"),
            "spec.workerGroupSpecs[0].replicas: expected integer",
        ),
        (lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "spec.workerGroupSpecs[0].groupName: required"),
        (
            lambda d: d["spec"]["authOptions"].update(mode="password"),
            "spec.authOptions.mode: 'password' is not one of",
        ),
        (
            lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 4}),
            "rayStartParams.num-cpus: expected string",
        ),
        (
            lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
                imagePullPolicy2="Always"
            ),
            "spec.headGroupSpec.template: ",
        ),
    ],
)
def test_the_checks_refuse_a_broken_raycluster(mutate: Any, expected: str) -> None:
    doc = _load("raycluster.yaml")
    mutate(doc)
    found = _custom_resource_problems(doc, "RayCluster", RAY_CLUSTER_SPEC)
    assert any(expected in p for p in found), found


def test_the_checks_refuse_broken_values_and_core_objects() -> None:
    values = _load("airflow-values.yaml")
    values["executor"] = "SequentialExecutors"
    values["workers"]["replica"] = 2
    found = problems(values, AIRFLOW_VALUES, "values")
    assert any("values.executor: 'SequentialExecutors' is not one of" in p for p in found), found
    assert "values.workers.replica: not a field of the schema" in found
    account = _load("serviceaccount.yaml")
    account["automountToken"] = False  # the real field is automountServiceAccountToken
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(account, K8S_VERSION, strict=True)
