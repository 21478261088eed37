"""PowerGossip batches equal-shape matrices: one bmm per group, one orthonormalisation per class, one message."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gossip
import topologies
from gossip.algorithms import powergossip
from gossip.algorithms.buckets import Entry, bucket_parameters
from gossip.algorithms.powergossip import PowerGossip, PowerGossipTuning
from gossip.algorithms.powergossip_factors import orthonormalize, orthonormalize_
from gossip.algorithms.powergossip_layout import Group, Matrix, Run, group_matrices, row_classes
from gossip.app.gpt import GPT, GPTConfig

CONFIG = GPTConfig(block_size=8, n_layer=3, n_head=2, n_embd=16)


def gpt_buckets(rank: int, bucket_bytes: int = 1 << 30) -> list:
    """A small GPT's parameters, different on every rank (drawn from a per-rank generator: the simulator's ranks
    are threads, which share torch's global generator)."""
    model, generator = GPT(CONFIG), torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return bucket_parameters(model, bucket_bytes)


def bound(comm: gossip.Communicator, **options) -> PowerGossip:
    """A rank-2 PowerGossip with ``options``; those of :class:`PowerGossipTuning` go into its ``tuning``."""
    names = {field.name for field in dataclasses.fields(PowerGossipTuning)}
    tuning = PowerGossipTuning(**{k: v for k, v in options.items() if k in names})
    options = {k: v for k, v in options.items() if k not in names}
    algorithm = PowerGossip(**{"rank": 2, "min_compression": 1, **options, "tuning": tuning})
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), gpt_buckets(comm.rank))
    return algorithm


def groups_of_a_gpt(comm: gossip.Communicator, bucket_bytes: int) -> list:
    algorithm = PowerGossip(rank=2, min_compression=1)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), gpt_buckets(comm.rank, bucket_bytes))
    members = [[algorithm.matrices[i].entry.name for i in g.members] for g in algorithm.groups]
    runs = [len(views) for views in algorithm._views]
    storages = {b.buffer.untyped_storage().data_ptr() for b in algorithm.buckets}
    views_are_the_parameters = [
        torch.equal(view, torch.stack([algorithm._matrix(algorithm.matrices[i]) for i in g.members[members_]]))
        and view.untyped_storage().data_ptr() in storages
        for g, views in zip(algorithm.groups, algorithm._views, strict=True)
        for members_, view in views
    ]
    return [members, runs, views_are_the_parameters]


@pytest.mark.parametrize(("bucket_bytes", "runs"), [(1 << 30, [1, 1, 1, 1, 1, 1]), (4096, [1, 1, 3, 3, 3, 3])])
def test_the_layers_of_a_gpt_form_one_group_per_role_viewed_without_copies(bucket_bytes, runs):
    members, got_runs, views_are_the_parameters = gossip.simulate(2, groups_of_a_gpt, bucket_bytes)[0]
    roles = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    blocks = [[f"blocks.{i}.{role}.weight" for i in range(3)] for role in roles]
    assert members == [["tok_emb.weight"], ["pos_emb.weight"], *blocks]
    assert got_runs == runs  # one bmm per group when the layers share a bucket, one per bucket otherwise
    assert all(views_are_the_parameters)


def test_a_run_ends_where_the_bucket_or_the_spacing_between_equal_matrices_changes():
    shape = torch.Size((4, 3))
    matrices = [
        Matrix(bucket=0, entry=Entry(f"layer.{i}.w", offset, shape), m=4, k=3)
        for i, offset in enumerate((0, 20, 40, 70))
    ]
    matrices.append(Matrix(bucket=1, entry=Entry("layer.4.w", 90, shape), m=4, k=3))
    matrices.append(Matrix(bucket=1, entry=Entry("other.w", 200, shape), m=4, k=3))  # another role: another group
    groups = group_matrices(matrices)
    assert [(g.members, [(r.bucket, r.offset, r.stride, r.count) for r in g.runs]) for g in groups] == [
        ((0, 1, 2, 3, 4), [(0, 0, 20, 3), (0, 70, 12, 1), (1, 90, 12, 1)]),
        ((5,), [(1, 200, 12, 1)]),
    ]


