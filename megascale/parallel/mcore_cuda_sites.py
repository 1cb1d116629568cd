"""The CUDA call sites of megatron-core on megascale's CPU paths: a snapshot and the scanner behind it.

``megascale/parallel/cpu_backend.py`` redirects megatron-core's CUDA assumptions to the CPU. It was
checked against the call sites recorded here, so a megatron-core upgrade that adds one must fail
loudly instead of training on CPU with a path nobody redirected. ``tests/unit/test_cpu_backend.py``
scans the installed megatron-core and compares it with ``SNAPSHOT``.

What is recorded:

* ``MODULES``: the megatron-core files (relative to ``megatron/core``) whose functions execute
  during CPU training. Measured with a call tracer on the ``tiny`` preset: 1 process; TP2 x PP2 x
  DP2 with sequence parallelism and the distributed optimizer (8 ranks); the same with interleaving
  (VPP2, unbatched p2p); PP2 with the parallel block, a sliding window and the plain optimizer (2
  ranks). All of the union, helpers included: a helper module that starts allocating on CUDA is as
  much a problem as ``schedules.py`` doing it. ``tests/unit/test_cpu_backend.py`` re-measures a
  1-process and a TP2 x PP2 + SP run and fails when megatron-core executes code in a file not
  listed here, or asks for CUDA on a line that is not a snapshot site.
* ``SNAPSHOT``: for every file in ``MODULES``, each source line matching ``CUDA_SITE`` (comments
  and docstrings blanked first), stripped, with how many times that exact line occurs. Keyed by text,
  not line number, so unrelated edits that shift lines do not trip the guard; a new line, or one more
  copy of a known line, does. Files with no site map to ``{}`` (checked, nothing found).

Regenerate after reviewing ``cpu_backend.py`` against a new megatron-core::

    python -m megascale.parallel.mcore_cuda_sites --write

which rewrites the block between the ``BEGIN SNAPSHOT`` and ``END SNAPSHOT`` markers of this file
(without ``--write`` the block is printed). Update ``MODULES`` first if the set of files changed.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

CUDA_SITE = re.compile(
    r"\bcuda\.\w"  # torch.cuda.X, torch.backends.cuda.X, "torch.cuda.FloatTensor", cuda.bindings
    r"|\btorch\.cuda\b"  # torch.cuda itself: imported, passed around
    r"|\.cuda\("  # Tensor.cuda() / Module.cuda()
    r"|\.is_cuda\b"
    r"|\b_cuda_\w"  # torch._C._cuda_setRNGState and friends
    r"|f?[\"']cuda(?::[^\"']*)?[\"']"  # "cuda", 'cuda:0', f"cuda:{i}" (device=, device_type=)
    r"|pin_memory\s*=\s*True|\.pin_memory\("  # pinned host memory needs a CUDA runtime
)
"""A line that assumes CUDA. Deliberately broad: a false positive costs one snapshot line."""

MODULES: tuple[str, ...] = (
    "_rank_utils.py",
    "config_logger.py",
    "datasets/blended_dataset.py",
    "datasets/blended_megatron_dataset_builder.py",
    "datasets/blended_megatron_dataset_config.py",
    "datasets/gpt_dataset.py",
    "datasets/helpers.py",
    "datasets/indexed_dataset.py",
    "datasets/megatron_dataset.py",
    "datasets/object_storage_utils.py",
    "datasets/utils.py",
    "distributed/data_parallel_base.py",
    "distributed/distributed_data_parallel.py",
    "distributed/distributed_data_parallel_config.py",
    "distributed/finalize_model_grads.py",
    "distributed/param_and_grad_buffer.py",
    "fp8_utils.py",
    "fusions/fused_bias_dropout.py",
    "fusions/fused_softmax.py",
    "model_parallel_config.py",
    "msc_utils.py",
    "models/backends.py",
    "models/common/embeddings/language_model_embedding.py",
    "models/common/embeddings/rope_utils.py",
    "models/common/embeddings/rotary_pos_embedding.py",
    "models/common/embeddings/yarn_rotary_pos_embedding.py",
    "models/common/language_module/language_module.py",
    "models/gpt/gpt_layer_specs.py",
    "models/gpt/gpt_model.py",
    "optimizer/__init__.py",
    "optimizer/clip_grads.py",
    "optimizer/distrib_optimizer.py",
    "optimizer/optimizer.py",
    "optimizer/optimizer_config.py",
    "optimizer_param_scheduler.py",
    "parallel_state.py",
    "pipeline_parallel/fine_grained_activation_offload.py",
    "pipeline_parallel/p2p_communication.py",
    "pipeline_parallel/schedules.py",
    "pipeline_parallel/utils.py",
    "process_groups_config.py",
    "rerun_state_machine.py",
    "tensor_parallel/cross_entropy.py",
    "tensor_parallel/layers.py",
    "tensor_parallel/mappings.py",
    "tensor_parallel/random.py",
    "tensor_parallel/utils.py",
    "transformer/attention.py",
    "transformer/cuda_graphs.py",
    "transformer/dot_product_attention.py",
    "transformer/identity_op.py",
    "transformer/mlp.py",
    "transformer/module.py",
    "transformer/spec_utils.py",
    "transformer/transformer_block.py",
    "transformer/transformer_config.py",
    "transformer/transformer_layer.py",
    "transformer/utils.py",
    "typed_torch.py",
    "utils.py",
)
"""megatron-core files (relative to ``megatron/core``) that run during CPU training (see above)."""


@dataclass(frozen=True)
class Site:
    """One CUDA call line in one file: ``path`` relative to ``megatron/core``, 1-based ``lineno``."""

    path: str
    lineno: int
    text: str


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers covered by string-only expression statements (docstrings and the like)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def code_lines(source: str) -> list[str]:
    """``source`` split into lines with comments removed and docstring lines emptied."""
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    for lineno in _docstring_lines(ast.parse(source)):
        lines[lineno - 1] = ""
    return lines


def find_sites(source: str) -> list[tuple[int, str]]:
    """``(lineno, stripped code)`` for every line of ``source`` that matches ``CUDA_SITE``."""
    return [
        (i, line.strip())
        for i, line in enumerate(code_lines(source), start=1)
        if CUDA_SITE.search(line)
    ]


def scan(mcore_root: str | Path, modules: tuple[str, ...] = MODULES) -> dict[str, dict[str, int]]:
    """``{module: {stripped line: count}}`` for ``modules`` under ``mcore_root`` (the directory of
    ``megatron/core``). Raises FileNotFoundError naming a module that is not there."""
    root = Path(mcore_root)
    result: dict[str, dict[str, int]] = {}
    for module in modules:
        sites = find_sites((root / module).read_text())
        result[module] = dict(sorted(Counter(text for _, text in sites).items()))
    return result


def new_sites(
    mcore_root: str | Path,
    snapshot: dict[str, dict[str, int]] | None = None,
    modules: tuple[str, ...] = MODULES,
) -> list[Site]:
    """Sites of the installed megatron-core that ``snapshot`` does not account for: a line text
    that is new, or more copies of a known one (then every copy is listed, since which one is new
    cannot be told). Sites that disappeared are not reported (see ``removed_sites``)."""
    snapshot = SNAPSHOT if snapshot is None else snapshot
    root = Path(mcore_root)
    found: list[Site] = []
    for module in modules:
        sites = find_sites((root / module).read_text())
        known = snapshot.get(module, {})
        counts = Counter(text for _, text in sites)
        found.extend(
            Site(module, lineno, text)
            for lineno, text in sites
            if counts[text] > known.get(text, 0)
        )
    return found


def removed_sites(
    mcore_root: str | Path,
    snapshot: dict[str, dict[str, int]] | None = None,
    modules: tuple[str, ...] = MODULES,
) -> dict[str, dict[str, int]]:
    """``{module: {line: copies gone}}``: snapshot sites no longer in the installed megatron-core."""
    snapshot = SNAPSHOT if snapshot is None else snapshot
    current = scan(mcore_root, modules)
    gone: dict[str, dict[str, int]] = {}
    for module in modules:
        now = current[module]
        lost = {
            t: n - now.get(t, 0) for t, n in snapshot.get(module, {}).items() if n > now.get(t, 0)
        }
        if lost:
            gone[module] = lost
    return gone


def describe_new_sites(version: str, sites: list[Site]) -> str:
    """The failure message for ``sites`` found in megatron-core ``version``."""
    listing = "\n".join(f"  megatron/core/{s.path}:{s.lineno}: {s.text}" for s in sites)
    return (
        f"megatron-core {version} has CUDA call sites the CPU backend was not checked against; "
        "review megascale/parallel/cpu_backend.py and regenerate "
        "megascale/parallel/mcore_cuda_sites.py "
        "(python -m megascale.parallel.mcore_cuda_sites --write):\n" + listing
    )


def _literal(text: str) -> str:
    """``repr`` with the quotes ``ruff format`` prefers (double, unless the text holds one)."""
    r = repr(text)
    return f'"{r[1:-1]}"' if r.startswith("'") and '"' not in text else r


def render(version: str, snapshot: dict[str, dict[str, int]]) -> str:
    """The Python source of the snapshot block (what sits between the markers of this file)."""
    out = [f'MCORE_VERSION = "{version}"', "", "SNAPSHOT: dict[str, dict[str, int]] = {"]
    for module, sites in snapshot.items():
        if not sites:
            out.append(f"    {_literal(module)}: {{}},")
            continue
        out.append(f"    {_literal(module)}: {{")
        out.extend(f"        {_literal(text)}: {count}," for text, count in sites.items())
        out.append("    },")
    out.append("}")
    return "\n".join(out) + "\n"


_BEGIN, _END = "# BEGIN SNAPSHOT", "# END SNAPSHOT"


def main(argv: list[str] | None = None) -> int:
    """Print (or with ``--write`` install) the snapshot of the installed megatron-core."""
    parser = argparse.ArgumentParser(prog="python -m megascale.parallel.mcore_cuda_sites")
    parser.add_argument("--write", action="store_true", help="rewrite the block in this file")
    args = parser.parse_args(argv)
    import megatron.core

    block = render(megatron.core.__version__, scan(Path(megatron.core.__file__).parent))
    if not args.write:
        sys.stdout.write(block)
        return 0
    this = Path(__file__)
    text = this.read_text()
    head, rest = text.split(_BEGIN + "\n", 1)
    _, tail = rest.split(_END + "\n", 1)
    this.write_text(f"{head}{_BEGIN}\n{block}{_END}\n{tail}")
    return 0


# The snapshot, generated by main(); do not edit by hand.
# BEGIN SNAPSHOT
MCORE_VERSION = "0.16.1"

SNAPSHOT: dict[str, dict[str, int]] = {
    "_rank_utils.py": {},
    "config_logger.py": {},
    "datasets/blended_dataset.py": {},
    "datasets/blended_megatron_dataset_builder.py": {
        "num_workers *= min(2, max(1, torch.cuda.device_count()))": 1,
    },
    "datasets/blended_megatron_dataset_config.py": {},
    "datasets/gpt_dataset.py": {},
    "datasets/helpers.py": {},
    "datasets/indexed_dataset.py": {},
    "datasets/megatron_dataset.py": {},
    "datasets/object_storage_utils.py": {},
    "datasets/utils.py": {},
    "distributed/data_parallel_base.py": {},
    "distributed/distributed_data_parallel.py": {
        "communication_stream = torch.cuda.Stream(device=torch.cuda.current_device())": 1,
        "torch.cuda.empty_cache()": 1,
        "torch.cuda.synchronize()": 2,
    },
    "distributed/distributed_data_parallel_config.py": {
        '"with nccl_ub due to compatibility issue with torch.cuda.MemPool API."': 1,
    },
    "distributed/finalize_model_grads.py": {},
    "distributed/param_and_grad_buffer.py": {
        "device=torch.cuda.current_device(),": 3,
        "self.communication_stream.wait_stream(torch.cuda.default_stream())": 1,
        "self.param_data_cpu = self.param_data.cpu().pin_memory()": 1,
        "stream_context = torch.cuda.stream(self.communication_stream)": 1,
        'tmp_warmup_tensor = torch.zeros([1], device="cuda")': 1,
        "torch.cuda.default_stream().wait_stream(self.communication_stream)": 1,
    },
    "fp8_utils.py": {
        'dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device="cuda")': 2,
    },
    "fusions/fused_bias_dropout.py": {},
    "fusions/fused_softmax.py": {},
    "model_parallel_config.py": {},
    "msc_utils.py": {},
    "models/backends.py": {},
    "models/common/embeddings/language_model_embedding.py": {},
    "models/common/embeddings/rope_utils.py": {
        ").cuda(non_blocking=True)": 1,
        '[cp_rank, (2 * cp_size - cp_rank - 1)], device="cpu", pin_memory=True': 1,
    },
    "models/common/embeddings/rotary_pos_embedding.py": {
        "device = 'cpu' if use_cpu_initialization else torch.cuda.current_device()": 1,
        "self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())": 1,
        "torch.arange(0, dim, 2, dtype=torch.float32, device=torch.cuda.current_device())": 1,
    },
    "models/common/embeddings/yarn_rotary_pos_embedding.py": {
        "device = 'cpu' if use_cpu_initialization else torch.cuda.current_device()": 1,
        "self.inv_freq_extra = self.inv_freq_extra.to(device=torch.cuda.current_device())": 1,
        "self.inv_freq_inter = self.inv_freq_inter.to(device=torch.cuda.current_device())": 1,
    },
    "models/common/language_module/language_module.py": {
        "weight.data = weight.data.cuda()": 1,
    },
    "models/gpt/gpt_layer_specs.py": {},
    "models/gpt/gpt_model.py": {
        "device=torch.cuda.current_device(),": 1,
    },
    "optimizer/__init__.py": {},
    "optimizer/clip_grads.py": {
        "assert param.grad.type() == 'torch.cuda.FloatTensor'": 1,
        "dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device='cuda')": 2,
        "grad_norm = torch.zeros(1, dtype=torch.float, device='cuda')": 1,
        "total_norm_cuda = torch.tensor([float(total_norm)], dtype=torch.float, device='cuda')": 1,
        "total_num_zeros = torch.zeros(1, dtype=torch.float, device='cuda')": 1,
    },
    "optimizer/distrib_optimizer.py": {
        "'torch.cuda.BFloat16Tensor. '": 1,
        "'torch.cuda.FloatTensor,  '": 1,
        "'torch.cuda.HalfTensor, or '": 1,
        "(numel,), dtype=dtype, device=torch.cuda.current_device()": 1,
        'device = "cpu" if use_gloo_comm else torch.cuda.current_device()': 1,
        "elif model_param.type() == 'torch.cuda.FloatTensor':": 1,
        "if model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:": 1,
        "if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:": 1,
        "send_tensor = send_tensor.cuda()": 1,
    },
    "optimizer/optimizer.py": {
        "'torch.cuda.BFloat16Tensor. '": 1,
        "'torch.cuda.FloatTensor,  '": 1,
        "'torch.cuda.HalfTensor, or '": 1,
        "elif param.type() == 'torch.cuda.FloatTensor':": 1,
        "if isinstance(p, torch.Tensor) and not p.is_cuda:": 1,
        "if isinstance(p, torch.Tensor) and p.is_cuda:": 1,
        "if isinstance(v, torch.Tensor) and not v.is_cuda:": 1,
        "if isinstance(v, torch.Tensor) and v.is_cuda:": 1,
        "if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:": 1,
        "p.data = p.data.cuda()": 1,
        "return torch.tensor([1.0], dtype=torch.float32, device=torch.cuda.current_device())": 1,
        "self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device='cuda')": 1,
        "self._scale = torch.tensor([1.0], dtype=torch.float, device='cuda')": 1,
        "self._scale_one = torch.tensor([1.0], dtype=torch.float, device='cuda')": 1,
        "self.found_inf = torch.tensor([0.0], dtype=torch.float, device='cuda')": 1,
        "state_dict[k] = v.cuda()": 1,
        "torch.cuda.empty_cache()": 1,
    },
    "optimizer/optimizer_config.py": {},
    "optimizer_param_scheduler.py": {},
    "parallel_state.py": {
        "device_ids=[torch.cuda.current_device()],": 2,
        "torch.cuda.synchronize()": 3,
    },
    "pipeline_parallel/fine_grained_activation_offload.py": {
        "cur_stream = torch.cuda.current_stream()": 1,
        "def __init__(self, device: str = 'cuda', pin_memory: bool = False):": 1,
        "def fine_grained_offloading_backward_record(tensor, event: torch.cuda.Event) -> torch.Tensor:": 1,
        "def fine_grained_offloading_forward_record(event: torch.cuda.Event) -> None:": 1,
        "def forward(ctx, tensor, event: torch.cuda.Event) -> torch.Tensor:": 1,
        "def forward_record(event: torch.cuda.Event) -> None:": 1,
        "def offload(self, src_tensor, pin_memory=True, use_cpu_pool=True):": 1,
        "if torch.cuda.is_available():": 1,
        "reloading_group.wait_reload_event(torch.cuda.current_stream())": 1,
        'self._cpu_tensor_pool = GPUTensorPool(device="cpu", pin_memory=True)': 1,
        "self._d2h_stream = torch.cuda.Stream()": 1,
        "self._h2d_stream = torch.cuda.Stream()": 1,
        "self._offload_event = torch.cuda.Event()": 1,
        "self._reload_event = torch.cuda.Event()": 1,
        "self.d2h_stream.wait_stream(torch.cuda.current_stream())": 1,
        "self.h2d_stream.wait_stream(torch.cuda.current_stream())": 1,
        "torch.cuda.current_stream().record_event(ctx.event)": 1,
        "torch.cuda.current_stream().record_event(event)": 2,
        "torch.cuda.current_stream().wait_stream(d2h_stream)": 2,
        "torch.cuda.current_stream().wait_stream(h2d_stream)": 1,
        "torch.cuda.empty_cache()": 1,
        "torch.cuda.nvtx.range_pop()": 2,
        'torch.cuda.nvtx.range_push("activation offloading " + group_to_offload._name)': 1,
        'torch.cuda.nvtx.range_push("activation reloading " + group_to_reload._name)': 1,
        "with torch.cuda.stream(self.d2h_stream):": 1,
        "with torch.cuda.stream(self.h2d_stream):": 1,
    },
    "pipeline_parallel/p2p_communication.py": {
        "(3,), device=torch.cuda.current_device(), dtype=torch.int64": 2,
        "device=torch.cuda.current_device(),": 2,
        "tensor_send_next.size(), device=torch.cuda.current_device(), dtype=torch.int64": 1,
        "tensor_send_prev.size(), device=torch.cuda.current_device(), dtype=torch.int64": 1,
        "torch.cuda.synchronize()": 2,
    },
    "pipeline_parallel/schedules.py": {
        'context_manager = torch.autocast("cuda", dtype=config.autocast_dtype)': 1,
        'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")': 3,
    },
    "pipeline_parallel/utils.py": {
        'comm_stream = torch.cuda.Stream(device="cuda")': 1,
        "comp_stream = torch.cuda.current_stream()": 1,
        "event: torch.cuda.Event,": 1,
        "import cuda.bindings.driver as cuda_driver": 1,
        "import cuda.bindings.runtime as cuda_runtime": 1,
        "import cuda.cuda as cuda_driver": 1,
        "import cuda.cudart as cuda_runtime": 1,
        "stream: torch.cuda.Stream,": 1,
        "torch.cuda.nvtx.range_pop()": 2,
        'torch.cuda.nvtx.range_push(f"{self.name} backward")': 1,
        'torch.cuda.nvtx.range_push(f"{self.name} forward")': 1,
        "with torch.cuda.stream(self.stream):": 2,
    },
    "process_groups_config.py": {},
    "rerun_state_machine.py": {
        '"cuda_rng_state": torch.cuda.get_rng_state(),': 1,
        "device = torch.cuda.current_device()": 1,
        "device: int = torch.cuda.current_device()": 3,
        "self.suspicious_device = torch.cuda.current_device()": 1,
        'torch.cuda.set_rng_state(rng_state["cuda_rng_state"])': 1,
        "val_tensor: torch.Tensor = torch.tensor([value], dtype=torch.int32, device='cuda')": 1,
        "val_tensor: torch.Tensor = torch.tensor(value, dtype=torch.int32, device='cuda')": 1,
    },
    "tensor_parallel/cross_entropy.py": {},
    "tensor_parallel/layers.py": {
        'custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")': 1,
        "custom_bwd = torch.cuda.amp.custom_bwd": 2,
        'custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")': 1,
        "custom_fwd = torch.cuda.amp.custom_fwd": 2,
        "device=torch.cuda.current_device(),": 7,
        "dim_size, dtype=input.dtype, device=torch.cuda.current_device(), requires_grad=False": 1,
    },
    "tensor_parallel/mappings.py": {
        "device=torch.cuda.current_device(),": 1,
        "output = torch.empty(dim_size, dtype=input_.dtype, device=torch.cuda.current_device())": 4,
    },
    "tensor_parallel/random.py": {
        "_C._cuda_setRNGState(new_state)": 1,
        "default_generator = torch.cuda.default_generators[idx]": 2,
        'device = torch.device("cuda", device)': 1,
        "device = torch.device('cuda')": 1,
        "device = torch.device('cuda', device)": 1,
        'device: Union[int, str, torch.device] = "cuda", clone: bool = False, graph_safe: bool = False': 1,
        "from torch.cuda import _lazy_call, _lazy_init": 1,
        "from torch.cuda import device as device_ctx_manager": 1,
        'hasattr(torch.cuda.CUDAGraph, "register_generator_state")': 1,
        "idx = torch.cuda.current_device()": 2,
        "if hasattr(_C, '_cuda_setRNGState') and callable(_C._cuda_setRNGState):": 1,
        "orig_rng_state = torch.cuda.get_rng_state()": 1,
        "return torch.cuda.random.get_rng_state(device=device)": 1,
        "self.states_[name] = torch.cuda.get_rng_state()": 1,
        "torch.cuda.manual_seed(data_parallel_seed)": 1,
        "torch.cuda.manual_seed(seed)": 1,
    },
    "tensor_parallel/utils.py": {
        "device=torch.cuda.current_device(),": 1,
        "numel_gathered, dtype=tensor.dtype, device=torch.cuda.current_device(), requires_grad=False": 1,
    },
    "transformer/attention.py": {
        "device=torch.cuda.current_device(),": 1,
    },
    "transformer/cuda_graphs.py": {
        "CudaGraphManager.global_mempool = torch.cuda.graph_pool_handle()": 1,
        "default_gen = torch.cuda.default_generators[device_idx]": 1,
        "for device_idx in range(torch.cuda.device_count()):": 1,
        "if torch.cuda.get_device_capability()[0] < 10:": 1,
        "mem_stats = torch.cuda.memory_stats()": 1,
        "mem_stats_end = torch.cuda.memory_stats()": 1,
        "mem_stats_start = torch.cuda.memory_stats()": 1,
        "self.bwd_graph = torch.cuda.CUDAGraph()": 1,
        "self.fwd_graph = torch.cuda.CUDAGraph()": 1,
        "torch.cuda.empty_cache()": 4,
        "torch.cuda.set_stream(torch.cuda.Stream())": 1,
        "torch.cuda.set_stream(torch.cuda.default_stream())": 1,
        "torch.cuda.synchronize()": 1,
        "with torch.cuda.graph(": 1,
        "with torch.cuda.graph(self.bwd_graph, pool=self.mempool):": 1,
    },
    "transformer/dot_product_attention.py": {
        "device=torch.cuda.current_device(),": 2,
    },
    "transformer/identity_op.py": {},
    "transformer/mlp.py": {
        "except (RuntimeError, torch.cuda.OutOfMemoryError) as e:": 1,
        "torch.cuda.empty_cache()": 1,
    },
    "transformer/module.py": {
        "_BF16_TYPES = (torch.BFloat16Tensor, torch.cuda.BFloat16Tensor)": 1,
        "_FLOAT_TYPES = (torch.FloatTensor, torch.cuda.FloatTensor)": 1,
        "_HALF_TYPES = (torch.HalfTensor, torch.cuda.HalfTensor)": 1,
        "device=torch.cuda.current_device(),": 1,
    },
    "transformer/spec_utils.py": {},
    "transformer/transformer_block.py": {},
    "transformer/transformer_config.py": {
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False": 1,
    },
    "transformer/transformer_layer.py": {
        ".to(torch.cuda.current_device())": 1,
        "device=torch.cuda.current_device(),": 1,
    },
    "transformer/utils.py": {
        'm = torch.ones(sq, skv, dtype=torch.bool, device="cuda")': 1,
        'return torch.triu(torch.ones(sq, sq, device="cuda"), diagonal=1).bool()': 1,
    },
    "typed_torch.py": {},
    "utils.py": {
        "clock = torch.cuda.clock_rate()": 1,
        'cu_seqlens_kv=torch.tensor([0, sample_length], device="cuda", pin_memory=True),': 1,
        'cu_seqlens_kv_padded=torch.tensor([0, sample_length], device="cuda", pin_memory=True),': 1,
        'cu_seqlens_q=torch.tensor([0, sample_length], device="cuda", pin_memory=True),': 1,
        'cu_seqlens_q_padded=torch.tensor([0, sample_length], device="cuda", pin_memory=True),': 1,
        "device=torch.cuda.current_device(),": 1,
        "eev = torch.cuda.Event(enable_timing=True)": 1,
        "if torch.cuda.is_available():": 1,
        'l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda")': 1,
        "local_param_hashes = torch.stack(local_param_hashes).cuda()": 1,
        "power = torch.cuda.power_draw()": 1,
        "self.dev = torch.cuda.current_device()": 1,
        "self.evt_q.put(torch.cuda.Event(enable_timing=True))": 1,
        "self.start_data_ev: List[torch.cuda.Event] = []": 1,
        "self.start_gemm_ev: List[torch.cuda.Event] = []": 1,
        "self.stop_data_ev: List[torch.cuda.Event] = []": 1,
        "self.stop_gemm_ev: List[torch.cuda.Event] = []": 1,
        "self.symm_buffer = symm_mem.empty(numel, dtype=torch.uint8, device='cuda')": 1,
        "sev = torch.cuda.Event(enable_timing=True)": 1,
        "temp = torch.cuda.temperature()": 1,
        "torch.cuda.nvtx.range_pop()": 1,
        "torch.cuda.nvtx.range_push(msg)": 1,
        "torch.cuda.synchronize()": 1,
        "util = torch.cuda.utilization()": 1,
    },
}
# END SNAPSHOT


if __name__ == "__main__":
    raise SystemExit(main())
