"""JobConfig: one small dataclass per subsystem, TOML presets, ``--set`` overrides.

Precedence, highest first: ``--set section.key=value`` overrides > the TOML file > the defaults (the
section dataclasses, ``megascale.config.sections``; all of them importable from ``megascale.config``).

``load`` reads and type-checks (every value against its field's annotation; unknown sections and keys
are refused with a "did you mean"); ``validate`` checks the cross-field rules that need the world
size and the backend, and fills in ``parallel.dp``. Every refusal is a ``ConfigError`` naming the
field, the value, and what would be accepted.

None and TOML: TOML has no null, so a None value is written by leaving the key out (``to_toml``
omits None fields) and set from the command line with ``--set section.key=none`` (or ``null``; only
for fields annotated ``X | None``). Every field whose default is None is Optional and every Optional
field defaults to None, so omitting a key always restores exactly the None it stood for.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w

from megascale.config.compat import (
    DEPRECATED_KEYS,
    mirror_deprecated,  # noqa: F401 (kept importable from here)
    move_deprecated,
)
from megascale.config.error import ConfigError
from megascale.config.sections import JobConfig

log = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
"""The TOML presets: ``megascale/config/presets/``, shipped inside the package (package data), so an
installed wheel has them too; any other file is loaded by its path."""

DEFAULT_PRESET = "tiny"
"""The preset ``load(None)`` reads: CPU, one process, finishes 50 steps in seconds."""


# --------------------------------------------------------------------------------------------------
# Loading: defaults < TOML file < --set overrides
# --------------------------------------------------------------------------------------------------

_SECTIONS: dict[str, type] = typing.get_type_hints(JobConfig)

_NONE_WORDS = ("none", "null")


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Build a JobConfig from the defaults, a TOML file, and ``section.key=value`` overrides.

    ``path`` is a TOML file, or the name of a preset in ``megascale/config/presets/`` (``"tiny"``, ``"h100-1b"``,
    with or without ``.toml``), or None for the default preset (``tiny``). An existing file wins
    over a preset of the same name.

    Each override is ``section.key=value``; the value is read as a TOML literal (``2``, ``1e-4``,
    ``true``, ``"lamb"``), a bare word is taken as a string (``optim.name=lamb``), and ``none`` or
    ``null`` sets an Optional field to None. Overrides apply in order, so the last one wins.

    Every value is type-checked; the cross-field rules that need the world size are in
    ``validate``. Raises ConfigError.
    """
    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides must be a list of 'section.key=value' strings, not the "
            f"single string {overrides!r}"
        )
    file = resolve_path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config = {str(file)!r}: not UTF-8 text (byte {e.start}); must be a UTF-8 TOML file"
        ) from e
    except OSError as e:
        raise ConfigError(f"config = {str(file)!r}: cannot be read ({e.strerror or e})") from e
    sources: dict[tuple[str, str], str] = {}
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for section, table in raw.items():
        _check_section(section, where=str(file))
        if not isinstance(table, dict):
            raise ConfigError(
                f"{file}: {section} = {table!r} must be a table: write [{section}] "
                f"followed by key = value lines"
            )
        for key, value in table.items():
            _check_key(section, key, where=str(file))
            values[section][key] = value
            sources[section, key] = str(file)
    for item in overrides:
        section, key, value = _parse_override(item)
        values[section][key] = value
        sources[section, key] = f"--set {item}"
    move_deprecated(values, sources)
    sections = {}
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        checked = {
            key: _check_type(f"{section}.{key}", value, hints[key], sources[section, key])
            for key, value in values[section].items()
        }
        sections[section] = cls(**checked)
    log.debug("loaded config from %s with %d override(s)", file, len(overrides))
    return JobConfig(**sections)