def steps_and_factors(comm: gossip.Communicator, steps: int, options: dict) -> dict:
    algorithm = bound(comm, **options)
    for step in range(steps):
        algorithm.step(step)
    total = torch.cat([b.buffer.double() for b in algorithm.buckets])
    comm.all_reduce(total)
    return {
        "buffers": [b.buffer.clone() for b in algorithm.buckets],
        "factors": {key: [t.clone() for t in e.p + e.q] for key, e in algorithm.edges.items()},
        "sum": total,
    }


def simulate_and_check_ends_and_sum(options: dict) -> list[dict]:
    """Five steps of 4 ranks: both ends of every edge hold bit-identical factors, and the sum is preserved."""
    initial = sum(torch.cat([b.buffer.double() for b in gpt_buckets(rank)]) for rank in range(4))
    results = gossip.simulate(4, steps_and_factors, 5, options)
    for rank, result in enumerate(results):
        for (lo, hi), factors in result["factors"].items():
            theirs = results[hi if rank == lo else lo]["factors"][(lo, hi)]
            assert all(torch.equal(a, b) for a, b in zip(factors, theirs, strict=True)), (rank, lo, hi)
    torch.testing.assert_close(results[0]["sum"], initial, rtol=0, atol=1e-5)
    return results


@pytest.mark.parametrize(
    "options",
    [
        {"orthonormalize_dtype": None},
        {"orthonormalize_dtype": torch.float64},
        {"orthonormalize_dtype": torch.float32},
        {"rank": 4, "orthonormalization": "qr"},
        {"rank": 4, "orthonormalization": "gram-schmidt"},
        {"rank": 4, "orthonormalization": "gram-schmidt", "pad_ratio": 4},  # CUDA's defaults
        {"message_dtype": torch.float16},
        {"message_dtype": torch.bfloat16, "num_iterations": 3},
    ],
)
def test_batched_groups_keep_both_ends_bit_identical_and_the_sum(options):
    simulate_and_check_ends_and_sum(options)


