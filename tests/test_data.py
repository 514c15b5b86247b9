"""QuorumSampler: whatever the quorums and failures, the committed steps read the
sample stream in order, each sample once, none skipped."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.data import QuorumSampler

# One step of a job: (groups in the quorum, ranks per group, did it commit).
steps = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 3), st.booleans()), min_size=1, max_size=30
)


@given(steps, st.integers(1, 50), st.integers(1, 4), st.integers(0, 3))
def test_committed_steps_read_the_stream_once_in_order(job, num_samples, batch, seed):
    sampler = QuorumSampler(num_samples, batch, seed=seed)
    read: list[int] = []
    for groups, ranks, commits in job:
        step = [sampler.take(g, groups, r, ranks) for g in range(groups) for r in range(ranks)]
        if commits:
            sampler.advance()
            read += [i for part in step for i in part]
    assert read == sampler.stream(0, len(read))
    assert sampler.cursor == len(read)
    for epoch_start in range(0, len(read) - num_samples + 1, num_samples):
        assert sorted(read[epoch_start : epoch_start + num_samples]) == list(range(num_samples))


def test_a_healed_group_continues_from_its_peers_cursor():
    peer = QuorumSampler(100, 4, seed=1)
    for _ in range(5):
        peer.take(0, 2)
        peer.advance()
    healed = QuorumSampler(100, 4, seed=1)
    healed.load_state_dict(peer.state_dict())

    assert healed.cursor == peer.cursor == 40
    assert healed.take(1, 2) == peer.stream(44, 4)


def test_a_group_with_other_data_is_refused_with_the_fix():
    peer = QuorumSampler(100, 4, seed=1)
    with pytest.raises(ValueError, match="every group must use the same data and seed"):
        QuorumSampler(99, 4, seed=1).load_state_dict(peer.state_dict())


@pytest.mark.parametrize(
    ("args", "message"),
    [((0, 4), "at least one"), ((10, 0), "batch_size must be at least 1")],
)
def test_bad_arguments_name_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        QuorumSampler(*args)


def test_a_rank_outside_the_quorum_is_refused():
    with pytest.raises(ValueError, match="replica rank 2 outside a quorum of 2 groups"):
        QuorumSampler(10, 2).take(2, 2)