def presets() -> list[str]:
    """Names of the presets in ``megascale/config/presets/`` (what ``load`` accepts as a bare name)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def resolve_path(path: str | Path | None) -> Path:
    """The TOML file ``load(path)`` reads: the file itself, else the preset of that name."""
    if path is None:
        path = DEFAULT_PRESET
    file = Path(path)
    if file.is_file():
        return file
    name = file.name.removesuffix(".toml")
    preset = PRESETS_DIR / f"{name}.toml"
    if file.parent == Path(".") and preset.is_file():
        return preset
    known = presets()
    hint = _did_you_mean(name, known)
    raise ConfigError(
        f"config {str(path)!r}: no such file, and not a preset name{hint} "
        f"(presets in {PRESETS_DIR}: {', '.join(known) or 'none'})"
    )


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as ``{section: {key: value}}``, None values included."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: JobConfig) -> str:
    """The fully resolved config as TOML, which ``load`` reads back to an equal JobConfig.

    None fields are left out (TOML has no null); loading restores them as their default, None.
    """
    tables = {
        section: {
            k: v for k, v in table.items() if v is not None and (section, k) not in DEPRECATED_KEYS
        }
        for section, table in to_dict(cfg).items()
    }
    header = "# megascale resolved config; keys left out are None (TOML has no null).\n\n"
    return header + tomli_w.dumps(tables)


def hash_of(cfg: JobConfig) -> str:
    """The config's identity: the first 16 hex digits of the SHA-256 of its ``to_toml``. An
    agent registers with it and the controller refuses another (``agent.identity``)."""
    return hashlib.sha256(to_toml(cfg).encode()).hexdigest()[:16]


def validate(cfg: JobConfig, world_size: int, backend: str) -> JobConfig:
    """Check the rules that need the world size and backend; return a copy with parallel.dp set.

    The rules live in ``megascale/config/rules.py``; see ``config.rules.validate``.
    """
    from megascale.config.rules import validate as _validate  # torch, fsspec: loaded on use

    check_types(cfg)
    return _validate(cfg, world_size, backend)


# --------------------------------------------------------------------------------------------------
# Helpers: names, overrides, types
# --------------------------------------------------------------------------------------------------


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_SECTIONS[section])]


def _check_section(section: str, where: str) -> None:
    if section in _SECTIONS:
        return
    hint = _did_you_mean(section, list(_SECTIONS))
    if not hint:  # a key written at the top level instead of under its [section]
        owners = [f"{s}.{section}" for s in _SECTIONS if section in _field_names(s)]
        hint = f"; did you mean {' or '.join(repr(o) for o in owners)}?" if owners else ""
    raise ConfigError(
        f"{where}: unknown section {section!r}{hint} (sections: {', '.join(_SECTIONS)})"
    )


def _check_key(section: str, key: str, where: str) -> None:
    names = _field_names(section)
    if key in names:
        return
    close = difflib.get_close_matches(key, names, n=2, cutoff=0.6)
    suggestions = [f"{section}.{c}" for c in close]
    suggestions += [f"{s}.{key}" for s in _SECTIONS if s != section and key in _field_names(s)]
    hint = f"; did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    raise ConfigError(
        f"{where}: unknown key {section}.{key}{hint} (keys of [{section}]: {', '.join(names)})"
    )


def _parse_override(item: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> (section, key, value), the value read as a TOML literal."""
    where = f"--set {item}"
    dotted, sep, text = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"{where}: expected section.key=value, e.g. parallel.tp=2")
    _check_section(section, where)
    _check_key(section, key, where)
    text = text.strip()
    hint = typing.get_type_hints(_SECTIONS[section])[key]
    base, nullable = _optional(hint)
    if text.lower() in _NONE_WORDS and (nullable or base is not str):
        return section, key, None  # refused by the type check when the field is not Optional
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: optim.name=lamb, data.path=/data/tokens
    return section, key, value


def _optional(hint: Any) -> tuple[Any, bool]:
    """(base type, whether None is allowed) for ``X`` or ``X | None``."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config annotation {hint}")
        return args[0], True
    return hint, False


_EXPECTED = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list[str]: "a list of strings and numbers, or a table {name = number}",
    list[int]: "a list of integers",
}


def _check_type(name: str, value: Any, hint: Any, source: str = "") -> Any:
    """Return ``value`` (an int widened to float for a float field) or raise ConfigError."""
    base, nullable = _optional(hint)
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base is str:
        ok = isinstance(value, str)
    elif base == list[str]:
        strings = _string_list(value)
        ok = strings is not None
        value = strings if ok else value
    elif base == list[int]:
        ok = isinstance(value, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value
        )
    else:
        raise TypeError(f"unsupported config annotation {hint} on {name}")
    if ok or (value is None and nullable):
        return value
    expected = _EXPECTED[base] + (
        " or none (omit the key in a file; --set " + name + "=none)" if nullable else ""
    )
    what = "none" if value is None else f"{value!r} ({type(value).__name__})"
    origin = f", from {source}" if source else ""
    raise ConfigError(f"{name} = {what}{origin}: expected {expected}")


def _string_list(value: Any) -> list[str] | None:
    """A list of strings and numbers as strings; a table ``{name = number}`` as the flat list
    ``["number", "name", ...]`` (how ``data.blend`` is written either way); None otherwise."""
    if isinstance(value, dict):
        value = [x for name, number in value.items() for x in (number, name)]
    if not isinstance(value, list) or not all(
        isinstance(x, str | int | float) and not isinstance(x, bool) for x in value
    ):
        return None
    return [str(x) for x in value]


def check_types(cfg: JobConfig) -> None:
    """Type-check every field of an already built JobConfig (e.g. one made in Python code)."""
    for section, cls in _SECTIONS.items():
        table = getattr(cfg, section)
        if not isinstance(table, cls):
            raise ConfigError(f"{section} is a {type(table).__name__}; expected {cls.__name__}")
        for key, hint in typing.get_type_hints(cls).items():
            _check_type(f"{section}.{key}", getattr(table, key), hint)
