"""The MegaScaleJob operator (kopf): thin handlers around ``Reconciler``.

Handlers (``build_registry``), each idempotent -- running one twice changes nothing the first run
did not:

* create / resume / update of ``.spec`` -> ``Reconciler.reconcile``: resolve the training config,
  server-side apply every object from ``builders.managed_objects``, bring the worker pods in line.
* a timer every ``interval`` seconds -> ``Reconciler.sync``: read the controller's keys from the
  job's etcd (``state``, ``blocklist/``, ``heartbeats/``, newest ``events/``) with the real
  ``Store``, decide (``status.decide``: pure) and carry out the effects -- delete an evicted node's
  pod, cordon and label the node, create the replacement elsewhere, delete the job after its TTL --
  then write ``.status``.
* delete -> ``Reconciler.forget``: nothing to delete by hand (every child has an owner reference
  to the job, so Kubernetes' garbage collector removes them); the etcd client is closed. The
  handler is optional, but the sync timer is not: kopf puts ``FINALIZER`` on every job it times
  (so that it can stop the timer before the job is gone; kopf has no switch for that), so a job
  deleted while the operator is down waits for it, or for the finalizer to be removed by hand
  (docs/operator.md, "Deleting a job").

All Kubernetes I/O goes through ``KubeAPI`` (``LightkubeAPI`` for a real cluster; tests pass a
recorder). Errors: a config the job cannot run with gives ``phase: Failed, reason: InvalidConfig``
until the spec changes; a missing ConfigMap (``ConfigMapMissing``) or a child the API server
refuses (``ChildRefused``, with the server's message) is retried every ``interval`` (kopf
TemporaryError). Each of the three sets the job's ``reason``/``message`` and its ``Created``
condition to False with that reason, and posts a Warning event; an unreachable etcd leaves the
mirrored fields as they were and still keeps the pods in line.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from megascale.config import ConfigError
from megascale.etcd.keys import JobKeys
from megascale.etcd.store import Store, StoreConfig, StoreError
from megascale.k8s import builders, crd, node_selfcheck
from megascale.k8s.builders import BuildError, Job
from megascale.k8s.status import (
    CordonNode,
    CreatePod,
    DeleteJob,
    DeletePod,
    Effect,
    EtcdView,
    WorkerPod,
    decide,
    set_condition,
)
from megascale.messages import (
    BlockedNode,
    ControllerState,
    Event,
    Heartbeat,
    JobSummaryRecord,
    decoded,
)

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
FINALIZER = "operator.megascale.io/finalizer"
"""The finalizer kopf puts on every job the sync timer runs for (see the module docstring)."""
STORE_RETRY_S = 3.0
EVENTS_READ = 64


class NotReady(RuntimeError):
    """The job cannot proceed yet; retried later. ``reason`` names why in the job's status."""

    reason = "NotReady"


class ConfigMapMissing(NotReady):
    """The ConfigMap (or its key) that ``spec.config.configMapRef`` names does not exist."""

    reason = "ConfigMapMissing"


class ChildRefused(NotReady):
    """The API server refused an object the job is made of; the message is the server's."""

    reason = "ChildRefused"


BLOCKED_REASONS = ("InvalidConfig", ConfigMapMissing.reason, ChildRefused.reason)
"""Status reasons of a job whose objects were not (all) made: ``sync`` leaves its status alone."""


