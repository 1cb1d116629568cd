"""A small renderer for the subset of Helm's Go templates the megascale-operator chart uses.

There is no ``helm`` binary on these machines, so the chart tests render it with this: text,
``{{ }}`` actions with ``{{-``/``-}}`` whitespace trimming, comments, ``define``/``include``,
``if``/``else if``/``else``, ``range`` (lists and maps), variables (``$x := ...``, ``$``),
pipelines, parenthesised sub-pipelines, field chains on ``.Values``/``.Release``/``.Chart`` and
``.Files.Glob "pattern"`` with ``.AsConfig``, and the functions in ``FUNCTIONS``. Anything else
raises ``TemplateError``: a template that strays outside the subset fails its test instead of
being rendered wrongly. Missing map keys render as "", as in Helm.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class TemplateError(ValueError):
    pass


# -- lexing -----------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.DOTALL)


def _lex(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(text):
        chunk = text[pos : m.start()]
        if trim_next:
            chunk = chunk.lstrip()
        if m.group(1):
            chunk = chunk.rstrip()
        out.append(("text", chunk))
        body = m.group(2).strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            out.append(("action", body))
        trim_next = bool(m.group(3))
        pos = m.end()
    chunk = text[pos:]
    out.append(("text", chunk.lstrip() if trim_next else chunk))
    return out


_TOKEN = re.compile(
    r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*")
    |(?P<num>-?\d+(?:\.\d+)?)
    |(?P<assign>:=)
    |(?P<pipe>\|)
    |(?P<lp>\()
    |(?P<rp>\))
    |(?P<field>(?:\$[A-Za-z_]\w*|\$)?(?:\.[A-Za-z_]\w*)+|\.|\$[A-Za-z_]\w*|\$)
    |(?P<ident>[A-Za-z_]\w*)
    )""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot parse {text[pos:]!r} in {{{{ {text} }}}}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


# -- parsing ----------------------------------------------------------------------------------


@dataclass
class Pipeline:
    commands: list[list[Any]]
    assign: str | None = None


@dataclass
class Node:
    kind: str  # text | action | if | range | define
    text: str = ""
    pipe: Pipeline | None = None
    branches: list[tuple[Pipeline | None, list[Node]]] = field(default_factory=list)
    body: list[Node] = field(default_factory=list)


def _parse_pipeline(text: str) -> Pipeline:
    tokens = _tokens(text)
    assign = None
    if len(tokens) >= 2 and tokens[1][0] == "assign":
        assign, tokens = tokens[0][1], tokens[2:]
    pipeline, rest = _pipeline(tokens)
    if rest:
        raise TemplateError(f"unexpected {rest} in {text!r}")
    pipeline.assign = assign
    return pipeline


def _pipeline(tokens: list[tuple[str, str]]) -> tuple[Pipeline, list]:
    commands: list[list[Any]] = [[]]
    while tokens:
        kind, value = tokens[0]
        if kind == "rp":
            break
        tokens = tokens[1:]
        if kind == "pipe":
            commands.append([])
        elif kind == "lp":
            sub, tokens = _pipeline(tokens)
            if not tokens or tokens[0][0] != "rp":
                raise TemplateError("missing ')'")
            tokens = tokens[1:]
            commands[-1].append(("pipe", sub))
        elif kind == "str":
            commands[-1].append(("lit", bytes(value[1:-1], "utf-8").decode("unicode_escape")))
        elif kind == "num":
            commands[-1].append(("lit", float(value) if "." in value else int(value)))
        elif kind == "ident" and value in ("true", "false", "nil"):
            commands[-1].append(("lit", {"true": True, "false": False, "nil": None}[value]))
        else:
            commands[-1].append((kind, value))
    if any(not c for c in commands):
        raise TemplateError("empty command in pipeline")
    return Pipeline(commands), tokens


def parse(text: str) -> tuple[list[Node], dict[str, list[Node]]]:
    """(top-level nodes, defines)."""
    defines: dict[str, list[Node]] = {}
    stack: list[tuple[Node | None, list[Node]]] = [(None, [])]
    for kind, value in _lex(text):
        body = stack[-1][1]
        if kind == "text":
            if value:
                body.append(Node("text", text=value))
            continue
        word = value.split(None, 1)[0] if value else ""
        rest = value[len(word) :].strip()
        if word == "if":
            node = Node("if", branches=[(_parse_pipeline(rest), [])])
            body.append(node)
            stack.append((node, node.branches[0][1]))
        elif word == "range":
            node = Node("range", pipe=_parse_pipeline(rest))
            body.append(node)
            stack.append((node, node.body))
        elif word == "define":
            node = Node("define", text=rest.strip('"'))
            stack.append((node, node.body))
        elif word == "else":
            node = stack[-1][0]
            if node is None or node.kind != "if":
                raise TemplateError("else outside if")
            cond = _parse_pipeline(rest[2:]) if rest.startswith("if ") else None
            node.branches.append((cond, []))
            stack[-1] = (node, node.branches[-1][1])
        elif word == "end":
            node, _ = stack.pop()
            if node is None:
                raise TemplateError("end without a block")
            if node.kind == "define":
                defines[node.text] = node.body
        elif word in ("with", "template", "block", "break", "continue"):
            raise TemplateError(f"{word!r} is outside the supported subset")
        else:
            body.append(Node("action", pipe=_parse_pipeline(value)))
    if len(stack) != 1:
        raise TemplateError("missing end")
    return stack[0][1], defines


# -- values -----------------------------------------------------------------------------------


class Files:
    """``.Files``: the chart's files (``Glob`` follows the ``dashboards`` link)."""

    def __init__(self, root: Path, paths: Mapping[str, str] | None = None) -> None:
        self.root = root
        if paths is None:  # like Helm: every file, links followed, templates/ excluded
            paths = {}
            for folder, _, names in os.walk(root, followlinks=True):
                for name in names:
                    path = Path(folder) / name
                    rel = path.relative_to(root)
                    if rel.parts[0] != "templates" and path.is_file():
                        paths[rel.as_posix()] = path.read_text()
        self.paths = dict(paths)

    def Glob(self, pattern: str) -> Files:  # noqa: N802  (Helm's name)
        chosen = {k: v for k, v in self.paths.items() if fnmatch.fnmatch(k, pattern)}
        return Files(self.root, chosen)

    @property
    def AsConfig(self) -> str:  # noqa: N802
        return _to_yaml({Path(k).name: v for k, v in self.paths.items()}) if self.paths else ""

    def __len__(self) -> int:
        return len(self.paths)


