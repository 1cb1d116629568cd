"""A full checkpoint disk is the job's storage, not a node: the agent reads a writer thread's
ENOSPC traceback as ``storage_full`` (not a ``traceback`` keyword against the node), and the
controller ends the job with the cause and evicts nobody."""

from __future__ import annotations

from test_controller_fsm import ack_all, records, running

from megascale.agent.logscan import LogScanner, error_kind
from megascale.controller.fsm import Evict, State

DCP_THREAD = """\
Exception in thread Thread-3 (_write):
Traceback (most recent call last):
  File "/usr/lib/python3.11/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "/venv/torch/distributed/checkpoint/filesystem.py", line 310, in _write_files_from_queue
    stream.write(data)
OSError: [Errno 28] No space left on device: '/ckpt/step_00000008/rank_00000/__0_0.distcp'
[rank 0] 2026-11-27 04:40:00 ERROR megascale.train.checkpoint.save: checkpoint step 8: write \
failed: No space left on device (ENOSPC): /ckpt/step_00000008/rank_00000/__0_0.distcp
"""


def test_a_writer_threads_enospc_traceback_is_storage_full_not_a_traceback(tmp_path):
    out = tmp_path / "rank_0.out"
    out.write_text("")
    scanner = LogScanner(out, paths=(str(tmp_path),))
    out.write_text(DCP_THREAD)
    kinds = {m.kind for m in scanner.scan()}
    assert kinds == {"storage_full"}
    assert error_kind("OSError: [Errno 122] Disk quota exceeded") == "storage_full"
    assert error_kind("RuntimeError: Traceback (most recent call last)") == "traceback"
    # a path or a name that merely holds the words is no fault
    assert error_kind("[rank 0] 2026-11-27 04:40:00 INFO x: wrote ENOSPC-test/ckpt") is None


def _fails_without_eviction(fsm, clock, out):
    fault = records(out, "fault")[0]
    assert fault.detail["fault"] == "job_fatal" and fault.detail["classified"].startswith(
        "storage full"
    )
    assert "No space left on device" in fault.detail["reason"]
    assert "no node is evicted" in fault.detail["reason"]
    out = ack_all(fsm, out, clock)  # every node stops
    assert not [a for a in out if isinstance(a, Evict)] and not fsm.blocklist
    assert fsm.state is State.FAILED and not fsm.culprits
    assert set(fsm.registered) == {"n0", "n1", "n2"}  # the spare was never used up


def test_a_storage_full_keyword_fails_the_job_and_evicts_nobody():
    fsm, clock = running()
    text = "OSError: [Errno 28] No space left on device"
    _fails_without_eviction(fsm, clock, fsm.on_storage_full("n0", 0, text, now=clock()))


def test_a_rank_exit_of_enospc_fails_the_job_and_evicts_nobody():
    fsm, clock = running()
    error = {
        "text": "CheckpointError: write failed: No space left on device (ENOSPC)",
        "signature": "s",
    }
    _fails_without_eviction(fsm, clock, fsm.on_worker_exit("n1", 2, 1, clock(), 1, None, error))


def test_a_storage_full_log_line_is_reported_as_its_message(tmp_path):
    out = tmp_path / "rank_0.out"
    out.write_text("")
    scanner = LogScanner(out)
    out.write_text(DCP_THREAD.splitlines()[-1] + "\n")  # megascale's own ERROR line
    [match] = scanner.scan()
    assert match.text.startswith("checkpoint step 8: write failed: No space left on device")
