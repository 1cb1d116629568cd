"""Cross-field rules for a JobConfig: the checks that need the world size and the backend.

``validate`` runs them all and raises one ConfigError listing every broken rule, each naming the
field, its value, and the rule (one line when one rule is broken). Range checks run first; the divisibility rules run only when the
sizes they divide by are valid, so one mistake is reported once and never as a ZeroDivisionError.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

from megascale.config.error import ConfigError

if TYPE_CHECKING:
    from megascale.config import FaultToleranceConfig, JobConfig

BACKENDS = ("gloo", "nccl")
OPTIMIZERS = ("adam", "lamb")
SPECS = ("auto", "local", "te")
DTYPES = ("fp32", "bf16")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("online", "offline")
STRAGGLER_ACTIONS = ("report", "evict")
DATA_LOADERS = ("node", "rank")
NODE_LOSS_POLICIES = ("wait", "shrink", "fail")
"""``fault_tolerance.policy``: what the controller does with a lost node and no spare."""


def validate(cfg: JobConfig, world_size: int, backend: str) -> JobConfig:
    """Return a copy of ``cfg`` with ``parallel.dp`` filled in, or raise ConfigError.

    ``world_size`` is the number of training processes, ``backend`` the torch.distributed backend
    they will use ("gloo" on CPU, "nccl" on CUDA). Call once per launch, before building groups,
    through ``config.validate``, which type-checks every field first.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size = {world_size!r}: must be a positive integer")
    if backend not in BACKENDS:
        raise ConfigError(f"backend = {backend!r}: must be one of {', '.join(BACKENDS)}")
    problems = _finite(cfg) or _ranges(cfg)
    if not problems:
        dp = _data_parallel_size(cfg, world_size, problems)
        problems += _model_shape(cfg)
        problems += _profile_ranks_in_world(cfg.train.profile_ranks, world_size)
        problems += _backend(cfg, backend)
        problems += _overlap(cfg)
        if dp is not None:
            problems += _batch(cfg, dp)
    if len(problems) == 1:  # one line: the field, its value, the rule
        raise ConfigError(f"{problems[0]} (world_size={world_size}, backend={backend})")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(
            f"invalid config for world_size={world_size}, backend={backend}:\n{lines}"
        )
    from megascale.train.checkpoint.storage import check_config  # names checkpoint.* fields itself

    # Machine-independent rules only: a config may be validated away from where it runs.
    check_config(cfg.checkpoint, world_size, check_installed=False)
    out = copy.deepcopy(cfg)
    out.parallel.dp = world_size // (cfg.parallel.tp * cfg.parallel.pp)
    return out


