"""Bad arguments to the communicator fail before anything is sent, naming the rank and what is wrong."""

import pytest
import torch

import gossip


def _raises(fn, error, match):
    def run(comm):
        if comm.rank == 0:
            with pytest.raises(error, match=match):
                fn(comm)

    gossip.simulate(2, run, timeout=5.0)


def test_peer_outside_the_world():
    _raises(
        lambda c: c.exchange([(2, torch.zeros(1))], []), ValueError, r"rank 0: send to peer 2 is not a rank in \[0, 2\)"
    )


def test_exchange_with_itself():
    _raises(lambda c: c.exchange([], [(0, torch.zeros(1))]), ValueError, "cannot receive from itself")


def test_non_contiguous_buffer():
    _raises(lambda c: c.exchange([(1, torch.zeros(4, 4).T)], []), ValueError, "not contiguous")


def test_unsupported_dtype():
    _raises(lambda c: c.exchange([(1, torch.zeros(2, dtype=torch.complex64))], []), TypeError, "complex64")


def test_not_a_tensor():
    _raises(lambda c: c.exchange([(1, [1.0])], []), TypeError, "must be a torch.Tensor, got list")


def test_average_of_integers():
    _raises(lambda c: c.all_reduce(torch.zeros(2, dtype=torch.int64), "avg"), TypeError, "needs a floating-point")


def test_unknown_reduction():
    _raises(lambda c: c.all_reduce(torch.zeros(2), "max"), ValueError, "op 'max' is not one of")


def test_broadcast_from_outside_the_world():
    _raises(lambda c: c.broadcast(torch.zeros(2), src=5), ValueError, r"broadcast source 5 is not a rank")


def test_simulate_reraises_the_root_cause_not_the_peers_reaction():
    def run(comm):
        if comm.rank == 1:
            raise KeyError("boom on rank 1")
        comm.barrier()

    with pytest.raises(KeyError, match="boom on rank 1"):
        gossip.simulate(3, run, timeout=5.0)


def test_collectives_that_differ_across_ranks_are_refused():
    def run(comm):
        if comm.rank == 0:
            comm.barrier()
        else:
            comm.all_reduce(torch.zeros(1))

    with pytest.raises(gossip.ExchangeMismatchError, match="differs across ranks"):
        gossip.simulate(2, run, timeout=5.0)


def test_receive_posted_before_the_send_still_completes():
    def run(comm):
        peer = 1 - comm.rank
        got = torch.empty(3)
        handle = comm.exchange([], [(peer, got)], seq=1) if comm.rank == 0 else None
        comm.barrier()
        if comm.rank == 1:
            comm.exchange([(peer, torch.full((3,), 7.0))], [], seq=1).wait()
        else:
            handle.wait()
        return got

    assert torch.equal(gossip.simulate(2, run, timeout=5.0)[0], torch.full((3,), 7.0))


def test_receives_are_matched_in_posting_order_whichever_handle_is_waited_for_first():
    """As on MPI and Gloo: the k-th message from a peer fills the k-th receive posted for it. Waiting for the
    second exchange first must not hand it the first exchange's message (the two share a seq, as PowerGossip's
    round and the adaptive controller's sketch do)."""

    def run(comm):
        peer = 1 - comm.rank
        first, second = torch.empty(2), torch.empty(3)
        one = comm.exchange([(peer, torch.full((2,), 1.0 + comm.rank))], [(peer, first)], seq=5)
        two = comm.exchange([(peer, torch.full((3,), 10.0 + comm.rank))], [(peer, second)], seq=5)
        two.wait()
        one.wait()
        return first.tolist(), second.tolist()

    results = gossip.simulate(2, run, timeout=5.0)
    assert results[0] == ([2.0, 2.0], [11.0, 11.0, 11.0])
    assert results[1] == ([1.0, 1.0], [10.0, 10.0, 10.0])


# -- planned exchanges: checked once, posted at every step ----------------------------------------------------------
def test_a_planned_exchange_is_checked_when_it_is_planned():
    _raises(lambda c: c.plan_exchange([(1, torch.zeros(4, 4).T)], []), ValueError, "send to peer 1 is not contiguous")
    _raises(lambda c: c.plan_exchange([], [(0, torch.zeros(1))]), ValueError, "cannot receive from itself")


def test_planned_exchanges_deliver_and_book_what_exchange_does_at_every_step():
    """Three ranks, each planning its exchange with each peer once and posting the two plans joined at every step:
    each step delivers the peers' current values, and the bytes booked per peer and step are exchange()'s."""

    def run(comm):
        peers = [peer for peer in range(comm.size) if peer != comm.rank]
        sent = {peer: torch.zeros(3 + peer) for peer in peers}
        received = {peer: torch.zeros(3 + comm.rank) for peer in peers}
        plans = [comm.plan_exchange([(peer, sent[peer])], [(peer, received[peer])]) for peer in peers]
        joined = plans[0] + plans[1]
        ledgers, values = [], []
        for step in range(3):
            for peer in peers:
                sent[peer].fill_(100 * step + 10 * comm.rank + peer)  # new values in the same buffers
            traffic = gossip.Traffic()
            comm.start_planned(joined, seq=step, traffic=traffic).wait()
            ledgers.append((traffic.last_sent, traffic.last_received))
            values.append({peer: received[peer].tolist() for peer in peers})
        by_exchange = gossip.Traffic()
        comm.exchange([(p, sent[p]) for p in peers], [(p, received[p]) for p in peers], seq=3, traffic=by_exchange)
        return ledgers, values, (by_exchange.last_sent, by_exchange.last_received)

    for rank, (ledgers, values, by_exchange) in enumerate(gossip.simulate(3, run, timeout=10.0)):
        assert all(ledger == by_exchange for ledger in ledgers)
        assert by_exchange[0] == {peer: 4 * (3 + peer) for peer in range(3) if peer != rank}
        for step, got in enumerate(values):
            assert got == {peer: [100.0 * step + 10 * peer + rank] * (3 + rank) for peer in got}


def test_planned_exchanges_with_a_peer_in_common_are_not_joined():
    def run(comm):
        if comm.rank == 0:
            first = comm.plan_exchange([(1, torch.zeros(2))], [])
            second = comm.plan_exchange([(1, torch.zeros(3)), (2, torch.zeros(1))], [])
            with pytest.raises(ValueError, match=r"share peer\(s\) \[1\]; plan each peer's once"):
                first + second

    gossip.simulate(3, run, timeout=5.0)
