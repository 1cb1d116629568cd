"""``megascale report`` on a run whose loss diverged: the page renders, inf and nan shown as such
(marked off the chart's scale, named in its caption), never a crash."""

from __future__ import annotations

import json
import math

from megascale import cli


def _metrics(step: int, loss: float, grad_norm: float) -> dict:
    return {
        "schema": "1.0",
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": 1e-3,
        "step_time_s": 0.1,
        "tokens_per_s": 5000.0,
        "mfu": 0.03,
        "data_wait_s": 0.0,
        "compute_time_s": 0.09,
        "comm_time_s": {},
        "time": 1.0e9 + step,
    }


def test_a_run_whose_loss_reached_infinity_renders(tmp_path):
    losses = [5.5, 5.2, math.inf, math.nan, 4.9]
    lines = [json.dumps(_metrics(i + 1, loss, math.inf)) for i, loss in enumerate(losses)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")  # Infinity, NaN: as written

    assert cli.main(["report", str(tmp_path)]) == 0
    html = (tmp_path / "report.html").read_text()
    assert "Not finite at step 3 (inf), 4 (nan)." in html
    assert "loss at 3: inf</title>" in html and "loss at 4: nan</title>" in html
    assert 'class="v">4.9000<' in html  # the final loss card


def test_a_run_whose_every_loss_is_nan_renders(tmp_path):
    lines = [json.dumps(_metrics(i + 1, math.nan, math.nan)) for i in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert cli.main(["report", str(tmp_path)]) == 0
    assert 'class="v">nan<' in (tmp_path / "report.html").read_text()
