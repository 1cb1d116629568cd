"""Which in-memory snapshot the ranks restore after a fault (``memory_snapshot.restore_plan``):
the newest step within every rank's reach -- its own snapshot, or the copy its peer on the next
node holds -- and never one older than the newest complete checkpoint."""

from megascale.train.memory_snapshot import restore_plan


def own(*steps, held=None):
    return {"own": list(steps), "held": held or {}}


def test_every_rank_restores_its_own_newest_snapshot():
    step, reach = restore_plan([own(4, 5, held={1: [4, 5]}), own(4, 5, held={0: [4, 5]})], 0)
    assert step == 5 and reach[0][5] == 0 and reach[1][5] == 1


def test_a_new_process_takes_its_peers_copy_and_a_copy_in_flight_does_not_count():
    # rank 1 was killed after its snapshot of step 5, before the copy reached rank 0: both go
    # back to step 4, rank 1 from rank 0's memory
    step, reach = restore_plan([own(4, 5, held={1: [3, 4]}), own()], None)
    assert step == 4 and reach[0][4] == 0 and reach[1][4] == 0


def test_a_lost_node_comes_back_from_the_next_nodes_copies():
    # 2 nodes x 2 ranks: ranks 2 and 3 (node-1) are new; ranks 0 and 1 hold their copies
    everyone = [own(6, 7, held={2: [6, 7]}), own(6, 7, held={3: [6, 7]}), own(), own()]
    step, reach = restore_plan(everyone, 5)
    assert step == 7 and [reach[r][7] for r in range(4)] == [0, 1, 0, 1]


def test_no_plan_when_a_rank_and_the_holder_of_its_copy_are_both_gone():
    assert restore_plan([own(), own(), own(6, held={1: [6]}), own(6, held={2: [6]})], None) is None


def test_no_plan_when_a_checkpoint_is_newer_than_every_common_snapshot():
    assert restore_plan([own(4, 5, held={1: [4, 5]}), own(4, 5, held={0: [4, 5]})], 6) is None
    assert restore_plan([own(4, 5, held={1: [4, 5]}), own(4, 5, held={0: [4, 5]})], 5)[0] == 5
