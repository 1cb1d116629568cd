"""CommTrace: a step's comm events and exposure, joined from the flight recorder's records
and the network model's side table (``megascale.overlap.trace_events``); its delayed handles."""

from megascale.overlap.trace_events import Ledger, Priced, step_events

S = 1_000_000_000  # ns per second


def _record(index, kind, issued, wait=None, coalesced=False):
    start, end = wait or (None, None)
    ns = lambda t: None if t is None else round(t * S)  # noqa: E731
    return (index, kind, coalesced, ns(issued), ns(start), ns(end))


def test_records_join_the_side_table_into_events_and_exposure():
    ledger = Ledger()
    ledger.busy["dp"] = [(10.0, 12.0)]
    ledger.busy["pp"] = [(20.0, 21.0)]
    ledger.comm_by_link.update(dp=2.0, pp=1.0)
    # a coalescing block of two reduce-scatters: one record, its ops in the side table
    ops = [Priced("reduce_scatter_tensor", "dp", 8, 1.0, 9.0 + i) for i in range(2)]
    ledger.side[0] = Priced("coalesced", "dp", 16, 2.0, 10.0, inner=ops, transfer_start=10.0)
    # a batch of a send and a receive: a record each, waited on from 20.5 to 21.5
    batch = Priced("batch_isend_irecv", "pp", 8, 1.0, 20.0)
    ledger.side[1] = Priced("isend", "pp", 4, 1.0, 20.0, peer=1, batch=batch)
    ledger.side[2] = Priced("irecv", "pp", 4, 0.0, 20.0, peer=1, batch=batch)
    # a receive on its own, waited 3 s for a message that costs 0.5 s: a late peer, mostly
    ledger.side[3] = Priced("irecv", "pp", 4, 0.0, 30.0, peer=1)
    ledger.side[4] = Priced("all_reduce", "tp", 4, 0.0, 40.0)  # record 4 is not an all-reduce
    ledger.drains.append((11.5, 12.5, "dp"))
    records = [
        _record(0, "reduce_scatter_tensor", 10.0, (10.0, 12.0), coalesced=True),
        _record(1, "isend", 20.0, (20.5, 21.5)),
        _record(2, "irecv", 20.0, (21.0, 21.5)),
        _record(3, "irecv", 30.0, (31.0, 34.0)),
        _record(4, "broadcast", 40.0, (40.0, 41.0)),
        _record(5, "barrier", 50.0, (50.0, 51.0)),  # not priced: not the model's call
    ]
    step = step_events(records, ledger, lambda nbytes, link: 0.5)

    kinds = [(e.kind, e.coalesced) for e in step.events]
    assert kinds == [
        ("reduce_scatter_tensor", True),
        ("reduce_scatter_tensor", True),
        ("coalesced", False),
        ("isend", True),
        ("batch_isend_irecv", False),
        ("irecv", True),
        ("irecv", False),
    ]
    inner, block = step.events[:2], step.events[2]
    assert [e.issued for e in inner] == [9.0, 10.0] and inner[0].wait_start is None
    assert (block.issued, block.wait_start, block.wait_end) == (10.0, 10.0, 12.0)
    assert block.exposed_s == 2.0 and block.transfer_start == 10.0
    grouped = step.events[4]
    assert (grouped.wait_start, grouped.wait_end) == (20.5, 21.5)
    assert grouped.exposed_s == 0.5 + 0.5  # both ops' waits, where the pp link was busy
    recv = step.events[6]
    assert recv.peer == 1 and recv.exposed_s == 0.5  # at most its message's cost
    assert step.exposed_s == 2.0 + 1.0 + 0.5 + 3.0 + 1.0  # every wait, and the drain
    assert step.exposed_by_link == {"dp": 2.0 + 0.5, "pp": 1.0 + 0.5}


def test_a_delayed_handle_offers_the_recorder_no_callback_to_block_on():
    """The flight recorder stands outside the network model: what its watcher looks up on a
    handle still on its communication thread is answered at once, not by waiting for the call."""
    import threading
    from concurrent.futures import Future

    from megascale.overlap.trace import _DelayedWork

    pending = Future()
    unblock = threading.Timer(5.0, pending.set_result, (None,))  # a wrong lookup ends, and fails
    unblock.start()
    try:
        work = _DelayedWork(pending, 0.0)
        assert (work.started, work.observe, work.get_future) == (None, None, None)
        assert not work.is_completed() and not pending.done()
    finally:
        unblock.cancel()