def _to_yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True).rstrip("\n")


def _str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Mapping | list):
        raise TemplateError(f"printing a {type(value).__name__} without toYaml: {value!r}")
    return str(value)


def truthy(value: Any) -> bool:
    if isinstance(value, Files):
        return len(value) > 0
    return bool(value)


def _indent(n: int, text: Any) -> str:
    return "\n".join(" " * n + line for line in _str(text).split("\n"))


def _printf(fmt: str, *args: Any) -> str:
    return re.sub(r"%[vsd]", "%s", fmt) % tuple(_str(a) for a in args)


def _and(*args: Any) -> Any:
    for a in args:
        if not truthy(a):
            return a
    return args[-1]


def _or(*args: Any) -> Any:
    for a in args:
        if truthy(a):
            return a
    return args[-1]


def _required(message: str, value: Any) -> Any:
    if value is None or value == "":
        raise TemplateError(message)
    return value


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "default": lambda default, value=None: value if truthy(value) else default,
    "trunc": lambda n, s: _str(s)[:n],
    "trimSuffix": lambda suffix, s: _str(s).removesuffix(suffix),
    "quote": lambda value: '"' + _str(value).replace("\\", "\\\\").replace('"', '\\"') + '"',
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "indent": _indent,
    "printf": _printf,
    "and": _and,
    "or": _or,
    "not": lambda value: not truthy(value),
    "eq": lambda a, b: a == b,
    "required": _required,
}


# -- rendering --------------------------------------------------------------------------------


