"""The job config's sections: one small dataclass per subsystem, each field with its default and a
docstring. ``JobConfig`` holds one of each; ``megascale.config`` loads, type-checks and writes them
(and is the import path to use: it re-exports every class here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megascale.config.compat import mirror_deprecated


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
    batch_p2p_comm: bool | None = None
    """Batch pipeline sends/receives into one call. None (auto): unbatched when ``overlap.pp``
    applies (interleaved schedule), batched otherwise. Refused with pp == 2 and vpp > 1 on gloo."""
    async_collectives: bool = False
    """CPU only: NCCL-like collectives. Every collective and p2p call returns at once and runs on a
    communication thread per process group, in issue order; the host blocks only where it uses a
    result (see ``megascale.parallel.async_comm``). Same numbers as the default (blocking gloo)."""

    def effective_batch_p2p_comm(self, overlap: OverlapConfig) -> bool:
        """What the schedule will do: ``overlap.pp`` needs individual asynchronous sends."""
        if self.batch_p2p_comm is None:
            return not overlap.pp_active(self)
        return self.batch_p2p_comm


@dataclass
class OverlapConfig:
    """MegaScale's communication/computation overlap; each applies where the layout supports it."""

    dp: bool = True
    """Data parallel: bucketed grad reduce-scatter during backward, param all-gather during forward
    (distributed optimizer), and the first all-gather prefetched at iteration start."""
    pp: bool = True
    """Pipeline parallel: sends/receives decoupled in warm-up and cool-down, asynchronous in the
    steady phase (interleaved 1F1B: megatron-core's overlap_p2p_comm; plain 1F1B:
    megascale.overlap.pp)."""
    tp: bool = True
    """Tensor/sequence parallel (needs sequence_parallel). Local layer spec: the serial block's
    attention and FFN all-gathers and reduce-scatters split into chunks pipelined with the GEMMs;
    the parallel block shares one all-gather and one reduce-scatter between attention and MLP,
    chunked and pipelined the same way. TE spec: Transformer Engine's userbuffers overlap (bf16,
    TE >= 1.9; ``megascale.overlap.tp_plan``)."""
    tp_chunks: int = 4
    """Chunks per pipelined GEMM for ``tp`` on the local spec; the per-rank sequence length must be
    divisible by it. More chunks shrink the unhidden first gather / last reduce-scatter (1/k of
    each) but make each GEMM and each collective smaller. On CPU 8 hid no more than 4 at small
    shapes, and more (76% / 73% against 71% / 66%) at 175B's TP bytes per FLOP
    (benchmarks/RESULTS.md)."""
    bucket_size: int | None = None
    """Parameters per DP bucket; None uses megatron-core's default (max(40M, 1M * dp)). Only the
    first model chunk is split into buckets (later chunks' grads are ready earlier), so with
    interleaving this sets that chunk's bucket count (``megascale-175b``: 453M parameters per chunk
    and GPU over the default 192M at DP192, about 2.4 buckets)."""

    def pp_active(self, parallel: ParallelConfig) -> bool:
        """Interleaved 1F1B with megatron-core's own p2p overlap."""
        return self.pp and parallel.pp > 1 and parallel.vpp > 1

    def pp_decoupled(self, parallel: ParallelConfig) -> bool:
        """Plain 1F1B with ``megascale.overlap.pp``'s decoupled, posted-ahead p2p. Only where p2p
        ops between two ranks do not run in issue order (gloo): on NCCL, and in the NCCL-like
        mode, a receive posted ahead of a send to the same peer waits on that peer's stream
        behind a send the peer itself waits for, and the pipeline deadlocks; there plain 1F1B
        keeps megatron-core's paired p2p (``megascale.parallel.parallelize``)."""
        return self.pp and parallel.pp > 1 and parallel.vpp == 1 and not parallel.async_collectives

    def tp_active(self, parallel: ParallelConfig) -> bool:
        return self.tp and parallel.tp > 1 and parallel.sequence_parallel and self.tp_chunks > 1


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
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm" (Llama's), for every norm of the model."""
    bias: bool = True
    """Biases on the linear layers (Llama has none: false)."""
    tie_embeddings: bool = True
    """One matrix for the input embedding and the output layer (GPT-2's); false gives the output
    layer its own (Llama's)."""
    rotary_base: int = 10000
    """RoPE's base (theta): 10,000 (GPT-NeoX, Llama 2), 500,000 (Llama 3)."""
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
    eval_interval: int = 0
    """Steps between validation-loss evaluations on the valid split (``data.split``); 0: none.
    The last step is evaluated too. ``val_loss`` appears in metrics.jsonl and the progress line."""
    eval_steps: int = 2
    """Global batches per evaluation: the same first ``eval_steps * global_batch_size`` samples of
    the valid split every time."""
    recompute: str = "none"
    """Activation recomputation: "none"; "selective" (the attention core's activations are
    recomputed in the backward pass, megatron-core's default module); "full" (whole layers, as
    ``recompute_method`` and ``recompute_num_layers`` say). MFU counts model FLOPs only; the
    recomputed ones count in HFU."""
    recompute_method: str = "uniform"
    """With ``recompute = "full"``: "uniform" (every group of ``recompute_num_layers`` layers keeps
    only its input) or "block" (the first ``recompute_num_layers`` layers of each pipeline stage
    are recomputed, the rest keep their activations)."""
    recompute_num_layers: int = 1
    """With ``recompute = "full"``: the layers per recomputed group (uniform) or per stage (block)."""
    peak_tflops: float | None = None
    """Dense TFLOP/s per device that MFU is measured against, on any device. None: on a GPU the
    dense bf16 peak of its name (an unknown GPU reports no MFU); on CPU a peak measured at start by
    a short matmul benchmark in ``model.params_dtype``, cached per machine
    (``megascale.probes.peak``). Every MFU figure is labelled with where its peak came from."""
    profile_steps: list[int] = field(default_factory=list)
    """``[first, last]``: record optimizer steps first to last (1-based, inclusive) with
    ``torch.profiler`` on the ranks of ``profile_ranks``, a Chrome trace in
    ``RUN_DIR/profile/rank_NNNNN.json`` (``megascale.probes.profiling``); a resumed run records
    the steps still ahead. []: off."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """The global ranks ``profile_steps`` records (Megatron-LM's ``--profile-ranks`` default:
    rank 0 only; one trace per rank is tens of MB). [] records every rank. Each must be below the
    world size (checked at start)."""
    memory_history: bool = False
    """CUDA only: record the caching allocator's history from the first step and dump it to
    ``RUN_DIR/profile/memory_rank_NNNNN.pickle`` (https://pytorch.org/memory_viz) at the end of the
    profile window, else after the first logged step, on every rank; a rank that runs out of CUDA
    memory dumps it to ``memory_rank_NNNNN_oom.pickle`` before the error propagates. Refused with
    device "cpu"; skipped (with a warning) when "auto" finds no GPU."""
    nvtx: bool = False
    """CUDA only: NVTX ranges for Nsight Systems (``nsys profile``) around each step
    (``megascale::train::step``), its forward/backward schedule
    (``megascale::schedule::forward_backward``) and its optimizer step
    (``megascale::optim::step``), the timeline's span names. Refused with device "cpu"; skipped
    (with a warning) when "auto" finds no GPU."""


@dataclass
class DataConfig:
    path: str | None = None
    """Prefix of a Megatron-LM indexed dataset (``PREFIX.bin``/``PREFIX.idx``, from Megatron's
    ``preprocess_data.py`` or ``megascale data build``); None (and no blend) uses the corpus that
    ships with the package."""
    blend: list[str] | None = None
    """Megatron-style blend instead of ``path``: ``["0.7", "PREFIX_A", "0.3", "PREFIX_B"]`` (weight
    then prefix), ``["PREFIX_A", "PREFIX_B"]`` (weighted by size), or a TOML table
    ``{PREFIX_A = 0.7, PREFIX_B = 0.3}``."""
    split: str = "98,1,1"
    """Train, valid and test shares of every dataset's documents (Megatron's ``--split``)."""
    cache_dir: str | None = None
    """Where megatron-core's sample/shuffle/blend index files are cached (built once per dataset
    by one rank per machine under a file lock, memory-mapped by every rank); None:
    ``RUN_DIR/data/index-cache``. Must be visible to all ranks."""
    loader: str = "node"
    """``"node"``: MegaScale's per-machine pipeline: one loader per machine reads the next step's
    samples into shared memory (``/dev/shm``) while the current step runs, and the machine's ranks
    copy their micro-batches from it. ``"rank"``: every rank reads its own samples when the step
    starts. Both give the same batches, bit for bit."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Steps between checkpoints; 0 disables periodic checkpoints."""
    keep: int = 2
    """How many complete checkpoints to keep."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory when there is one."""
    url: str | None = None
    """Where checkpoints are written and read: a directory or an fsspec URL (``file:///mnt/ckpt``;
    ``memory://ckpt`` for one process; ``s3://bucket/run`` once s3fs is installed). None:
    ``RUN_DIR/checkpoints``. A relative directory is taken relative to the run directory."""
    async_save: bool = True
    """Two-stage save: copy the state to host memory (training resumes at once), then write it in a
    background thread. false: write before training continues (the synchronous baseline)."""
    reshard: bool = True
    """Load a checkpoint saved with another parallel layout (TP, PP, VPP, DP, with or without the
    distributed optimizer) by resharding it. false: a run whose checkpoints were saved with another
    layout refuses to start (its checkpoints are left as they are)."""
    broadcast_on_load: bool = True
    """Checkpoints of the older layout-bound format (before resharding): on restart, one rank per
    data-parallel group reads the state its DP peers share and broadcasts it to them; false: every
    rank reads it from storage."""
    write_timeout_s: float = 600.0
    """How long rank 0's writer waits for every rank's files of one checkpoint before it gives up
    on writing that checkpoint's manifest (the checkpoint is then incomplete and never loaded)."""