class KubeAPI(Protocol):
    """The Kubernetes calls the operator makes. Manifests are plain dicts."""

    def apply(self, obj: Mapping[str, Any]) -> None:
        """Server-side apply (create or update; fields owned by the operator). Raises
        ``ChildRefused`` with the server's message when the server refuses the object."""

    def create(self, obj: Mapping[str, Any]) -> bool:
        """Create; False if it already exists."""

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> bool:
        """Delete (foreground for the job, default otherwise); False if it did not exist."""

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None
    ) -> dict[str, Any] | None:
        """The object, or None."""

    def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace matching every label."""

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None,
    ) -> None:
        """JSON merge patch."""


class LightkubeAPI:
    """``KubeAPI`` on lightkube's synchronous client (kubeconfig or in-cluster config)."""

    def __init__(self, client: Any | None = None) -> None:
        from lightkube import Client
        from lightkube.generic_resource import create_namespaced_resource

        for group, version, kind, plural in builders.CUSTOM_KINDS:
            create_namespaced_resource(group, version, kind, plural)
        self.client = client or Client(field_manager=builders.FIELD_MANAGER)

    @staticmethod
    def _resource(api_version: str, kind: str) -> Any:
        from lightkube.core.resource_registry import resource_registry

        return resource_registry.load(api_version, kind)

    @staticmethod
    def _missing(error: Exception, code: int) -> bool:
        from lightkube import ApiError

        return isinstance(error, ApiError) and error.status.code == code

    def apply(self, obj: Mapping[str, Any]) -> None:
        from lightkube import ApiError, codecs

        try:
            self.client.apply(
                codecs.from_dict(dict(obj)), field_manager=builders.FIELD_MANAGER, force=True
            )
        except ApiError as e:
            what = f"{obj['kind']} {obj['metadata']['name']!r}"
            raise ChildRefused(f"{what} refused ({e.status.code}): {e.status.message}") from e

    def create(self, obj: Mapping[str, Any]) -> bool:
        from lightkube import codecs

        try:
            self.client.create(codecs.from_dict(dict(obj)))
        except Exception as e:
            if self._missing(e, 409):
                return False
            raise
        return True

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> bool:
        try:
            self.client.delete(self._resource(api_version, kind), name, namespace=namespace)
        except Exception as e:
            if self._missing(e, 404):
                return False
            raise
        return True

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None
    ) -> dict[str, Any] | None:
        try:
            obj = self.client.get(self._resource(api_version, kind), name, namespace=namespace)
        except Exception as e:
            if self._missing(e, 404):
                return None
            raise
        return obj.to_dict()

    def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        res = self._resource(api_version, kind)
        return [o.to_dict() for o in self.client.list(res, namespace=namespace, labels=labels)]

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None,
    ) -> None:
        from lightkube.types import PatchType

        res = self._resource(api_version, kind)
        self.client.patch(res, name, dict(patch), namespace=namespace, patch_type=PatchType.MERGE)


# -- etcd -------------------------------------------------------------------------------------


M = TypeVar("M")


def read_view(store: Store, keys: JobKeys, events: int = EVENTS_READ) -> EtcdView:
    """What the controller wrote for the job, decoded (``messages.decoded``: a value that is
    not a readable message of its type is skipped, logged)."""

    def by_name(kind: type[M], prefix: str) -> dict[str, M]:
        items = ((keys.name_of(kv.key), decoded(kind, kv)) for kv in store.get_prefix(prefix))
        return {name: value for name, value in items if value is not None}

    newest = store.get_prefix(keys.events_prefix, limit=events, descending=True)
    return EtcdView(
        state=decoded(ControllerState, store.get(keys.state)),
        summary=decoded(JobSummaryRecord, store.get(keys.summary)),
        blocklist=by_name(BlockedNode, keys.blocklist_prefix),
        heartbeats=by_name(Heartbeat, keys.heartbeats_prefix),
        events=[e for e in (decoded(Event, kv) for kv in newest) if e is not None],
    )


def _secret_text(secret: Mapping[str, Any], key: str) -> str | None:
    value = (secret.get("data") or {}).get(key)
    return base64.b64decode(value).decode() if value else None


# -- the reconciler -----------------------------------------------------------------------------


