"""The minimal built-in node self-check (``megascale agent --selfcheck builtin``): what every
node runs before it (re)joins when the full diagnostics one (``selfcheck.suite``) is not asked for.
The agent's zygote forks ``nproc`` processes of ``selfcheck_rank`` (``agent.zygote``)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any


def selfcheck_rank(rank: int, world_size: int, port: int, run_dir: Path) -> dict[str, Any]:
    """One process of the node's minimal self-check (the full one is
    ``megascale.agent.selfcheck``): a matmul checked against float64, a gloo all-reduce
    among the node's own ``world_size`` processes over loopback, and a 1 MiB write + read-back
    in the run directory. Returns ``{"ok", "detail", "seconds"}``."""
    import datetime

    import torch
    import torch.distributed as dist

    start, problems = time.perf_counter(), []
    device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    product = (a.float().to(device) @ a.float().to(device).T).double().cpu()
    error = float((product - a @ a.T).abs().max())
    if not error < 1e-2:
        problems.append(f"matmul on {device} is off by {error}")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        t = torch.full((4096,), float(rank + 1))
        dist.all_reduce(t)
        expected = world_size * (world_size + 1) / 2
        if not bool((t == expected).all()):
            problems.append(f"all-reduce gave {float(t[0])}, expected {expected}")
    finally:
        dist.destroy_process_group()
    scratch = Path(run_dir) / "selfcheck" / f"{socket.gethostname()}-{os.getpid()}.bin"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(1 << 20)
    with open(scratch, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    if scratch.read_bytes() != payload:
        problems.append(f"read back of {scratch} differs")
    scratch.unlink()
    seconds = round(time.perf_counter() - start, 3)
    return {"ok": not problems, "detail": "; ".join(problems) or "passed", "seconds": seconds}