def test_batching_computes_what_the_matrix_by_matrix_path_computes(monkeypatch):
    batched = gossip.simulate(4, steps_and_factors, 5, {})
    monkeypatch.setattr(
        powergossip,
        "group_matrices",
        lambda matrices: [
            Group(
                m=m.m,
                k=m.k,
                members=(i,),
                runs=(Run(bucket=m.bucket, offset=m.entry.offset, stride=m.m * m.k, count=1),),
            )
            for i, m in enumerate(matrices)
        ],
    )
    one_by_one = gossip.simulate(4, steps_and_factors, 5, {})
    for a, b in zip(batched, one_by_one, strict=True):
        for x, y in zip(a["buffers"], b["buffers"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_batched_orthonormalize_equals_the_per_matrix_one_and_is_orthonormal():
    batch = torch.randn(5, 30, 4, generator=torch.Generator().manual_seed(0))
    together = orthonormalize(batch)
    for i in range(5):
        torch.testing.assert_close(together[i], orthonormalize(batch[i]), rtol=0, atol=1e-6)
        torch.testing.assert_close(together[i].T @ together[i], torch.eye(4), rtol=0, atol=1e-5)
    assert torch.equal(batch, torch.randn(5, 30, 4, generator=torch.Generator().manual_seed(0)))  # input untouched


def test_orthonormalize_runs_qr_on_the_cpu_and_agrees_with_gram_schmidt_up_to_signs():
    generator = torch.Generator().manual_seed(0)
    for r in (1, 2, 4):
        batch = torch.randn(3, 20, r, generator=generator)
        default = orthonormalize(batch)
        assert torch.equal(default, orthonormalize(batch, method="qr")), r
        other = orthonormalize(batch, method="gram-schmidt")
        # the same span, columns equal up to sign
        torch.testing.assert_close(default.abs(), other.abs(), rtol=0, atol=1e-5)
        torch.testing.assert_close(default.mT @ default, torch.eye(r).expand(3, r, r), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("method", "work"), [("qr", None), ("qr", torch.float64), ("gram-schmidt", None)])
def test_orthonormalize_in_place_writes_the_bits_orthonormalize_returns(dtype, method, work):
    """In place over a column-major batch (how PowerGossip's factors are viewed), with and without a triangle
    buffer given: QR in the matrix's own dtype runs in place, the other cases compute aside and copy back."""
    generator = torch.Generator().manual_seed(0)
    for rows, r in ((30, 4), (7, 1), (512, 4)):
        stored = torch.randn(3, r, rows, generator=generator, dtype=dtype)  # a factor stored transposed
        expected = orthonormalize(stored.mT, dtype=work, method=method)
        for triangle in (None, torch.empty(3, r, r, dtype=dtype)):
            factor = stored.clone()
            orthonormalize_(factor.mT, dtype=work, method=method, triangle=triangle)
            assert torch.equal(factor.mT, expected), (rows, r, triangle is None)
        row_major = stored.mT.contiguous()  # another layout (Gram-Schmidt's reductions may round differently)
        expected = orthonormalize(row_major, dtype=work, method=method)
        orthonormalize_(row_major, dtype=work, method=method)
        assert torch.equal(row_major, expected), (rows, r)


def test_an_orthonormalization_other_than_qr_or_gram_schmidt_is_refused():
    with pytest.raises(
        ValueError,
        match=r"PowerGossipTuning: orthonormalization must be None or one of \('qr', 'gram-schmidt'\), got 'svd'",
    ):
        PowerGossipTuning(orthonormalization="svd")


def test_an_orthonormalize_dtype_other_than_float32_or_float64_is_refused():
    message = r"orthonormalize_dtype must be None, torch.float32 or torch.float64, got torch.f"
    with pytest.raises(ValueError, match=message):
        PowerGossipTuning(orthonormalize_dtype=torch.float16)


def messages_of_first_step(comm: gossip.Communicator, algorithm: PowerGossip) -> list[int]:
    """The sizes of the tensors ``algorithm``'s first step sends to its peer (the communicator's exchange)."""
    sent = recorded_sends(comm)
    algorithm.step(0)
    return [numel for _, numel in sent[0]]


def recorded_sends(comm: gossip.Communicator) -> list[list[tuple[torch.dtype, int]]]:
    """A list that receives, at each exchange ``comm`` starts from now on (planned or not), the (dtype, numel) of
    every tensor it sends."""
    sent: list[list[tuple[torch.dtype, int]]] = []
    start = comm._start_exchange

    def recording(sends, recvs, seq):
        sent.append([(transfer.tensor.dtype, transfer.tensor.numel()) for transfer in sends])
        return start(sends, recvs, seq)

    comm._start_exchange = recording
    return sent


def resume(comm: gossip.Communicator, options: dict) -> list:
    first = bound(comm, **options)
    for step in range(3):
        first.step(step)
    state = first.state_dict()
    buffers = [b.buffer.clone() for b in first.buckets]
    for step in range(3, 6):
        first.step(step)
    second = PowerGossip(**{"rank": 2, "min_compression": 1, **options})
    buckets = gpt_buckets(comm.rank)
    for bucket, saved in zip(buckets, buffers, strict=True):
        bucket.buffer.copy_(saved)
    second.setup(comm, topologies.one_peer_hypercube(comm.size), buckets)
    second.load_state_dict(state)
    for step in range(3, 6):
        second.step(step)
    return [all(torch.equal(a.buffer, b.buffer) for a, b in zip(first.buckets, buckets, strict=True))]


@pytest.mark.parametrize("options", [{}, {"num_iterations": 2, "message_dtype": torch.float16}])
def test_grouped_state_dict_resumes_bit_identically(options):
    assert all(result[0] for result in gossip.simulate(4, resume, options))


def test_a_state_saved_with_another_message_dtype_is_refused():
    def run(comm):
        saved = bound(comm, message_dtype=torch.bfloat16)
        saved.step(0)
        bound(comm).load_state_dict(saved.state_dict())

    with pytest.raises(ValueError, match=r"'message_dtype': 'torch\.bfloat16'"):
        gossip.simulate(2, run)


def messages_and_buckets(comm: gossip.Communicator) -> list:
    algorithm = PowerGossip(rank=2, min_compression=1)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), gpt_buckets(comm.rank, 4096))
    # Step 0 is an edge's first iteration, a left multiplication: X^T p, k x r per matrix.
    products = algorithm.matrix_rank * sum(m.k for m in algorithm.matrices)
    exact = sum(entry.numel for _, entry in algorithm.exact)
    buckets_with_exact = len({index for index, _ in algorithm.exact})
    return [messages_of_first_step(comm, algorithm), products + exact, buckets_with_exact, len(algorithm.exact)]


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 4096])
def test_uncompressed_tensors_next_to_each_other_are_packed_as_one_piece_and_each_gets_the_pairs_average(bucket_bytes):
    """The uncompressed tensors lying next to each other in a bucket (a norm's weight and bias, a bias and the next
    layer's norm) are one view to pack and unpack, never across buckets; after a step of the one-peer hypercube
    with gamma = 1 every one of them holds the pair's average, bit for bit, on both ranks."""

    def run(comm):
        algorithm = PowerGossip(rank=2, min_compression=1)
        algorithm.setup(comm, topologies.one_peer_hypercube(2), gpt_buckets(comm.rank, bucket_bytes))
        before = {entry.name: algorithm.buckets[index].view(entry).clone() for index, entry in algorithm.exact}
        algorithm.step(0)
        after = {entry.name: algorithm.buckets[index].view(entry).clone() for index, entry in algorithm.exact}
        storages = {bucket.buffer.untyped_storage().data_ptr() for bucket in algorithm.buckets}
        views = all(view.untyped_storage().data_ptr() in storages for view in algorithm._exact_views)
        pieces = [view.numel() for view in algorithm._exact_views]
        return before, after, pieces, views, len(algorithm.exact), len({index for index, _ in algorithm.exact})

    (before_0, after_0, pieces, views, tensors, buckets), (before_1, after_1, *_) = gossip.simulate(2, run)
    assert views and buckets <= len(pieces) <= tensors / 2  # each layer's 8 in 4 pieces; a piece per bucket at least
    assert sum(pieces) == sum(t.numel() for t in before_0.values())
    for name, mine in before_0.items():
        average = 0.5 * mine + 0.5 * before_1[name]
        assert torch.equal(after_0[name], average) and torch.equal(after_1[name], average), name


