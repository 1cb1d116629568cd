"""Old config keys that are still read: where each lives now, and how it is carried over.

``DEPRECATED_KEYS`` maps an old ``(section, key)`` to its home; ``move_deprecated`` reads an old
key of a TOML file or ``--set`` as its new key (with a one-line warning), and
``mirror_deprecated`` keeps the old attribute equal to the new key for code that reads it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger("megascale.config")

DEPRECATED_KEYS: dict[tuple[str, str], tuple[str, str]] = {
    ("diagnostics", "straggler_threshold"): ("fault_tolerance", "straggler_threshold"),
    ("diagnostics", "straggler_action"): ("fault_tolerance", "straggler_action"),
}
"""Old key -> its home now. ``load`` still reads an old key (a one-line warning), as its new
key unless that is given too; the old attribute mirrors the new one."""


def mirror_deprecated(cfg: Any) -> None:
    """Make every deprecated attribute equal its new key: an old key set alone (not None, new
    key at its default) moves to the new key; otherwise the new key wins. Sections are replaced,
    never modified, as they may be shared with another JobConfig."""
    for (old_section, key), (new_section, new_key) in DEPRECATED_KEYS.items():
        old, new = getattr(cfg, old_section), getattr(cfg, new_section)
        value = getattr(old, key)
        default = getattr(type(new)(), new_key)
        if value is not None and getattr(new, new_key) == default and value != default:
            setattr(cfg, new_section, dataclasses.replace(new, **{new_key: value}))
        elif value != getattr(new, new_key):
            value = getattr(getattr(cfg, new_section), new_key)
            setattr(cfg, old_section, dataclasses.replace(old, **{key: value}))


def move_deprecated(values: dict[str, dict[str, Any]], sources: dict[tuple[str, str], str]) -> None:
    """Read each deprecated key given as its new key (unless that is given too), with a warning."""
    for (section, key), (new_section, new_key) in DEPRECATED_KEYS.items():
        if key not in values[section]:
            continue
        value, where = values[section].pop(key), sources.pop((section, key))
        log.warning("%s: %s.%s is deprecated, use %s.%s", where, section, key, new_section, new_key)
        if new_key not in values[new_section]:
            values[new_section][new_key] = value
            sources[new_section, new_key] = where
