"""Helpers of the Kubernetes tests: the example resources and a recording fake of the Kubernetes
API. (A module of its own: ``conftest`` is not a unique module name across test directories.)"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from megascale.k8s import crd

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "k8s" / "examples"
CHART = REPO / "k8s" / "helm" / "megascale-operator"
K8S_VERSION = "1.32"
"""The Kubernetes version every manifest is validated against (kubernetes-validate ships it)."""


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def example_jobs() -> dict[str, dict[str, Any]]:
    """Every MegaScaleJob in k8s/examples, by file stem, with a uid as the API server gives."""
    jobs = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in load_docs(path):
            if doc["kind"] == crd.KIND:
                doc["metadata"].setdefault("uid", f"uid-{path.stem}")
                jobs[path.stem] = doc
    return jobs


def example_config(stem: str) -> str:
    """The training TOML of an example job (inline, or its ConfigMap in the same file)."""
    docs = load_docs(EXAMPLES / f"{stem}.yaml")
    job = next(d for d in docs if d["kind"] == crd.KIND)
    spec = job["spec"]["config"]
    if "inline" in spec:
        return spec["inline"]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    return cm["data"][spec["configMapRef"].get("key", "config.toml")]


class FakeKube:
    """A recording ``KubeAPI``: an in-memory object store keyed by (apiVersion, kind, namespace,
    name), and ``calls``, every call in order. Pods get no nodeName until a test "schedules" them."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}
        self.calls: list[tuple] = []
        self._uids = itertools.count(1)

    @staticmethod
    def key(obj: Mapping[str, Any]) -> tuple[str, str, str | None, str]:
        meta = obj["metadata"]
        return obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]

    def apply(self, obj: Mapping[str, Any]) -> None:
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        self.objects[self.key(obj)] = copy.deepcopy(dict(obj))

    def create(self, obj: Mapping[str, Any]) -> bool:
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        if self.key(obj) in self.objects:
            return False
        stored = copy.deepcopy(dict(obj))
        stored["metadata"]["uid"] = f"uid-{next(self._uids)}"
        stored.setdefault("status", {"phase": "Pending"})
        self.objects[self.key(obj)] = stored
        return True

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> bool:
        self.calls.append(("delete", kind, name))
        return self.objects.pop((api_version, kind, namespace, name), None) is not None

    def get(self, api_version: str, kind: str, name: str, namespace: str | None):
        self.calls.append(("get", kind, name))
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]):
        self.calls.append(("list", kind, dict(labels)))
        return [
            copy.deepcopy(o)
            for (v, k, ns, _), o in sorted(self.objects.items())
            if (v, k, ns) == (api_version, kind, namespace)
            and all(o["metadata"].get("labels", {}).get(a) == b for a, b in labels.items())
        ]

    def patch(self, api_version, kind, name, patch, namespace) -> None:
        self.calls.append(("patch", kind, name, copy.deepcopy(dict(patch))))
        obj = self.objects.setdefault(
            (api_version, kind, namespace, name),
            {"apiVersion": api_version, "kind": kind, "metadata": {"name": name}},
        )
        _merge_patch(obj, patch)

    # -- test helpers --------------------------------------------------------------------------

    def mutations(self) -> list[tuple]:
        """The calls that change something (not get/list)."""
        return [c for c in self.calls if c[0] not in ("get", "list")]

    def pods(self, namespace: str) -> dict[str, dict[str, Any]]:
        return {
            name: o
            for (v, k, ns, name), o in self.objects.items()
            if k == "Pod" and ns == namespace
        }

    def schedule(self, namespace: str, name: str, node: str, phase: str = "Running") -> None:
        pod = self.objects[("v1", "Pod", namespace, name)]
        pod["spec"]["nodeName"] = node
        pod["status"] = {"phase": phase}


def _merge_patch(target: dict, patch: Mapping) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