def test_products_and_the_uncompressed_tensors_of_all_buckets_travel_as_one_message():
    sizes, expected, buckets_with_exact, exact_tensors = gossip.simulate(2, messages_and_buckets)[0]
    assert exact_tensors > 10 and buckets_with_exact > 2  # small buckets: the biases and norms spread over several
    assert sizes == [expected]  # one message: the products of every group, then every uncompressed tensor


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten operations run on this thread (each a kernel launch or a view on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(comm: gossip.Communicator, layers: int) -> list[int]:
    model = GPT(GPTConfig(block_size=8, n_layer=layers, n_head=2, n_embd=16))
    algorithm = PowerGossip(rank=2, min_compression=1)
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), bucket_parameters(model, 1 << 30))
    algorithm.step(0)
    counts = []
    for step in (1, 2):  # one right and one left multiplication
        with CountOps() as ops:
            algorithm.step(step)
        counts.append(ops.count)
    return counts


def test_the_operations_per_step_do_not_grow_with_the_number_of_layers():
    """One bucket: the layers of a role are one strided view, their biases and norms one packed message, so a
    step runs as many operations (GPU kernel launches) for 8 layers as for 2 -- no per-layer or per-tensor work."""
    two, eight = (gossip.simulate(2, ops_per_step, layers)[0] for layers in (2, 8))
    assert two == eight


# Row counts of the test GPT's factors: p (m rows): tok_emb 256, pos_emb 8, qkv 48, proj 16, fc 64, mlp.proj 16;
# q (k rows): 16 for all but mlp.proj (64). Shapes: (matrices, rows, r).
EQUAL_ROWS = [(1, 256, 2), (1, 8, 2), (3, 48, 2), (6, 16, 2), (3, 64, 2), (11, 16, 2), (3, 64, 2)]  # 5 p, 2 q
PADDED_4 = [(4, 256, 2), (9, 48, 2), (1, 8, 2), (14, 64, 2)]  # p: tok_emb + fc, qkv + proj + mlp.proj, pos_emb; q
PADDED_8 = [(7, 256, 2), (7, 16, 2), (14, 64, 2)]  # p: tok_emb + fc + qkv + mlp.proj, proj + pos_emb; q