class Reconciler:
    """What the handlers do, with Kubernetes (``kube``), etcd (``store_for``) and the clock
    injected.

    Args:
        kube: the Kubernetes calls.
        store_for: the etcd client of a job; default: built from the job's etcd spec (managed:
            the StatefulSet's members; external: its endpoints, TLS and credentials Secrets).
        clock: wall-clock seconds.
        post_event: ``(body, type, reason, message)`` -> a Kubernetes Event (kopf's in the
            operator); a no-op by default.
    """

    def __init__(
        self,
        kube: KubeAPI,
        *,
        store_for: Callable[[Job], Store] | None = None,
        clock: Callable[[], float] = time.time,
        post_event: Callable[[Mapping[str, Any], str, str, str], None] | None = None,
    ) -> None:
        self.kube = kube
        self.clock = clock
        self.post_event = post_event or (lambda body, type_, reason, message: None)
        self._store_for = store_for or self._default_store
        self._stores: dict[str, Store] = {}
        self._tls_dirs: dict[str, Path] = {}
        self._lock = threading.Lock()

    # -- handlers ------------------------------------------------------------------------------

    def reconcile(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create or update everything the job's spec asks for; returns the new status."""
        job = Job.from_body(body)
        status = dict(body.get("status") or {})
        try:
            builders.main_container_index(job.template)
            resolved = builders.resolve_training_config(
                self.training_toml(job), builders.training_overrides(job), job.replicas * job.nproc
            )
        except (ConfigError, BuildError) as e:
            logger.error("job %s: invalid: %s", job.id, e)
            return self.blocked(body, "InvalidConfig", str(e)) | {
                "phase": "Failed",
                "observedGeneration": job.generation,
            }
        for obj in builders.managed_objects(job, resolved):
            self.kube.apply(obj)
        if status.get("reason") in BLOCKED_REASONS:  # fixed: start over
            status = {}
        decision = decide(job, status, self.worker_pods(job), None, self.clock())
        self.execute(job, body, decision.effects)
        logger.info("job %s: reconciled generation %d", job.id, job.generation)
        return decision.status

    def sync(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Mirror the controller's state into the status and act on its evictions."""
        job = Job.from_body(body)
        status = dict(body.get("status") or {})
        if status.get("reason") in BLOCKED_REASONS:  # reconcile (retrying) owns the status
            return {}
        decision = decide(job, status, self.worker_pods(job), self.read(job), self.clock())
        self.execute(job, body, decision.effects)
        return decision.status

    def blocked(self, body: Mapping[str, Any], reason: str, message: str) -> dict[str, Any]:
        """The status of a job that cannot proceed (``reason``: one of ``BLOCKED_REASONS``): the
        phase kept (Pending when new), ``reason`` and ``message`` set, the ``Created`` condition
        False with both; a Warning event says the same."""
        job = Job.from_body(body)
        prior = body.get("status") or {}
        self.post_event(body, "Warning", reason, message)
        conditions = set_condition(
            prior.get("conditions") or [],
            "Created",
            False,
            reason,
            message,
            self.clock(),
            job.generation,
        )
        phase = prior.get("phase", "Pending")
        return {"phase": phase, "reason": reason, "message": message, "conditions": conditions}

    def forget(self, body: Mapping[str, Any]) -> None:
        """The job is being deleted: its children go with it (owner references); drop the
        etcd client."""
        job = Job.from_body(body)
        with self._lock:
            store = self._stores.pop(job.uid, None)
            tls = self._tls_dirs.pop(job.uid, None)
        if store is not None:
            store.close()
        if tls is not None:
            shutil.rmtree(tls, ignore_errors=True)
        logger.info("job %s deleted; its objects are garbage-collected by owner reference", job.id)

    # -- reading -------------------------------------------------------------------------------

    def training_toml(self, job: Job) -> str:
        """The job's TOML: inline, or the key of its ConfigMap (NotReady while missing)."""
        spec = job.spec["config"]
        if "inline" in spec:
            return spec["inline"]
        ref = spec["configMapRef"]
        key = ref.get("key", "config.toml")
        if ref["name"] == builders.config_name(job):
            raise BuildError(
                f"config.configMapRef.name = {ref['name']!r}: the operator writes the resolved "
                "config under that name; give your ConfigMap another name"
            )
        cm = self.kube.get("v1", "ConfigMap", ref["name"], job.namespace)
        if cm is None or key not in (cm.get("data") or {}):
            raise ConfigMapMissing(
                f"config.configMapRef: ConfigMap {ref['name']!r} with key {key!r} not found in "
                f"namespace {job.namespace!r}"
            )
        return cm["data"][key]

    def worker_pods(self, job: Job) -> list[WorkerPod]:
        pods = self.kube.list("v1", "Pod", job.namespace, builders.selector_labels(job, "worker"))
        return [WorkerPod.from_manifest(p) for p in pods]

    def read(self, job: Job) -> EtcdView | None:
        """The controller's keys, or None (logged) when etcd cannot be reached."""
        try:
            return read_view(self.store(job), JobKeys(job.id))
        except (StoreError, OSError) as e:
            logger.warning("job %s: cannot read etcd: %s", job.id, e)
            return None

    def store(self, job: Job) -> Store:
        with self._lock:
            if job.uid not in self._stores:
                self._stores[job.uid] = self._store_for(job)
            return self._stores[job.uid]

    def _default_store(self, job: Job) -> Store:
        options: dict[str, Any] = {"retry_s": STORE_RETRY_S}
        etcd = job.etcd
        if etcd.get("tlsSecret"):
            secret = self.kube.get("v1", "Secret", etcd["tlsSecret"], job.namespace) or {}
            folder = Path(tempfile.mkdtemp(prefix="megascale-etcd-tls-"))
            self._tls_dirs[job.uid] = folder
            for key in ("ca.crt", "tls.crt", "tls.key"):
                text = _secret_text(secret, key)
                if text is not None:
                    (folder / key).write_text(text)
                    (folder / key).chmod(0o600)
            if (folder / "ca.crt").exists():
                options["ca_file"] = str(folder / "ca.crt")
            if (folder / "tls.crt").exists() and (folder / "tls.key").exists():
                options.update(cert_file=str(folder / "tls.crt"), key_file=str(folder / "tls.key"))
        if etcd.get("authSecret"):
            secret = self.kube.get("v1", "Secret", etcd["authSecret"], job.namespace) or {}
            options.update(
                username=_secret_text(secret, "username"), password=_secret_text(secret, "password")
            )
        return Store(StoreConfig.parse(builders.etcd_endpoints(job), **options))

    # -- effects -------------------------------------------------------------------------------

    def execute(self, job: Job, body: Mapping[str, Any], effects: Sequence[Effect]) -> None:
        """Carry out ``effects`` in order; each is safe to repeat."""
        for effect in effects:
            if isinstance(effect, CreatePod):
                created = self.kube.create(builders.worker_pod(job, effect.index, effect.excluded))
                if created:
                    logger.info("job %s: created worker %d", job.id, effect.index)
            elif isinstance(effect, DeletePod):
                self.kube.delete("v1", "Pod", effect.name, job.namespace)
                logger.info("job %s: deleted pod %s: %s", job.id, effect.name, effect.reason)
                if effect.replace:
                    self.post_event(
                        body, "Warning", "ReplacingPod", f"{effect.name}: {effect.reason}"
                    )
            elif isinstance(effect, CordonNode):
                patch = builders.evicted_node_patch(job, effect.reason)
                self.kube.patch("v1", "Node", effect.node, patch, None)
                logger.warning("job %s: cordoned node %s: %s", job.id, effect.node, effect.reason)
                self.post_event(body, "Warning", "NodeCordoned", f"{effect.node}: {effect.reason}")
            elif isinstance(effect, DeleteJob):
                self.kube.delete(crd.API_VERSION, crd.KIND, job.name, job.namespace)
                logger.info("job %s: deleted: %s", job.id, effect.reason)
            else:  # pragma: no cover - the Effect union is closed
                raise TypeError(f"unknown effect {effect!r}")


# -- kopf -------------------------------------------------------------------------------------


def build_registry(reconciler: Reconciler, *, interval: float = DEFAULT_INTERVAL_S) -> Any:
    """A kopf registry with the MegaScaleJob handlers bound to ``reconciler``."""
    import kopf

    registry = kopf.OperatorRegistry()
    resource = {
        "group": crd.GROUP,
        "version": crd.VERSION,
        "plural": crd.PLURAL,
        "registry": registry,
    }

    def guarded(
        method: Callable[[Mapping[str, Any]], dict[str, Any]], body: Any, patch: Any
    ) -> dict:
        try:
            return method(body)
        except NotReady as e:
            # kopf applies the patch with its retry state, so the status shows why it waits
            patch.status.update(reconciler.blocked(body, e.reason, str(e)))
            raise kopf.TemporaryError(str(e), delay=interval) from e

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> Any:
        # In a pod: its ServiceAccount; elsewhere: $KUBECONFIG or ~/.kube/config.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(id="configure", registry=registry)
    def configure(settings: Any, **_: Any) -> None:
        prefix = "operator.megascale.io"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=prefix, key="last-handled-configuration"
        )
        settings.persistence.finalizer = FINALIZER
        settings.posting.level = logging.INFO

    @kopf.on.resume(id="reconcile", **resource)
    @kopf.on.create(id="reconcile", **resource)
    @kopf.on.update(id="reconcile", field="spec", **resource)
    def reconcile(body: Any, patch: Any, **_: Any) -> None:
        patch.status.update(guarded(reconciler.reconcile, body, patch))

    @kopf.timer(id="sync", interval=interval, initial_delay=interval, **resource)
    def sync(body: Any, patch: Any, **_: Any) -> None:
        patch.status.update(guarded(reconciler.sync, body, patch))

    @kopf.on.delete(id="forget", optional=True, **resource)
    def delete(body: Any, **_: Any) -> None:
        reconciler.forget(body)

    return registry


def kopf_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    import kopf

    kopf.event(body, type=type_, reason=reason, message=message)


def run_operator(
    namespaces: Sequence[str] = (),
    interval: float = DEFAULT_INTERVAL_S,
    liveness: str | None = None,
) -> None:
    """Run the operator until stopped: watch ``namespaces`` (all when empty)."""
    import kopf

    reconciler = Reconciler(LightkubeAPI(), post_event=kopf_event)
    kopf.run(
        registry=build_registry(reconciler, interval=interval),
        standalone=True,  # one replica; no peering objects needed
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
    )


def main(args: argparse.Namespace) -> int:
    """``megascale operator ...`` (arguments: ``megascale.k8s.command.add_arguments``)."""
    logging.getLogger().setLevel(os.environ.get("MEGASCALE_LOG_LEVEL", "INFO").upper())
    if args.operator_command == "crd":
        sys.stdout.write(crd.crd_yaml())
        return 0
    if args.operator_command == "selfcheck-label":
        command = args.selfcheck or ["megascale", "selfcheck", "--json"]
        kube = LightkubeAPI()
        workers = lambda: node_selfcheck.workers_on_node(kube.client, args.node)  # noqa: E731
        return node_selfcheck.selfcheck_daemon(
            kube, args.node, command, args.interval, args.timeout, args.once, workers
        )
    run_operator(args.namespace, args.interval, args.liveness)
    return 0
