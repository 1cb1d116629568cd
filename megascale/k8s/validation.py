"""What the API server would say about a MegaScaleJob, without an API server.

``validate(obj, old)`` applies the CRD schema's defaults (``apply_defaults``, as the server does on
create), checks the structural schema with ``jsonschema`` (``json_schema`` translates Kubernetes'
OpenAPI dialect: every object that does not preserve unknown fields rejects them, as the server's
strict field validation does, where it would otherwise prune them) and evaluates every CEL rule
(``x-kubernetes-validations``) with ``cel-python``, transition rules (``oldSelf``) only on updates
and only where the old object has a value. Messages are worded like the server's:
``spec.x: Invalid value: ...``, ``spec.x: Required value``, ``unknown field "spec.x"``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from megascale.k8s.crd import open_api_schema


def apply_defaults(obj: Mapping[str, Any], schema: Mapping[str, Any] | None = None) -> Any:
    """A copy of ``obj`` with the schema's defaults filled in, as the API server does on create:
    a missing property with a ``default`` gets it (and then its own nested defaults)."""
    schema = open_api_schema() if schema is None else schema
    out = copy.deepcopy(obj)
    _default_into(out, schema)
    return out


def _default_into(value: Any, schema: Mapping[str, Any]) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_into(value[name], sub)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_into(item, schema["items"])


def json_schema(schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``schema`` (OpenAPI v3 as Kubernetes uses it) as a JSON Schema for ``jsonschema``.

    ``x-kubernetes-*`` keys are dropped; an object with ``properties`` that does not preserve
    unknown fields gets ``additionalProperties: false``, which rejects what the API server's
    strict field validation rejects (and would otherwise prune); ``nullable`` allows null.
    """
    schema = open_api_schema() if schema is None else schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "description"):
            continue
        if key == "properties":
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [json_schema(sub) for sub in value]
        else:
            out[key] = copy.deepcopy(value)
    if (
        "properties" in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in schema
    ):
        out["additionalProperties"] = False
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def cel_rules(schema: Mapping[str, Any] | None = None, path: str = "") -> Iterator[tuple]:
    """Every CEL rule: ``(path, schema at path, rule dict)``; path like ``.spec.etcd``."""
    schema = open_api_schema() if schema is None else schema
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, schema, rule
    for name, sub in schema.get("properties", {}).items():
        yield from cel_rules(sub, f"{path}.{name}")


def schema_errors(obj: Mapping[str, Any]) -> list[str]:
    """What the structural schema rejects in ``obj`` (defaults applied first), one line each:
    ``spec.x.y: <what is wrong>``; unknown fields as ``unknown field "spec.x.foo"``."""
    import jsonschema

    validator = jsonschema.Draft7Validator(json_schema())
    errors = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in error.absolute_path)
        errors += _server_message(error, where)
    return list(dict.fromkeys(errors))  # one line per problem


def _cel_type(value: Any) -> str:
    """The OpenAPI type name of a JSON value, as the API server names it in messages."""
    if isinstance(value, bool):
        return "boolean"
    names = {dict: "object", list: "array", int: "integer", float: "number", str: "string"}
    return names.get(type(value), "null")


def _server_message(error: Any, where: str) -> list[str]:
    """A jsonschema error worded as the API server words it."""
    prefix = where + "." if where else ""
    kind, value = error.validator, error.instance
    if kind == "additionalProperties":
        extra = sorted(set(value) - set(error.schema.get("properties", {})))
        return [f'unknown field "{prefix}{name}"' for name in extra]
    if kind == "required":
        return [f"{prefix}{n}: Required value" for n in error.validator_value if n not in value]
    if kind == "enum":
        allowed = ", ".join(f'"{v}"' for v in error.validator_value)
        return [f'{where}: Unsupported value: "{value}": supported values: {allowed}']
    if kind == "type":
        return [
            f'{where}: Invalid value: "{_cel_type(value)}": {where} in body must be of type '
            f"{error.validator_value}: {value!r}"
        ]
    bounds = {
        "minimum": "should be greater than or equal to",
        "maximum": "should be less than or equal to",
        "minLength": "should be at least",
        "maxLength": "may not be more than",
        "maxItems": "must have at most",
        "pattern": "in body should match",
    }
    if kind in bounds:
        return [
            f"{where}: Invalid value: {value!r}: {where} {bounds[kind]} {error.validator_value!r}"
        ]
    return [f"{where or '<root>'}: Invalid value: {error.message}"]


def cel_errors(obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """What the CEL rules reject in ``obj`` (defaults applied first); transition rules
    (``oldSelf``) are evaluated only when ``old`` has a value at their path, as on the server."""
    import celpy

    env = celpy.Environment()
    errors = []
    for path, schema, rule in cel_rules():
        value, found = _at(obj, path)
        if not found:
            continue
        activation = {"self": _to_cel(value, schema)}
        if "oldSelf" in rule["rule"]:
            if old is None:
                continue
            old_value, old_found = _at(old, path)
            if not old_found:
                continue
            activation["oldSelf"] = _to_cel(old_value, schema)
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate(activation)
        if isinstance(result, celpy.CELEvalError):
            errors.append(f"{path.lstrip('.') or '<root>'}: Invalid value: {result}")
        elif not bool(result):
            where = (path + rule.get("fieldPath", "")).lstrip(".") or "<root>"
            errors.append(f'{where}: Invalid value: "{_cel_type(value)}": {rule["message"]}')
    return errors


def validate(obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Every error the API server would give for creating (or, with ``old``, updating to) ``obj``;
    [] when it is accepted. Defaults are applied first, as on the server."""
    obj = apply_defaults(obj)
    old = apply_defaults(old) if old is not None else None
    errors = schema_errors(obj)
    if errors:  # the server skips CEL when the schema fails (types may be wrong)
        return errors
    return cel_errors(obj, old)


def _at(obj: Any, path: str) -> tuple[Any, bool]:
    for name in filter(None, path.split(".")):
        if not isinstance(obj, Mapping) or name not in obj:
            return None, False
        obj = obj[name]
    return obj, True


def _to_cel(value: Any, schema: Mapping[str, Any]) -> Any:
    """``value`` as CEL sees it under ``schema``: numbers of ``type: number`` are doubles (CEL
    does not compare int with double), objects and lists typed member by member."""
    import celpy

    def typed(v: Any, s: Mapping[str, Any]) -> Any:
        if isinstance(v, dict):
            props = s.get("properties", {})
            return {k: typed(x, props.get(k, {})) for k, x in v.items()}
        if isinstance(v, list):
            return [typed(x, s.get("items", {})) for x in v]
        if s.get("type") == "number" and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        return v

    return celpy.json_to_cel(typed(value, schema))
