"""Under the operator the controller checks what each agent pod registers: ``--config-hash`` is
the hash an agent computes from the ConfigMap's ``config.toml`` mounted where its arguments say,
and ``--train-steps`` the resolved ``train.steps`` (the heartbeat step bound). Checked on the
objects the operator's reconciler applies and creates, with the real CLI's parser, the agent's
own option parsing and hash, and the controller's registration check."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from k8s_support import FakeKube
from test_builders import _expand, container
from test_operator import add_configmap, body_of, reconciler

from megascale.agent.identity import config_hash
from megascale.cli import build_parser
from megascale.controller.intake_checks import registration_problem
from megascale.k8s.job import CONFIG_DIR

ENV = {"MEGASCALE_NODE_NAME": "node-1", "MEGASCALE_ETCD_USERNAME": "megascale"}


def _operated(kube: FakeKube, stem: str) -> tuple[dict, dict, list[dict]]:
    """(ConfigMap of the resolved config, controller Deployment, worker pods) as reconciled."""
    if stem == "gpu-volcano":
        add_configmap(kube)  # its training config is a ConfigMap of the user's
    reconciler(kube, None).reconcile(body_of(stem))
    objects = list(kube.objects.values())
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pods = [o for o in objects if o["kind"] == "Pod"]
    volume = next(
        v for v in pods[0]["spec"]["volumes"] if v["name"] == "megascale-config"
    )  # what the agents' CONFIG_DIR mount is
    [config_map] = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]
    ]
    return config_map, deployment, pods


def _agent_hash(pod: dict, config_map: dict, root: Path) -> str | None:
    """The hash the pod's agent registers, its ConfigMap's files placed under ``root`` at the
    path the pod mounts them."""
    main = container(pod)
    [mount] = [m for m in main["volumeMounts"] if m["name"] == "megascale-config"]
    assert mount["mountPath"] == CONFIG_DIR
    mounted = root / CONFIG_DIR.lstrip("/")
    mounted.mkdir(parents=True, exist_ok=True)
    for name, text in config_map["data"].items():
        (mounted / name).write_text(text)
    args = build_parser().parse_args(_expand(main["args"], ENV)[1:])
    assert args.config.startswith(CONFIG_DIR + "/"), args.config
    # as ``agent.service`` does with the options ``options_from_args`` makes of ``args``
    return config_hash(str(root / args.config.lstrip("/")), tuple(args.overrides))


@pytest.mark.parametrize("stem", ["minimal-cpu", "gpu-volcano"])
def test_the_controller_checks_the_hash_and_steps_the_agent_pods_have(kube, stem, tmp_path):
    config_map, deployment, pods = _operated(kube, stem)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    controller = build_parser().parse_args(_expand(args, ENV)[1:])
    resolved = tomllib.loads(config_map["data"]["config.toml"])
    assert controller.train_steps == resolved["train"]["steps"]
    assert controller.config_hash
    assert len(pods) >= 2
    for pod in pods:
        mine = _agent_hash(pod, config_map, tmp_path / pod["metadata"]["name"])
        assert mine == controller.config_hash
        registration = {"node": "node-1", "config_hash": mine}
        assert registration_problem(registration, "node-1", controller.config_hash) is None
    # an agent given another config is refused by that controller
    changed = dict(config_map, data=dict(config_map["data"]))
    steps = resolved["train"]["steps"]
    changed["data"]["config.toml"] = changed["data"]["config.toml"].replace(
        f"steps = {steps}\n", f"steps = {steps + 1}\n", 1
    )
    assert changed["data"]["config.toml"] != config_map["data"]["config.toml"]
    theirs = _agent_hash(pods[0], changed, tmp_path / "another")
    problem = registration_problem({"node": "node-1", "config_hash": theirs}, "node-1", mine)
    assert problem and "is not the job's" in problem, problem
