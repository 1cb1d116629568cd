"""The job config: one small dataclass per subsystem, TOML presets, ``--set`` overrides.

The parts: ``sections`` (the dataclasses, a docstring under every field), ``loader`` (presets and
files, ``--set`` overrides, type checks, writing TOML), ``rules`` (the cross-field rules that
need the world size and the backend), ``compat`` (old keys still read) and ``error``
(``ConfigError``, the one error a bad configuration raises).
"""

from megascale.config.error import ConfigError
from megascale.config.loader import (
    DEFAULT_PRESET,
    PRESETS_DIR,
    check_types,
    hash_of,
    load,
    presets,
    resolve_path,
    to_dict,
    to_toml,
    validate,
)
from megascale.config.sections import (
    CheckpointConfig,
    DataConfig,
    DiagnosticsConfig,
    FaultToleranceConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    OverlapConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS_DIR",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DiagnosticsConfig",
    "FaultToleranceConfig",
    "JobConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlapConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_types",
    "hash_of",
    "load",
    "presets",
    "resolve_path",
    "to_dict",
    "to_toml",
    "validate",
]
