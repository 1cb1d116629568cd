"""Kubernetes: the MegaScaleJob custom resource, its operator, and the objects it makes.

* ``crd``: the CustomResourceDefinition as data (and the committed YAML generated from it).
* ``validation``: what the API server would say, offline: defaults, schema, CEL rules.
* ``job``: the MegaScaleJob as the builders read it; the labels, names and metadata they share.
* ``launch``: what the processes in the pods are given: flags, environment, resolved config.
* ``builders``: pure functions, job -> manifest dicts (etcd, controller, workers, RBAC, ...).
* ``status``: pure decisions: the status mirrored from etcd, evictions and pod replacement.
* ``operator``: the kopf handlers and the Kubernetes client (needs the ``k8s`` extra).

* ``command``: ``megascale operator run|crd|selfcheck-label``, parsed without kopf.
"""
