"""The CRD: committed files equal the generator's output, the CRD itself passes
``kubernetes-validate --strict``, the examples pass its own schema (jsonschema + CEL), and bad
resources are rejected with the API server's kind of message."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_support import K8S_VERSION, example_jobs

from megascale.k8s import crd, validation


def test_committed_crd_files_equal_the_generator():
    for path, text in crd.generated_files().items():
        assert path.read_text() == text, f"{path} is stale: run python -m megascale.k8s.crd --write"


def test_crd_passes_kubernetes_validate_strict():
    assert kubernetes_validate.validate(crd.crd(), K8S_VERSION, strict=True) == K8S_VERSION


def test_crd_is_structural_and_served():
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]][:3] == [
        "Workers",
        "Phase",
        "State",
    ]

    def walk(schema: dict[str, Any], path: str) -> None:
        # structural: every node has a type (or is int-or-string / preserve-unknown-fields)
        assert (
            "type" in schema
            or schema.get("x-kubernetes-int-or-string")
            or schema.get("x-kubernetes-preserve-unknown-fields")
        ), path
        for name, sub in schema.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        if "items" in schema:
            walk(schema["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"], "")


def test_json_schema_translation_is_a_valid_draft7_schema():
    jsonschema.Draft7Validator.check_schema(validation.json_schema())


@pytest.mark.parametrize("rule", [r for _, _, r in validation.cel_rules()], ids=lambda r: r["rule"])
def test_every_cel_rule_compiles(rule):
    env = celpy.Environment()
    env.compile(rule["rule"])


@pytest.mark.parametrize("stem", sorted(example_jobs()))
def test_examples_validate_against_the_crd(stem):
    job = example_jobs()[stem]
    assert validation.validate(job) == []
    # and an update that changes nothing immutable is accepted
    assert validation.validate(job, old=job) == []


def test_defaults_are_applied_like_the_api_server():
    job = example_jobs()["minimal-cpu"]
    spec = validation.apply_defaults(job)["spec"]
    assert spec["faultTolerance"]["maxRestarts"] == 10  # within restartWindowSeconds
    assert spec["faultTolerance"]["restartWindowSeconds"] == 3600
    assert spec["faultTolerance"]["policy"] == "wait"
    assert "nodeWaitTimeoutSeconds" not in spec["faultTolerance"]  # no limit
    assert spec["faultTolerance"]["spareNodes"] == 0
    assert spec["faultTolerance"]["selfCheck"] == {
        "tests": [],
        "timeoutSeconds": 300,
        "requirePassedNode": False,
    }
    assert spec["faultTolerance"]["straggler"] == {"threshold": 1.1, "action": "report"}
    assert spec["runPolicy"] == {"suspend": False, "scheduling": {"gang": "none"}}
    assert spec["etcd"] == {"managed": True, "replicas": 1, "image": crd.DEFAULT_ETCD_IMAGE}
    assert spec["nprocPerNode"] == 1  # given, not defaulted
    assert "faultTolerance" not in job["spec"]  # the input is not modified


def _set(path: str, value: Any):
    def change(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for name in parents:
            obj = obj.setdefault(name, {})
        if value is _DELETE:
            obj.pop(last)
        else:
            obj[last] = value

    return change


_DELETE = object()
W = "spec.replicaSpecs.Worker"

BAD = {
    "replicas < 1": (
        _set(f"{W}.replicas", 0),
        "spec.replicaSpecs.Worker.replicas: Invalid value: 0: spec.replicaSpecs.Worker.replicas "
        "should be greater than or equal to 1",
    ),
    "replicas of the wrong type": (
        _set(f"{W}.replicas", "two"),
        'spec.replicaSpecs.Worker.replicas: Invalid value: "string": spec.replicaSpecs.Worker.replicas '
        "in body must be of type integer: 'two'",
    ),
    "suspend of the wrong type": (
        _set("spec.runPolicy.suspend", "yes"),
        "spec.runPolicy.suspend in body must be of type boolean",
    ),
    "template missing": (_set(f"{W}.template", _DELETE), f"{W}.template: Required value"),
    "unknown field in spec": (_set("spec.workers", 3), 'unknown field "spec.workers"'),
    "unknown nested field": (
        _set("spec.faultTolerance.spares", 1),
        'unknown field "spec.faultTolerance.spares"',
    ),
    "gang not in the enum": (
        _set("spec.runPolicy.scheduling.gang", "kueue"),
        'spec.runPolicy.scheduling.gang: Unsupported value: "kueue": supported values: "none", '
        '"volcano", "coscheduling"',
    ),
    "bad etcd endpoint": (
        lambda o: o["spec"].update(etcd={"managed": False, "endpoints": ["etcd without port"]}),
        "spec.etcd.endpoints.0: Invalid value: 'etcd without port'",
    ),
    "spares > replicas (CEL)": (
        _set("spec.faultTolerance.spareNodes", 3),
        'spec.faultTolerance.spareNodes: Invalid value: "object": faultTolerance.spareNodes must be '
        "<= replicaSpecs.Worker.replicas",
    ),
    "managed etcd with endpoints (CEL)": (
        _set("spec.etcd.endpoints", ["https://etcd:2379"]),
        "etcd: set managed: true, or managed: false with endpoints (exactly one)",
    ),
    "external etcd without endpoints (CEL)": (
        _set("spec.etcd.managed", False),
        "etcd: set managed: true, or managed: false with endpoints (exactly one)",
    ),
    "TLS secret on a managed etcd (CEL)": (
        _set("spec.etcd.tlsSecret", "etcd-tls"),
        "etcd.tlsSecret and etcd.authSecret are for external etcd (managed: false)",
    ),
    "both inline and configMapRef (CEL)": (
        _set("spec.config.configMapRef", {"name": "cfg"}),
        'spec.config: Invalid value: "object": config: give exactly one of inline or configMapRef',
    ),
    "neither inline nor configMapRef (CEL)": (
        _set("spec.config.inline", _DELETE),
        "config: give exactly one of inline or configMapRef",
    ),
    "queue without volcano (CEL)": (
        _set("spec.runPolicy.scheduling.queue", "research"),
        'spec.runPolicy.scheduling.queue: Invalid value: "object": scheduling.queue needs gang: '
        "volcano",
    ),
    "straggler threshold <= 1 (CEL, int as double)": (
        _set("spec.faultTolerance.straggler.threshold", 1),
        'spec.faultTolerance.straggler.threshold: Invalid value: "object": '
        "straggler.threshold must be > 1.0",
    ),
    "checkpoint interval without url (CEL)": (
        _set("spec.faultTolerance.checkpoint.intervalSteps", 100),
        "checkpoint.url is required when checkpoint.intervalSteps > 0",
    ),
    "name too long for worker hostnames (CEL)": (
        _set("metadata.name", "a" * 41),
        "metadata.name must be at most 40 characters",
    ),
    "name not a DNS-1035 label (CEL)": (
        _set("metadata.name", "7b-run"),
        "metadata.name must be a DNS-1035 label",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_resources_are_rejected_with_the_expected_message(case):
    change, expected = BAD[case]
    job = copy.deepcopy(example_jobs()["minimal-cpu"])
    change(job)
    errors = validation.validate(job)
    assert len(errors) == 1, errors
    assert expected in errors[0]


def test_every_cel_rule_is_exercised_by_a_bad_resource():
    """Each create-time rule in the CRD rejects at least one of the resources above (so a rule
    whose text is wrong, e.g. always true, fails this test)."""
    messages = " ".join(
        " ".join(validation.validate(_changed(change))) for change, _ in BAD.values()
    )
    for _, _, rule in validation.cel_rules():
        if "oldSelf" not in rule["rule"]:
            assert rule["message"] in messages, rule


def _changed(change):
    job = copy.deepcopy(example_jobs()["minimal-cpu"])
    change(job)
    return job


@pytest.mark.parametrize(
    "path, value, message",
    [
        (
            "spec.nprocPerNode",
            2,
            'spec.nprocPerNode: Invalid value: "integer": nprocPerNode is immutable',
        ),
        (
            "spec.etcd",
            {"managed": True, "replicas": 3},
            'spec.etcd: Invalid value: "object": etcd is immutable once the job exists',
        ),
    ],
)
def test_transition_rules_reject_updates_of_immutable_fields(path, value, message):
    old = example_jobs()["minimal-cpu"]
    new = copy.deepcopy(old)
    _set(path, value)(new)
    assert validation.validate(new) == []  # fine as a new object
    assert validation.validate(new, old=old) == [message]


def test_mutable_fields_may_change():
    old = example_jobs()["minimal-cpu"]
    new = copy.deepcopy(old)
    new["spec"]["replicaSpecs"]["Worker"]["replicas"] = 4
    new["spec"]["runPolicy"] = {"suspend": True}
    assert validation.validate(new, old=old) == []


def test_crd_yaml_round_trips():
    assert yaml.safe_load(crd.crd_yaml()) == crd.crd()


def test_fault_policy_and_restart_window_are_checked():
    job = copy.deepcopy(example_jobs()["minimal-cpu"])
    job["spec"].setdefault("faultTolerance", {}).update(policy="grow", restartWindowSeconds=0)
    errors = "\n".join(validation.validate(job))
    assert "faultTolerance.policy" in errors and "shrink" in errors
    assert "faultTolerance.restartWindowSeconds" in errors


# -- defaults against the CEL rules, as the API server checks them when the CRD is created --------


def _defaults_with_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict, Any]]:
    """Every ``(path, schema, default)`` in ``schema`` whose node has both a ``default`` and
    ``x-kubernetes-validations``, anywhere (properties, items, additionalProperties)."""
    found = []
    if "default" in schema and schema.get("x-kubernetes-validations"):
        found.append((path, schema, schema["default"]))
    for name, sub in schema.get("properties", {}).items():
        found += _defaults_with_rules(sub, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(schema.get(key), dict):
            found += _defaults_with_rules(schema[key], path + suffix)
    return found


def _rule_errors_on_raw_default(schema: dict[str, Any], default: Any) -> list[str]:
    """The server's check of a default: each rule (transition rules have no ``oldSelf`` on create
    and are skipped) evaluated on the ``default`` exactly as written, no nested defaulting."""
    env = celpy.Environment()
    errors = []
    for rule in schema["x-kubernetes-validations"]:
        if "oldSelf" in rule["rule"]:
            continue
        try:
            result = env.program(env.compile(rule["rule"])).evaluate(
                {"self": validation._to_cel(default, schema)}
            )
        except celpy.CELEvalError as error:  # cel-python raises some errors, returns others
            result = error
        if isinstance(result, celpy.CELEvalError) or not bool(result):
            errors.append(f"{rule['rule']}: {result}")
    return errors


def test_every_default_passes_its_cel_rules_unexpanded():
    checked = _defaults_with_rules(crd.open_api_schema())
    assert {p for p, _, _ in checked} >= {
        ".spec.etcd",
        ".spec.faultTolerance.straggler",
        ".spec.faultTolerance.checkpoint",
        ".spec.runPolicy.scheduling",
    }
    for path, schema, default in checked:
        assert _rule_errors_on_raw_default(schema, default) == [], path
        # and the default is itself a valid value of its schema
        jsonschema.Draft7Validator(validation.json_schema(schema)).validate(default)


def test_the_default_check_catches_an_empty_default():
    etcd = copy.deepcopy(crd.open_api_schema()["properties"]["spec"]["properties"]["etcd"])
    etcd["default"] = {}
    assert any("managed" in e for e in _rule_errors_on_raw_default(etcd, etcd["default"]))


def test_every_object_default_is_complete():
    """An object's default holds its properties' defaults, so the raw value the server checks
    is the value a job gets."""

    def walk(schema: dict[str, Any], path: str) -> None:
        default = schema.get("default")
        if isinstance(default, dict):
            assert validation.apply_defaults(default, schema) == default, path
        for name, sub in schema.get("properties", {}).items():
            walk(sub, f"{path}.{name}")

    walk(crd.open_api_schema(), "")