def _finite(cfg: JobConfig) -> list[str]:
    """Every float field a finite number (inf and nan pass some range checks and then end in a
    traceback inside megatron-core, or in training that never updates)."""
    problems = []
    for section in dataclasses.fields(cfg):
        table = getattr(cfg, section.name)
        for f in dataclasses.fields(table):
            value = getattr(table, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{section.name}.{f.name} = {value}: must be a finite number")
    return problems


def _ranges(cfg: JobConfig) -> list[str]:
    """Sizes positive, rates in range, names from their closed lists."""
    p, m, o, t, c = cfg.parallel, cfg.model, cfg.optim, cfg.train, cfg.checkpoint
    problems: list[str] = []

    def at_least(name: str, value: int | float | None, low: int | float) -> None:
        if value is not None and not value >= low:  # `not >=` also catches NaN
            problems.append(f"{name} = {value}: must be >= {low}")

    def one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            problems.append(f"{name} = {value!r}: must be one of {', '.join(allowed)}")

    def unit(name: str, value: float) -> None:
        if not 0.0 <= value < 1.0:
            problems.append(f"{name} = {value}: must be in [0, 1)")

    for name, value in [
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("parallel.vpp", p.vpp),
        ("parallel.dp", p.dp),
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_heads", m.num_heads),
        ("model.num_query_groups", m.num_query_groups),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
        ("model.seq_length", m.seq_length),
        ("model.vocab_size", m.vocab_size),
        ("model.window_size", m.window_size),
        ("train.steps", t.steps),
        ("train.global_batch_size", t.global_batch_size),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.log_interval", t.log_interval),
        ("train.eval_steps", t.eval_steps),
        ("checkpoint.keep", c.keep),
        ("diagnostics.flush_interval_steps", cfg.diagnostics.flush_interval_steps),
    ]:
        at_least(name, value, 1)
    for name, value in [
        ("optim.warmup_steps", o.warmup_steps),
        ("optim.min_lr", o.min_lr),
        ("optim.weight_decay", o.weight_decay),
        ("optim.clip_grad", o.clip_grad),
        ("train.seed", t.seed),
        ("train.eval_interval", t.eval_interval),
        ("checkpoint.interval", c.interval),
    ]:
        at_least(name, value, 0)
    if t.peak_tflops is not None and not t.peak_tflops > 0:
        problems.append(
            f"train.peak_tflops = {t.peak_tflops}: must be > 0 (dense TFLOP/s per device), "
            "or left out to use the GPU's table peak or a measured CPU peak"
        )
    for name, value in [
        ("optim.lr", o.lr),
        ("optim.eps", o.eps),
        ("model.init_method_std", m.init_method_std),
    ]:
        if not value > 0:
            problems.append(f"{name} = {value}: must be > 0")
    if not o.eps < 1:
        problems.append(f"optim.eps = {o.eps}: must be < 1 (a denominator epsilon, e.g. 1e-8)")
    if cfg.data.path is not None and not cfg.data.path.strip():
        problems.append(
            f"data.path = {cfg.data.path!r}: must be a token file prefix (PREFIX.bin + "
            "PREFIX.idx from `megascale data build`), or left out for the built-in corpus"
        )
    if o.lr > 0 and o.min_lr > o.lr:
        problems.append(
            f"optim.min_lr = {o.min_lr}: must be <= optim.lr = {o.lr} "
            f"(the cosine decays from lr down to min_lr)"
        )
    if t.steps > 0 and o.warmup_steps >= t.steps:
        problems.append(
            f"optim.warmup_steps = {o.warmup_steps}: must be < train.steps = {t.steps} "
            f"(the warm-up has to end before the last step)"
        )
    for name, value in [
        ("optim.beta1", o.beta1),
        ("optim.beta2", o.beta2),
        ("model.hidden_dropout", m.hidden_dropout),
        ("model.attention_dropout", m.attention_dropout),
    ]:
        unit(name, value)
    one_of("optim.name", o.name, OPTIMIZERS)
    one_of("model.spec", m.spec, SPECS)
    one_of("model.params_dtype", m.params_dtype, DTYPES)
    one_of("model.normalization", m.normalization, NORMALIZATIONS)
    one_of("train.recompute", t.recompute, RECOMPUTE)
    one_of("train.recompute_method", t.recompute_method, RECOMPUTE_METHODS)
    if m.rotary_base < 1:
        problems.append(f"model.rotary_base = {m.rotary_base}: must be a positive integer")
    one_of("train.device", t.device, DEVICES)
    problems += _profile_window(t.profile_steps, t.steps)
    problems += _profile_ranks(t.profile_ranks)
    one_of("data.loader", cfg.data.loader, DATA_LOADERS)
    one_of("metrics.wandb_mode", cfg.metrics.wandb_mode, WANDB_MODES)
    board = cfg.metrics.tensorboard_dir
    if not board.strip() or Path(board).is_absolute() or ".." in Path(board).parts:
        problems.append(
            f"metrics.tensorboard_dir = {board!r}: must be a relative path inside the run "
            "directory, e.g. 'tensorboard'"
        )
    if not cfg.metrics.wandb_project.strip():
        problems.append(f"metrics.wandb_project = {cfg.metrics.wandb_project!r}: must not be empty")
    from megascale.data.blend import check_data_config

    problems += check_data_config(cfg.data, t.eval_interval)
    ft = cfg.fault_tolerance
    problems += fault_tolerance_problems(
        ft.policy, ft.max_restarts, ft.restart_window_s, ft.node_wait_timeout_s, "fault_tolerance."
    )
    repeat = ft.evict_repeat_culprit
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        problems.append(
            f"fault_tolerance.evict_repeat_culprit = {repeat!r}: must be an integer >= 1"
        )
    problems += straggler_problems(ft, "fault_tolerance.")
    problems += recovery_problems(ft)
    return problems


RECOVERY_MODES = ("in-process", "restart")


def recovery_problems(ft: FaultToleranceConfig) -> list[str]:
    """What is wrong with ``fault_tolerance.recovery`` and its settings."""
    problems = []
    if ft.recovery not in RECOVERY_MODES:
        problems.append(
            f"fault_tolerance.recovery = {ft.recovery!r}: must be one of {', '.join(RECOVERY_MODES)}"
        )
    interval = ft.snapshot_interval
    if interval is not None and (
        isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
    ):
        problems.append(
            f"fault_tolerance.snapshot_interval = {interval!r}: must be an integer >= 1, or "
            "left out (every step on CPU, every checkpoint.interval steps on a GPU)"
        )
    if not ft.pause_timeout_s > 0:
        problems.append(f"fault_tolerance.pause_timeout_s = {ft.pause_timeout_s}: must be > 0 s")
    return problems


def straggler_problems(ft: FaultToleranceConfig, prefix: str) -> list[str]:
    """What is wrong with the straggler and self-check settings of a ``FaultToleranceConfig``."""
    problems = []
    if not ft.straggler_threshold > 1.0:
        problems.append(
            f"{prefix}straggler_threshold = {ft.straggler_threshold}: must be "
            "> 1 (a slowdown ratio against the median of a rank's peers, e.g. 1.1 for 10%)"
        )
    if ft.straggler_action not in STRAGGLER_ACTIONS:
        problems.append(
            f"{prefix}straggler_action = {ft.straggler_action!r}: must be one "
            f"of {', '.join(STRAGGLER_ACTIONS)}"
        )
    for name in ("straggler_window", "straggler_consecutive"):
        value = getattr(ft, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{prefix}{name} = {value!r}: must be an integer >= 1")
    if not ft.selfcheck_timeout_s > 0:
        problems.append(f"{prefix}selfcheck_timeout_s = {ft.selfcheck_timeout_s}: must be > 0 s")
    from megascale.agent.selfcheck.names import CHECK_NAMES, selected_checks

    names = [n for group in CHECK_NAMES for n in group]
    for test in ft.selfcheck_tests:
        if not selected_checks([test]):
            problems.append(
                f"{prefix}selfcheck_tests: {test!r} names no check; accepted: gpu, host, net, "
                f"a check name ({', '.join(names)}) or a shell pattern over them"
            )
    return problems


def fault_tolerance_problems(
    policy: str,
    max_restarts: int,
    restart_window_s: float | None,
    node_wait_timeout_s: float | None,
    prefix: str = "",
    policy_field: str = "policy",
) -> list[str]:
    """The range rules of the fault-tolerance policy, one message per broken rule, each naming
    ``prefix`` + the field. Shared by the config, ``megascale controller`` and the controller's
    policy, so the three accept the same values."""
    problems = []
    if policy not in NODE_LOSS_POLICIES:
        problems.append(
            f"{prefix}{policy_field} = {policy!r}: must be one of {', '.join(NODE_LOSS_POLICIES)}"
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        problems.append(f"{prefix}max_restarts = {max_restarts!r}: must be an integer >= 0")
    if restart_window_s is not None and not restart_window_s > 0:
        problems.append(
            f"{prefix}restart_window_s = {restart_window_s}: must be > 0 (seconds in which at "
            "most max_restarts restarts are allowed)"
        )
    if node_wait_timeout_s is not None and not node_wait_timeout_s > 0:
        problems.append(
            f"{prefix}node_wait_timeout_s = {node_wait_timeout_s}: must be > 0 seconds, or none "
            "(wait for ever)"
        )
    return problems


def _profile_window(window: list[int], steps: int) -> list[str]:
    """``train.profile_steps``: [] or [first, last] with 1 <= first <= last <= train.steps."""
    if not window or (len(window) == 2 and 1 <= window[0] <= window[1] <= steps):
        return []
    return [
        f"train.profile_steps = {window}: must be [first, last] with 1 <= first <= last <= "
        f"train.steps = {steps} (optimizer steps, inclusive), or [] for no profile"
    ]


def _profile_ranks(ranks: list[int]) -> list[str]:
    """``train.profile_ranks``: distinct global ranks >= 0 ([] = every rank)."""
    if all(r >= 0 for r in ranks) and len(set(ranks)) == len(ranks):
        return []
    return [
        f"train.profile_ranks = {ranks}: must be distinct global ranks >= 0 "
        f"(e.g. [0] or [0, 8]), or [] for every rank"
    ]


def _profile_ranks_in_world(ranks: list[int], world_size: int) -> list[str]:
    """``train.profile_ranks`` against the world size, known at start."""
    outside = [r for r in ranks if r >= world_size]
    if not outside:
        return []
    return [
        f"train.profile_ranks = {ranks}: rank {outside[0]} is not in this job (global ranks "
        f"0 to {world_size - 1}); drop it, or use [] for every rank"
    ]


def _data_parallel_size(cfg: JobConfig, world_size: int, problems: list[str]) -> int | None:
    """world_size / (tp * pp), checked against a given parallel.dp; None when it does not divide."""
    p = cfg.parallel
    model_parallel = p.tp * p.pp
    if world_size % model_parallel:
        problems.append(
            f"parallel.tp * parallel.pp = {p.tp} * {p.pp} = {model_parallel}: must "
            f"divide world_size = {world_size} (dp = world_size / (tp * pp))"
        )
        return None
    dp = world_size // model_parallel
    if p.dp is not None and p.dp != dp:
        problems.append(
            f"parallel.dp = {p.dp}: must equal world_size / (tp * pp) = "
            f"{world_size} / {model_parallel} = {dp} (or be left out)"
        )
    return dp


def _model_shape(cfg: JobConfig) -> list[str]:
    """How the model splits over tensor and pipeline ranks."""
    p, m = cfg.parallel, cfg.model
    problems: list[str] = []
    if m.num_heads % p.tp:
        problems.append(
            f"model.num_heads = {m.num_heads}: must be divisible by parallel.tp = "
            f"{p.tp} (each tensor-parallel rank holds num_heads / tp heads)"
        )
    if m.hidden_size % m.num_heads:
        problems.append(
            f"model.hidden_size = {m.hidden_size}: must be divisible by "
            f"model.num_heads = {m.num_heads} (head size = hidden_size / num_heads)"
        )
    if m.num_query_groups is not None:
        if m.num_heads % m.num_query_groups:
            problems.append(
                f"model.num_query_groups = {m.num_query_groups}: must divide "
                f"model.num_heads = {m.num_heads} (query heads share each key/value "
                f"head equally)"
            )
        if m.num_query_groups % p.tp:
            problems.append(
                f"model.num_query_groups = {m.num_query_groups}: must be divisible "
                f"by parallel.tp = {p.tp} (each tensor-parallel rank holds whole "
                f"key/value heads)"
            )
    ffn = m.ffn_hidden_size if m.ffn_hidden_size is not None else 4 * m.hidden_size
    if ffn % p.tp:
        problems.append(
            f"model.ffn_hidden_size = {ffn}: must be divisible by parallel.tp = "
            f"{p.tp} (the MLP is split column-wise over the tensor-parallel ranks)"
        )
    chunks = p.pp * p.vpp
    if m.num_layers % chunks:
        problems.append(
            f"model.num_layers = {m.num_layers}: must be divisible by parallel.pp * "
            f"parallel.vpp = {p.pp} * {p.vpp} = {chunks} (every model chunk on every "
            f"pipeline stage holds the same number of layers)"
        )
    layers_per_chunk = m.num_layers // chunks if m.num_layers % chunks == 0 else None
    t = cfg.train
    if t.recompute == "full" and layers_per_chunk is not None:
        if t.recompute_num_layers < 1 or t.recompute_num_layers > layers_per_chunk:
            problems.append(
                f"train.recompute_num_layers = {t.recompute_num_layers}: must be 1 to "
                f"{layers_per_chunk} (the layers of one model chunk: model.num_layers / "
                f"(parallel.pp * parallel.vpp))"
            )
        elif t.recompute_method == "uniform" and layers_per_chunk % t.recompute_num_layers:
            problems.append(
                f"train.recompute_num_layers = {t.recompute_num_layers}: must divide the "
                f"{layers_per_chunk} layers of one model chunk with recompute_method = 'uniform'"
            )
    if p.vpp > 1 and p.pp == 1:
        problems.append(
            f"parallel.vpp = {p.vpp}: needs parallel.pp >= 2 (interleaving splits "
            f"each pipeline stage into model chunks; megatron-core refuses "
            f"virtual stages without pipeline parallelism)"
        )
    if p.sequence_parallel and p.tp == 1:
        problems.append(
            "parallel.sequence_parallel = true: needs parallel.tp > 1 (it shards "
            "activations over the tensor-parallel group)"
        )
    if p.sequence_parallel and m.seq_length % p.tp:
        problems.append(
            f"model.seq_length = {m.seq_length}: must be divisible by parallel.tp = "
            f"{p.tp} when parallel.sequence_parallel = true (each tensor-parallel "
            f"rank holds seq_length / tp tokens)"
        )
    return problems


def _backend(cfg: JobConfig, backend: str) -> list[str]:
    """What gloo (CPU) and nccl (CUDA) cannot do."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    problems: list[str] = []
    if backend == "gloo":
        if m.params_dtype == "bf16":
            problems.append(
                "model.params_dtype = 'bf16': not on backend gloo (CPU); use 'fp32', "
                "or run on CUDA with nccl"
            )
        if m.spec == "te":
            problems.append(
                "model.spec = 'te': Transformer Engine needs CUDA, not backend gloo "
                "(CPU); use 'local' or 'auto'"
            )
        if p.pp == 2 and p.vpp > 1 and p.effective_batch_p2p_comm(cfg.overlap):
            problems.append(
                f"parallel.batch_p2p_comm = true: with parallel.pp = 2 and "
                f"parallel.vpp = {p.vpp} on gloo the previous and next pipeline peer "
                f"are the same rank and batched send/recv pairs them wrongly (silently "
                f"wrong numbers); set parallel.batch_p2p_comm=false"
            )
    if backend == "nccl" and p.async_collectives:
        problems.append(
            "parallel.async_collectives = true: the NCCL-like mode is for the CPU backend (gloo); "
            "NCCL is asynchronous already, set it to false"
        )
    if backend == "nccl" and t.device == "cpu":
        problems.append(
            "train.device = 'cpu': backend nccl needs CUDA; use 'cuda' or 'auto', or backend gloo"
        )
    if t.memory_history and t.device == "cpu":
        problems.append(
            "train.memory_history = true: needs train.device = 'cuda' (or 'auto' on a GPU "
            "machine); the CPU has no CUDA allocator to record, set it to false"
        )
    if t.nvtx and t.device == "cpu":
        problems.append(
            "train.nvtx = true: needs train.device = 'cuda' (or 'auto' on a GPU machine); "
            "NVTX ranges are for Nsight Systems on CUDA, set it to false"
        )
    return problems


def _overlap(cfg: JobConfig) -> list[str]:
    """Overlap knobs against the layout."""
    p, m, o = cfg.parallel, cfg.model, cfg.overlap
    problems: list[str] = []
    if o.tp_chunks < 1:
        problems.append(f"overlap.tp_chunks = {o.tp_chunks}: must be >= 1")
    # The TE spec overlaps inside TE (megascale.overlap.tp_plan): the chunks are the local spec's.
    elif o.tp_active(p) and m.spec != "te" and (m.seq_length // p.tp) % o.tp_chunks:
        problems.append(
            f"overlap.tp_chunks = {o.tp_chunks}: the per-rank sequence "
            f"(model.seq_length / parallel.tp = {m.seq_length // p.tp}) must be divisible by it; "
            f"pick a divisor or set overlap.tp=false"
        )
    if o.bucket_size is not None and o.bucket_size < 1:
        problems.append(f"overlap.bucket_size = {o.bucket_size}: must be >= 1 or none")
    if o.pp_active(p) and p.batch_p2p_comm:
        problems.append(
            "parallel.batch_p2p_comm = true: overlap.pp needs individual asynchronous "
            "sends/receives; leave parallel.batch_p2p_comm unset, or set overlap.pp=false"
        )
    return problems


def _batch(cfg: JobConfig, dp: int) -> list[str]:
    """How the global batch splits into micro-batches over data-parallel ranks."""
    p, t = cfg.parallel, cfg.train
    problem = batch_split_problem(t.global_batch_size, t.micro_batch_size, dp, p.pp, p.vpp)
    return [problem] if problem else []


def batch_split_problem(
    global_batch_size: int, micro_batch_size: int, dp: int, pp: int = 1, vpp: int = 1
) -> str | None:
    """Why ``global_batch_size`` cannot be split over ``dp`` data-parallel ranks in micro-batches
    of ``micro_batch_size`` (None: it can, in ``global / (micro * dp)`` micro-batches per rank).
    The controller asks this too when it shrinks the job to fewer data-parallel replicas."""
    per_step = micro_batch_size * dp
    if global_batch_size % per_step:
        return (
            f"train.global_batch_size = {global_batch_size}: must be divisible by "
            f"train.micro_batch_size * dp = {micro_batch_size} * {dp} = {per_step} "
            f"(every data-parallel rank runs whole micro-batches)"
        )
    microbatches = global_batch_size // per_step
    # megatron-core 0.16 forward_backward_pipelining_with_interleaving: the micro-batch group size
    # per virtual stage defaults to pp and must be <= M, and M % pp must be 0 or >= pp; together
    # with the default group size that is M % pp == 0.
    if vpp > 1 and microbatches % pp:
        return (
            f"train.global_batch_size = {global_batch_size}: with parallel.vpp = {vpp} "
            f"the number of micro-batches global_batch_size / (micro_batch_size * dp) = "
            f"{microbatches} must be divisible by parallel.pp = {pp} (megatron-core's "
            f"interleaved 1F1B schedule runs micro-batches in groups of pp)"
        )
    return None