@dataclass
class DiagnosticsConfig:
    """The per-rank timeline and the straggler analysis (``megascale.probes.timers``,
    ``megascale.tools.straggler``)."""

    timeline: bool = True
    """Record named segments (forward, backward, optimizer, DP/PP/TP communication, data loading,
    checkpoint) on every rank to ``RUN_DIR/timeline/rank_NNNNN.jsonl``, for ``megascale timeline``
    and ``megascale report``. CUDA events on GPU, never a host sync on the training thread."""
    flush_interval_steps: int = 10
    """Steps between hand-offs of the recorded segments to the background writer thread."""
    straggler_threshold: float | None = None
    """Deprecated, read as ``fault_tolerance.straggler_threshold``, which it mirrors."""
    selfcheck_thresholds: str | None = None
    """Thresholds file for the node self-check the agents run before (re)starting a job: a
    calibration written by ``megascale selfcheck --calibrate --output FILE`` on a healthy node of
    the same kind (thresholds = measured x its safety factor), optionally with explicit sections.
    A path on every node; relative to the run directory. None: the hardware profile's defaults."""
    straggler_action: str | None = None
    """Deprecated, read as ``fault_tolerance.straggler_action``, which it mirrors."""


@dataclass
class MetricsConfig:
    """Optional sinks for the per-step figures of ``metrics.jsonl`` (``probes.sinks``)."""

    tensorboard: bool = False
    """Write TensorBoard event files (needs the ``tensorboard`` package: ``megascale[tensorboard]``)."""
    tensorboard_dir: str = "tensorboard"
    """Where, relative to the run directory."""
    wandb: bool = False
    """Log to Weights & Biases (needs the ``wandb`` package: ``pip install 'megascale[wandb]'``)."""
    wandb_project: str = "megascale"
    """The W&B project; the run is named after the run directory."""
    wandb_mode: str = "online"
    """``"online"`` or ``"offline"`` (files under the run directory, ``wandb sync`` later)."""


