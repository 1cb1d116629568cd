"""JobConfig: one small dataclass per subsystem.

Precedence, highest first: ``--set section.key=value`` overrides > the TOML file > the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: each layer's weights are split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; > 1 selects interleaved 1F1B."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations along the sequence over the TP group (needs tp > 1)."""
    dp: int | None = None
    """Data-parallel size. Derived as world_size / (tp * pp); when given it is checked against that."""
    distributed_optimizer: bool = True
    """Shard optimizer state and fp32 main weights over the data-parallel group (ZeRO-1)."""
    batch_p2p_comm: bool = True
    """Batch pipeline sends/receives into one call. Refused with pp == 2 and vpp > 1 on gloo."""


@dataclass
class ModelConfig:
    num_layers: int = 4
    """Transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (plain multi-head)."""
    ffn_hidden_size: int | None = None
    """Width of the MLP; None means 4 * hidden_size."""
    seq_length: int = 64
    """Tokens per sample."""
    vocab_size: int = 256
    """Vocabulary size before padding to a multiple of 128 * tp for the embedding split."""
    parallel_block: bool = False
    """MegaScale's parallel transformer block: y = x + Attn(LN(x)) + MLP(LN(x))."""
    window_size: int | None = None
    """Sliding-window attention: each token sees itself and the window_size - 1 tokens before it.
    None means full causal attention."""
    swiglu: bool = False
    """Gated SiLU MLP (two input projections) instead of GeLU."""
    spec: str = "auto"
    """Layer implementation: "te" (Transformer Engine), "local" (megatron-core's own modules),
    or "auto" (TE when it imports and the device is CUDA, local otherwise)."""
    params_dtype: str = "fp32"
    """Training precision: "fp32" or "bf16" (bf16 needs CUDA)."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""


@dataclass
class OptimConfig:
    name: str = "adam"
    """"adam" (AdamW) or "lamb"."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass
class TrainConfig:
    steps: int = 50
    """Optimizer steps to run."""
    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 2
    """Samples per forward/backward pass on one rank."""
    seed: int = 1234
    """Seeds parameter initialisation, dropout and data order."""
    device: str = "auto"
    """"cpu", "cuda", or "auto" (CUDA when available)."""
    log_interval: int = 1
    """Steps between progress lines."""


@dataclass
class DataConfig:
    path: str | None = None
    """Token file prefix (``PREFIX.bin``/``PREFIX.idx``) made by ``megascale data build``; None uses
    the corpus that ships with the package."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Steps between checkpoints; 0 disables periodic checkpoints."""
    keep: int = 2
    """How many complete checkpoints to keep."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory when there is one."""


@dataclass
class JobConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
