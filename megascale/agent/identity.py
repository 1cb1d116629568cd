"""Who an agent is to the controller: its node name, held by one agent at a time, and the config
it runs, by hash.

* ``config_hash``: the job's config as the agent's workers will load it (its file and
  ``--set`` overrides, normalised by ``config.load`` and written back as TOML), hashed. The
  launcher computes it from ``RUN_DIR/job.toml`` the way an agent does; the controller refuses a
  registration that carries another (``controller.intake_checks.registration_problem``).
* ``claim_node``: ``nodes/<node>`` is created under the agent's lease only while no other agent
  holds it (an etcd transaction on the key's absence). A second agent started with a name in
  use waits up to one lease TTL and a second (a crashed predecessor's lease runs out in that
  time) and then gives up: ``NameTaken``, one line naming the holder, the agent exits 2 and the
  holder is untouched. An agent that finds its own earlier registration (its ``instance``
  token: etcd came back with its old lease) takes it back.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from megascale.etcd.store import Put, Store, missing, value_is

INSTANCE = secrets.token_hex(8)
"""This process's registration token: tells its own earlier registration from another agent's."""


class NameTaken(RuntimeError):
    """Another live agent holds this node's name; the text names it."""


def config_hash(config: str | None, overrides: Sequence[str] = ()) -> str | None:
    """The first 16 hex digits of the SHA-256 of the loaded config's TOML; None without a
    config file (an agent started without ``--config`` runs no job of its own)."""
    if not config:
        return None
    from megascale.config import hash_of, load

    return hash_of(load(config, tuple(overrides)))


def claim_node(
    store: Store,
    key: str,
    value: dict[str, Any],
    lease: int,
    wait_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Write ``value`` at ``key`` under ``lease`` if no other agent holds the key (see the
    module docstring) and return the store's revision after the write; ``NameTaken`` after
    ``wait_s`` if one still does."""
    deadline = time.monotonic() + wait_s
    while True:
        created = store.txn([missing(key)], [Put(key, value, lease)])
        if created.succeeded:
            return created.revision
        held = store.get(key)
        if held is None:
            continue  # gone between the two reads: try again at once
        try:
            holder = held.json()
        except ValueError:
            holder = {}
        holder = holder if isinstance(holder, dict) else {}
        if holder.get("instance") == INSTANCE:  # this agent's own, from before an etcd outage
            retaken = store.txn([value_is(key, held.value)], [Put(key, value, lease)])
            if retaken.succeeded:
                return retaken.revision
            continue
        if time.monotonic() >= deadline:
            raise NameTaken(
                f"node name {value.get('node')!r} is already registered by the agent of pid "
                f"{holder.get('pid')} on host {holder.get('host')!r}: one agent per name "
                "(stop that agent or choose another --node)"
            )
        sleep(0.2)