@pytest.mark.parametrize(
    ("options", "calls"),
    [({"pad_ratio": 1}, EQUAL_ROWS), ({"pad_ratio": 4}, PADDED_4), ({}, PADDED_8)],
    ids=["equal-rows", "pad4", "cpu-default"],
)
def test_one_orthonormalization_per_class_of_row_counts_not_per_group(monkeypatch, options, calls):
    """With pad_ratio=1 groups of equal rows share one orthonormalisation: 5 calls for p, 2 for q. With
    pad_ratio=4 (the default on CUDA) groups within a factor 4 of rows share one, zero-padded: 3 for p, 1 for q;
    with 8 (the default on the CPU) 2 for p, 1 for q."""
    seen: list[tuple[int, ...]] = []
    original = powergossip.orthonormalize_

    def counting(matrix, *args, **kwargs):
        seen.append(tuple(matrix.shape))
        return original(matrix, *args, **kwargs)

    monkeypatch.setattr(powergossip, "orthonormalize_", counting)

    def two_steps(comm: gossip.Communicator) -> None:
        algorithm = bound(comm, **options)
        algorithm.step(0)  # left multiplication: orthonormalises p
        algorithm.step(1)  # right multiplication: orthonormalises q

    gossip.simulate(2, two_steps)
    assert sorted(seen) == sorted(2 * calls)  # on each of the 2 ranks


