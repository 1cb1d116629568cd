"""PP exposure from both ends of each message: only waits inside the modelled transfer count."""

from __future__ import annotations

import pytest

from megascale.overlap.pp_exposure import paired_exposure, receiver_side_exposure


def _send(peer, start, cost=1.0, wait=None, nbytes=8, **extra):
    wait_start, wait_end = wait or (None, None)
    event = {"kind": "isend", "peer": peer, "issued": start - 0.5, "transfer_start": start}
    event |= {"cost_s": cost, "nbytes": nbytes, "wait_start": wait_start, "wait_end": wait_end}
    return event | extra


def _recv(peer, wait=None, nbytes=8, exposed_s=0.0):
    wait_start, wait_end = wait or (None, None)
    return {
        "kind": "irecv",
        "peer": peer,
        "issued": 0.0,
        "cost_s": 0.0,
        "nbytes": nbytes,
        "wait_start": wait_start,
        "wait_end": wait_end,
        "exposed_s": exposed_s,
    }


def test_a_wait_for_a_sender_still_computing_counts_nothing():
    # Transfer [5, 6]; the receiver waited [2, 5] for the tensor to be computed, then got it
    # only after the transfer and a late rendezvous ([6, 6.4]): none of it is communication.
    early = [[_send(1, 5.0)], [_recv(0, wait=(2.0, 5.0))]]
    late = [[_send(1, 5.0)], [_recv(0, wait=(6.0, 6.4))]]
    assert paired_exposure(early) == [0.0, 0.0]
    assert paired_exposure(late) == [0.0, 0.0]


def test_both_ends_waiting_through_one_transfer_count_it_once_at_the_sender():
    events = [[_send(1, 5.0, wait=(5.0, 6.2))], [_recv(0, wait=(4.0, 6.5))]]
    assert paired_exposure(events) == pytest.approx([1.0, 0.0])


def test_a_partial_wait_counts_its_overlap_with_the_transfer():
    events = [[_send(1, 5.0, cost=2.0)], [_recv(0, wait=(6.5, 8.0))]]
    assert paired_exposure(events) == pytest.approx([0.5, 0.0])


def test_messages_pair_in_order_per_direction_and_fall_back_to_the_issue_time():
    rank0 = [
        _send(1, 1.0),  # activations 0 -> 1, first
        _recv(1, wait=(3.0, 3.25)),  # gradient 1 -> 0
        _send(1, 10.0, cost=0.5),  # activations 0 -> 1, second
    ]
    rank1 = [
        _recv(0, wait=(0.0, 1.5)),  # waits half of the first transfer [1, 2]
        _send(0, 3.0, transfer_start=None),  # window from its issue time: [2.5, 3.5]
        _recv(0, wait=(10.0, 10.5)),  # all of the second
    ]
    assert paired_exposure([rank0, rank1]) == pytest.approx([0.5 + 0.5, 0.25])


def test_unpaired_messages_are_refused_by_pair_and_count():
    with pytest.raises(ValueError, match=r"p2p 0 -> 1: 2 sends do not pair with 1 receives"):
        paired_exposure([[_send(1, 1.0), _send(1, 2.0)], [_recv(0)]])
    with pytest.raises(ValueError, match="bytes differ"):
        paired_exposure([[_send(1, 1.0, nbytes=8)], [_recv(0, nbytes=16)]])


def test_receiver_side_exposure_sums_what_the_trace_counted_for_uncoalesced_p2p():
    events = [_recv(0, exposed_s=0.3), _recv(0, exposed_s=0.2) | {"coalesced": True}]
    events.append({"kind": "all_reduce", "peer": None, "exposed_s": 5.0})
    assert receiver_side_exposure(events) == pytest.approx(0.3)


def test_covered_counts_the_union_inside_the_window_only():
    from megascale.overlap.pp_exposure import covered

    # Overlapping spans count once; a span wholly after the window adds nothing (not less).
    assert covered((0.0, 4.0), [(1.0, 2.0), (1.5, 3.0), (5.0, 6.0), (-2.0, -1.0)]) == 2.0