class Renderer:
    def __init__(self, defines: dict[str, list[Node]]) -> None:
        self.defines = defines

    def render(self, nodes: list[Node], dot: Any, scope: dict[str, Any]) -> str:
        out = []
        for node in nodes:
            if node.kind == "text":
                out.append(node.text)
            elif node.kind == "action":
                value = self.pipeline(node.pipe, dot, scope)
                if node.pipe.assign is None:
                    out.append(_str(value))
            elif node.kind == "if":
                for cond, body in node.branches:
                    if cond is None or truthy(self.pipeline(cond, dot, scope)):
                        out.append(self.render(body, dot, dict(scope)))
                        break
            elif node.kind == "range":
                items = self.pipeline(node.pipe, dot, scope) or []
                values = [items[k] for k in sorted(items)] if isinstance(items, Mapping) else items
                out += [self.render(node.body, item, dict(scope)) for item in values]
        return "".join(out)

    def pipeline(self, pipe: Pipeline, dot: Any, scope: dict[str, Any]) -> Any:
        value, piped = None, False
        for command in pipe.commands:
            value = self.command(command, dot, scope, [value] if piped else [])
            piped = True
        if pipe.assign is not None:
            scope[pipe.assign] = value
        return value

    def command(self, command: list, dot: Any, scope: dict[str, Any], extra: list) -> Any:
        head, args = command[0], command[1:]
        if head[0] == "ident":
            if head[1] == "include":
                name, data = (self.term(a, dot, scope) for a in args + [])
                return self.render(self.defines[name], data, {"$": data})
            if head[1] not in FUNCTIONS:
                raise TemplateError(f"function {head[1]!r} is outside the supported subset")
            values = [self.term(a, dot, scope) for a in args] + extra
            return FUNCTIONS[head[1]](*values)
        value = self.term(head, dot, scope)
        if callable(value):
            return value(*[self.term(a, dot, scope) for a in args], *extra)
        if args or extra:
            raise TemplateError(f"{head[1]} is not a function but has arguments")
        return value

    def term(self, term: tuple, dot: Any, scope: dict[str, Any]) -> Any:
        kind, value = term
        if kind == "lit":
            return value
        if kind == "pipe":
            return self.pipeline(value, dot, scope)
        if kind == "field":
            base, _, path = value.partition(".") if value.startswith("$") else ("", "", value[1:])
            obj = dot if not base else scope[base] if base in scope else self._missing(base)
            for name in filter(None, path.split(".")):
                obj = self._get(obj, name)
            return obj
        raise TemplateError(f"unexpected {kind} {value!r}")

    @staticmethod
    def _missing(name: str) -> Any:
        raise TemplateError(f"undefined variable {name}")

    @staticmethod
    def _get(obj: Any, name: str) -> Any:
        if isinstance(obj, Mapping):
            return obj.get(name)
        if obj is None:
            return None
        if hasattr(obj, name):
            return getattr(obj, name)
        raise TemplateError(f"no field {name!r} on {type(obj).__name__}")


def render_chart(
    chart_dir: Path,
    values: Mapping[str, Any] | None = None,
    *,
    release: str = "megascale",
    namespace: str = "megascale-system",
    files: Files | None = None,
) -> dict[str, str]:
    """Every template of the chart rendered (NOTES.txt and partials left out): name -> text.
    ``values`` are merged over values.yaml (maps merged, anything else replaced)."""
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    merged = _merge(yaml.safe_load((chart_dir / "values.yaml").read_text()), values or {})
    top = {
        "Values": merged,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {
            "Name": chart["name"],
            "Version": chart["version"],
            "AppVersion": chart["appVersion"],
        },
        "Files": files if files is not None else Files(chart_dir),
    }
    templates = sorted((chart_dir / "templates").glob("*"))
    defines: dict[str, list[Node]] = {}
    parsed = {}
    for path in templates:
        nodes, found = parse(path.read_text())
        defines.update(found)
        parsed[path.name] = nodes
    renderer = Renderer(defines)
    return {
        name: renderer.render(nodes, top, {"$": top})
        for name, nodes in parsed.items()
        if name.endswith((".yaml", ".yml"))
    }


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base.get(k), v)
        return out
    return over