@pytest.mark.parametrize("matrix_rank", [2, 4])  # Gram-Schmidt, Householder QR
def test_padded_classes_keep_both_ends_bit_identical_and_the_sum(matrix_rank):
    results = simulate_and_check_ends_and_sum({"pad_ratio": 4, "rank": matrix_rank})
    equal_rows = gossip.simulate(4, steps_and_factors, 5, {"rank": matrix_rank, "pad_ratio": 1})
    for a, b in zip(results, equal_rows, strict=True):  # padding changes only the rounding
        for x, y in zip(a["buffers"], b["buffers"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def padding_of_the_stored_factors(comm: gossip.Communicator, options: dict) -> list[torch.Tensor]:
    algorithm = bound(comm, **options)
    for step in range(5):
        algorithm.step(step)
    layout, padding = algorithm._layout(), []
    for edge in algorithm.edges.values():
        for flat, side in ((edge.p_flat, layout.p), (edge.q_flat, layout.q)):
            assert side.positions is not None  # this model's classes pad
            outside = torch.ones(flat.numel(), dtype=torch.bool)
            outside[side.positions] = False
            padding.append(flat[outside])
    return padding


@pytest.mark.parametrize("orthonormalization", ["qr", "gram-schmidt"])
def test_the_stored_padding_of_the_factors_stays_zero(orthonormalization):
    """Every factor of a class is stored padded to the class's rows and orthonormalised in place with the others:
    after five steps (both sides orthonormalised, R written in, warm starts) every padding element is still 0."""
    options = {"rank": 4, "pad_ratio": 8, "orthonormalization": orthonormalization}
    for padding in gossip.simulate(2, padding_of_the_stored_factors, options):
        assert padding and all(p.numel() and torch.equal(p, torch.zeros_like(p)) for p in padding)


def warm_start_on_identical_replicas(comm: gossip.Communicator) -> list[bool]:
    algorithm = PowerGossip(rank=2, min_compression=1, tuning=PowerGossipTuning(pad_ratio=8))
    algorithm.setup(comm, topologies.one_peer_hypercube(comm.size), gpt_buckets(0))  # the same on both ranks
    before = [b.buffer.clone() for b in algorithm.buckets]
    edge = algorithm.edge(1 - comm.rank)
    assert algorithm._layout().p.positions is not None and algorithm._layout().q.positions is not None  # padded
    q_before = edge.q_flat.clone()
    algorithm.step(0)  # left: orthonormalises p; R, zero throughout, would replace q, which keeps its values
    q_kept = torch.equal(edge.q_flat, q_before)
    p_after = edge.p_flat.clone()
    algorithm.step(1)  # right: orthonormalises q; R, zero again, would replace p, which keeps step 0's
    p_kept = torch.equal(edge.p_flat, p_after)
    unmoved = all(torch.equal(b.buffer, s) for b, s in zip(algorithm.buckets, before, strict=True))
    return [q_kept, p_kept, unmoved, bool(p_after.ne(0).any())]


def test_the_warm_start_rule_keeps_the_stored_padded_factors_where_r_is_zero():
    """Identical replicas give R = 0 everywhere: through the padded factor buffer (gathered, compared, written
    back group by group) the factors R would replace keep their values, and the models do not move."""
    for rank, checks in enumerate(gossip.simulate(2, warm_start_on_identical_replicas)):
        assert all(checks), (rank, checks)  # q kept, p kept, models unmoved, p not zero


@pytest.mark.parametrize("pad_ratio", [0, 1.5, True])
def test_a_pad_ratio_other_than_a_positive_integer_is_refused(pad_ratio):
    with pytest.raises(ValueError, match=r"PowerGossipTuning: pad_ratio must be None or an integer >= 1, got "):
        PowerGossipTuning(pad_ratio=pad_ratio)


def test_zero_padding_leaves_the_factors_orthonormal_and_their_padding_out():
    """The padded orthonormalisation (Householder QR at r = 4) gives the unpadded one's factors (up to rounding)
    and zero in the padding."""
    generator = torch.Generator().manual_seed(0)
    small, large = torch.randn(3, 10, 4, generator=generator), torch.randn(2, 30, 4, generator=generator)
    padded = torch.zeros(5, 30, 4)
    padded[:3, :10], padded[3:] = small, large
    together = orthonormalize(padded)
    torch.testing.assert_close(together[:3, :10], orthonormalize(small), rtol=0, atol=1e-6)
    torch.testing.assert_close(together[3:], orthonormalize(large), rtol=0, atol=1e-6)
    assert torch.equal(together[:3, 10:], torch.zeros(3, 20, 4))


def test_row_classes_take_the_groups_within_the_pad_ratio_of_the_largest():
    assert row_classes([768, 3072, 2304, 50257, 1024, 768], pad_ratio=4) == [
        (50257, [3]),
        (3072, [0, 1, 2, 4, 5]),
    ]
    assert row_classes([100, 24, 25], pad_ratio=4) == [(100, [0, 2]), (24, [1])]


@pytest.mark.parametrize("message_dtype", [torch.float16, torch.bfloat16])
def test_products_travel_in_the_message_dtype_and_the_uncompressed_tensors_in_the_parameters(message_dtype):
    """With a narrower message dtype the products are one tensor of that dtype and the uncompressed tensors a second
    one in the parameters' float32 (exact gossip of them stays exact); further iterations send the products only."""

    def messages(comm):
        algorithm = bound(comm, num_iterations=2, message_dtype=message_dtype)
        sent = recorded_sends(comm)
        algorithm.step(0)
        return sent, algorithm._exact_numel

    sent, exact_numel = gossip.simulate(2, messages)[0]
    assert [[dtype for dtype, _ in message] for message in sent] == [[message_dtype, torch.float32], [message_dtype]]
    assert sent[0][1][1] == exact_numel


def test_a_message_dtype_other_than_a_float_dtype_is_refused():
    with pytest.raises(ValueError, match="message_dtype must be None"):
        PowerGossip(message_dtype=torch.int8)


def test_the_layout_dataclasses_are_built_by_keyword_only():
    """Plan has fifteen fields, several of one type: a positional call that swapped two would run, wrongly."""
    from gossip.algorithms import powergossip_layout as layout

    classes = [
        obj for obj in vars(layout).values() if dataclasses.is_dataclass(obj) and obj.__module__ == layout.__name__
    ]
    assert {cls.__name__ for cls in classes} >= {"Plan", "Replacement", "Side", "Matrix"}
    for cls in classes:
        assert all(field.kw_only for field in dataclasses.fields(cls)), cls.__name__
    with pytest.raises(TypeError, match="positional"):
        layout.Run(0, 0, 1, 1)


def test_the_seldom_tuned_settings_travel_in_one_keyword_only_tuning_and_keep_their_config_keys():
    """``PowerGossipTuning`` gathers the benchmark knobs; ``config()`` (what ranks compare and checkpoints record)
    keeps the keys and values it had when they were constructor arguments of their own."""
    tuning = PowerGossipTuning(orthonormalization="qr", orthonormalize_dtype=torch.float64, pad_ratio=2)
    assert PowerGossip(rank=2, message_dtype=torch.bfloat16, tuning=tuning).config() == {
        "rank": 2,
        "num_iterations": 1,
        "gamma": 1.0,
        "warm_start": True,
        "min_compression": 2.0,
        "seed": 0,
        "orthonormalize_dtype": "torch.float64",
        "orthonormalization": "qr",
        "uncompressed_every_iteration": False,
        "message_dtype": "torch.bfloat16",
    }
    assert PowerGossip().config()["orthonormalization"] == "None"
    with pytest.raises(TypeError):
        PowerGossipTuning("qr")  # keyword only
    with pytest.raises(TypeError, match="unexpected keyword argument 'pad_ratio'"):
        PowerGossip(pad_ratio=4)  # one place for it: tuning
    with pytest.raises(TypeError, match="PowerGossip: tuning must be a PowerGossipTuning or None, got"):
        PowerGossip(tuning={"pad_ratio": 4})