@dataclass
class FaultToleranceConfig:
    """The fault-tolerance settings and their only defaults: lost nodes, restarts, stragglers,
    self-check. ``controller.policy.policy_for`` builds the controller's policy from it
    for ``megascale launch`` (its flags win), ``megascale controller`` (its flags override it)
    and the operator (``k8s.launch.fault_tolerance_settings`` maps the CRD onto it)."""

    policy: str = "wait"
    """A node is lost or evicted and no spare is registered: ``"wait"`` (for a replacement to
    register, up to ``node_wait_timeout_s``, then fail), ``"shrink"`` (restart at once on the
    nodes left with the largest data-parallel size the layout and the global batch allow; the
    global batch is kept by running more micro-batches per rank; the job grows back to its
    configured size at the next restart once enough nodes are registered) or ``"fail"``."""
    node_wait_timeout_s: float | None = None
    """Longest to wait for enough nodes (at start and under ``policy = "wait"``); none: no limit
    (``megascale launch`` uses 60 s when this is left out)."""
    max_restarts: int = 10
    """Restarts allowed within any ``restart_window_s``; the fault that would exceed it fails the
    job."""
    restart_window_s: float = 3600.0
    """The sliding window ``max_restarts`` counts restarts in (seconds)."""
    evict_repeat_culprit: int = 2
    """A node named culprit (a stall's suspect, the node of a failed rank) in this many faults is
    evicted even if its self-check passes; 1 evicts it at the first (``megascale launch``)."""
    straggler_threshold: float = 1.10
    """A rank, and the machine it runs on, is flagged as a straggler when its compute time per
    step (forward and backward compute measured on the device) is at least this many times the
    median of its pipeline-stage peers', persistently (live: ``straggler_consecutive`` windows;
    offline: median over steps, and in at least half of them). MegaScale found a machine 10%
    slower than its peers."""
    straggler_action: str = "report"
    """What the controller does about a persistent straggler: ``"report"`` (a ``straggler`` event
    and the dashboards' scores) or ``"evict"`` (also block the node and restart on a spare from
    the last checkpoint; with no spare registered the node is kept and that is recorded)."""
    straggler_window: int = 4
    """New compute times per rank (one per heartbeat with a new step) in the live sliding window."""
    straggler_consecutive: int = 3
    """Windows in a row a node must be slow to be recorded as a ``straggler`` event."""
    selfcheck_timeout_s: float = 300.0
    """Every node must report its self-check (after a fault) within this, or it is evicted."""
    selfcheck_tests: list[str] = field(default_factory=list)
    """Checks of ``megascale selfcheck`` the agents' full self-check runs: names (``gpu.matmul``),
    shell patterns (``net.*``) or groups (``gpu``, ``host``, ``net``/``network``); empty: all."""
    recovery: str = "in-process"
    """How a job under node agents recovers from a fault. ``"in-process"``: the healthy ranks
    keep their processes, models and optimizer state, pause, re-form the process groups with the
    replaced ranks and roll back to the last in-memory snapshot; only the failed ranks (or a
    spare's) are new processes, restored from a peer's copy. Where it cannot apply (no snapshot
    every rank can reach, a layout change, a rank that does not pause) the job restarts from the
    last checkpoint, as ``"restart"`` always does (every rank a new process). torchrun,
    ``megascale train``, ``parallel.async_collectives`` (whose communication threads cannot be
    aborted) and, for now, CUDA jobs (a rank blocked in an NCCL collective with a dead peer does not
    return until its communicator is aborted, which is not done yet) always restart."""
    snapshot_interval: int | None = None
    """In-process recovery: steps between in-memory snapshots of every rank's training state
    (the steps since the last one are redone after a fault); each is also copied to the host
    memory of a rank on the next node, so that a lost node's state comes back without reading
    storage. None: every step on CPU; on a GPU every ``checkpoint.interval`` steps (the copy to
    host memory runs beside the next step, which it still slows: 2.8% on one H100 for
    ``h100-1b``, ``benchmarks/recovery_cost.py --snapshot-only``; measure before setting 1)."""
    pause_timeout_s: float = 10.0
    """In-process recovery: longest a healthy rank may take to pause after a fault; one that does
    not (a wedged rank) is killed and comes back as a new process."""


@dataclass
class JobConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        mirror_deprecated(self)
