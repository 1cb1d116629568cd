"""TE userbuffers on GPUs without CUDA multicast (PCIe, NVL pairs): ``UB_SKIPMC=1`` is set before
``initialize_ub``, which otherwise raises; left alone where multicast works or the user chose."""

from __future__ import annotations

import sys
import types

from megascale.overlap.tp_plan import skip_multicast_unless_supported


def _tex(monkeypatch, supported: bool) -> None:
    module = types.ModuleType("transformer_engine_torch")
    module.device_supports_multicast = lambda: supported
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", module)


def test_without_multicast_userbuffers_skip_it(monkeypatch):
    _tex(monkeypatch, supported=False)
    env: dict[str, str] = {}
    assert skip_multicast_unless_supported(env) is True and env == {"UB_SKIPMC": "1"}


def test_with_multicast_or_a_users_choice_nothing_changes(monkeypatch):
    _tex(monkeypatch, supported=True)
    env: dict[str, str] = {}
    assert skip_multicast_unless_supported(env) is False and env == {}
    _tex(monkeypatch, supported=False)
    chosen = {"UB_SKIPMC": "0"}
    assert skip_multicast_unless_supported(chosen) is False and chosen == {"UB_SKIPMC": "0"}


def test_without_transformer_engine_nothing_changes(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", None)
    env: dict[str, str] = {}
    assert skip_multicast_unless_supported(env) is False and env == {}
