"""glm5_hal.dist: backend choice, collectives and expert-parallel MoE dispatch.

Multi-process tests run real gloo worlds over 127.0.0.1 (tests/dist_helpers.py), one world
per world size with every check inside it, since starting a rank (python + torch) is the
expensive part. Every rank regenerates every rank's inputs from fixed seeds, so each rank
computes its own expected result from the mathematical definition.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import glm5_hal as hal
from conftest import run_python
from dist_helpers import init_world, run_world

D = hal.dist


# -- deterministic inputs shared by all ranks ------------------------------------------------
def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _small_ints(shape, dtype, *key, low=-4, high=5) -> torch.Tensor:
    """Small integers (exact in every dtype, sums and products too) as `dtype`."""
    v = torch.randint(low, high, tuple(shape), generator=_gen(*key))
    if dtype == torch.bool:
        return v > 0
    return v.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, for any dtype (fp8 and bool included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _expect_invalid(fn, *fragments: str) -> str:
    try:
        fn()
    except hal.InvalidInputError as exc:
        for fragment in fragments:
            assert fragment in str(exc), f"{fragment!r} not in {exc}"
        return str(exc)
    raise AssertionError("expected InvalidInputError")


# -- what every rank checks ------------------------------------------------------------------
def check_all_reduce(rank: int, world: int) -> int:
    n = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8):
        low = 0 if dtype == torch.uint8 else -4
        inputs = [_small_ints((3, 5), dtype, "ar", str(dtype), r, low=low) for r in range(world)]
        stacked = torch.stack([t.double() for t in inputs])
        t = inputs[rank]
        before = t.clone()
        expected = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0),
                    "product": stacked.prod(0)}
        for op, want in expected.items():
            if dtype == torch.uint8 and op == "product":
                continue
            for check in (True, False):
                out = D.all_reduce(t, op, check=check)
                assert out.dtype == dtype and torch.equal(out, want.to(dtype)), (op, dtype, out, want)
                n += 1
        assert torch.equal(t, before), "all_reduce modified its input"
        if dtype.is_floating_point:
            assert torch.allclose(D.all_reduce(t, "avg").double(), stacked.mean(0), atol=1e-2)
            n += 1
    # a non-contiguous input, and an empty one
    base = [_small_ints((4, 3), torch.float32, "ar-nc", r) for r in range(world)]
    out = D.all_reduce(base[rank].t())
    assert out.is_contiguous() and torch.equal(out, sum(base).t())
    assert D.all_reduce(torch.empty(0, 3)).shape == (0, 3)
    return n + 2


_UNEVEN = (0, 3, 1, 2)


def check_all_gather(rank: int, world: int) -> int:
    n = 0
    sizes = [_UNEVEN[r % 4] for r in range(world)]  # rank 0 contributes nothing
    for dim in (0, 1, 2, -1):
        for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.float8_e4m3fn, torch.int16):
            def make(r, size):
                shape = [2, 3, 4]
                shape[dim] = size
                return _small_ints(shape, dtype, "ag", dim, str(dtype), r, size)
            inputs = [make(r, s) for r, s in enumerate(sizes)]
            want = torch.cat(inputs, dim)
            assert _same(D.all_gather(inputs[rank], dim), want), (dim, dtype)
            assert _same(D.all_gather(inputs[rank], dim, sizes=sizes), want)
            assert _same(D.all_gather(inputs[rank], dim, sizes=sizes, check=False), want)
            even = [make(r, 2) for r in range(world)]
            assert _same(D.all_gather(even[rank], dim, check=False), torch.cat(even, dim))
            n += 4
    # non-contiguous input; every part empty; a zero-size trailing dim
    base = [_small_ints((3, 2 + r), torch.float32, "ag-nc", r) for r in range(world)]
    assert _same(D.all_gather(base[rank].t(), 0), torch.cat([b.t() for b in base], 0))
    assert D.all_gather(torch.empty(0, 3), 0).shape == (0, 3)
    assert D.all_gather(torch.empty(rank + 1, 0), 0).shape == (sum(range(1, world + 1)), 0)
    return n + 3


def check_reduce_scatter(rank: int, world: int) -> int:
    n = 0
    uneven = [(2, 0, 3, 1)[r % 4] for r in range(world)]
    for dim in (0, 1, -1):
        for chunks in ([2] * world, uneven):
            shape = [3, 2, 4]
            shape[dim] = sum(chunks)
            start = sum(chunks[:rank])
            for dtype in (torch.float32, torch.bfloat16, torch.int32):
                inputs = [_small_ints(shape, dtype, "rs", dim, str(dtype), r, tuple(chunks))
                          for r in range(world)]
                stacked = torch.stack([t.double() for t in inputs])
                for op, want in (("sum", stacked.sum(0)), ("max", stacked.amax(0)),
                                 ("min", stacked.amin(0)), ("product", stacked.prod(0))):
                    mine = want.narrow(dim, start, chunks[rank]).to(dtype)
                    kwargs = {} if chunks == [2] * world else {"sizes": chunks}
                    for check in (True, False):
                        out = D.reduce_scatter(inputs[rank], dim, op=op, check=check, **kwargs)
                        assert out.dtype == dtype and torch.equal(out, mine), (dim, chunks, dtype, op)
                        n += 1
                if dtype == torch.float32:
                    out = D.reduce_scatter(inputs[rank], dim, op="avg", sizes=chunks)
                    assert torch.allclose(out.double(), stacked.mean(0).narrow(dim, start, chunks[rank]))
                    n += 1
    return n


def check_all_to_all(rank: int, world: int) -> int:
    n = 0
    g = _gen("a2a-splits", world)
    splits = torch.randint(0, 4, (world, world), generator=g)  # splits[i][j]: rows i sends to j
    splits[0] = 0                     # rank 0 sends nothing
    splits[:, world - 1] = 0          # the last rank receives nothing
    splits = splits.tolist()
    for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.bool):
        inputs = [_small_ints((sum(splits[i]), 2, 3), dtype, "a2a", str(dtype), i) for i in range(world)]
        want = torch.cat([inputs[j][sum(splits[j][:rank]):sum(splits[j][:rank + 1])] for j in range(world)])
        received = [splits[j][rank] for j in range(world)]
        for out_splits in (received, None):
            for check in (True, False):
                out = D.all_to_all(inputs[rank], out_splits, splits[rank], check=check)
                assert _same(out, want), (dtype, out_splits, check)
                n += 1
    # splits as tensors; default equal splits
    t = _small_ints((2 * world, 3), torch.float32, "a2a-even", rank)
    out = D.all_to_all(t, torch.tensor([2] * world), torch.tensor([2] * world))
    want = torch.cat([_small_ints((2 * world, 3), torch.float32, "a2a-even", j)[2 * rank:2 * rank + 2]
                      for j in range(world)])
    assert _same(out, want) and _same(D.all_to_all(t), want)
    # nobody sends anything
    assert D.all_to_all(torch.empty(0, 5), [0] * world, [0] * world).shape == (0, 5)
    return n + 3


def check_broadcast(rank: int, world: int) -> int:
    n = 0
    for src in range(world):
        for dtype in (torch.float32, torch.float8_e4m3fn, torch.int64):
            data = _small_ints((4, 3), dtype, "bc", src, str(dtype))
            mine = data if rank == src else torch.zeros_like(data)
            before = mine.clone()
            for check in (True, False):
                assert _same(D.broadcast(mine, src, check=check), data)
                n += 1
            assert _same(mine, before)
    assert D.broadcast(torch.empty(0, 2), world - 1).shape == (0, 2)
    return n + 1


def check_mismatches(rank: int, world: int) -> int:
    """Cross-rank mistakes raise InvalidInputError on every rank, and the group stays usable."""
    last = world - 1
    others = "(arguments on another rank)"
    _expect_invalid(lambda: D.all_reduce(torch.ones(5 if rank == last else 4)), "shape", f"on rank")
    _expect_invalid(lambda: D.all_gather(torch.ones(2, dtype=torch.float64 if rank == 0 else torch.float32)),
                    "the same dtype", "float64")
    _expect_invalid(lambda: D.all_gather(torch.ones(2, 4 if rank == 1 else 3)), "sizes on every dim but dim 0")
    # a local mistake on one rank: that rank says what, the others say which rank
    bad_sum = [1] * world if rank != 0 else [2] + [1] * (world - 1)
    _expect_invalid(lambda: D.all_to_all(torch.ones(world), None, bad_sum),
                    "input_splits" if rank == 0 else others, "summing to" if rank == 0 else "rank(s) [0]")
    negative = [1] * world if rank != last else [-1] + [1] * (world - 1)
    _expect_invalid(lambda: D.all_to_all(torch.ones(world), None, negative),
                    "non-negative" if rank == last else f"rank(s) [{last}]")
    _expect_invalid(lambda: D.all_gather(torch.ones(2, 2), 2 if rank == 1 else 0),
                    "dim" if rank == 1 else "rank(s) [1]")
    _expect_invalid(lambda: D.all_reduce([1.0] if rank == 0 else torch.ones(2)),
                    "a torch.Tensor" if rank == 0 else "rank(s) [0]")
    # output_splits that contradict what the senders send
    claimed = [1] * world if rank != 0 else [2] + [0] * (world - 1)
    _expect_invalid(lambda: D.all_to_all(torch.ones(world), claimed, [1] * world), "output_splits", "on rank 0")
    # different collectives, different chunk sizes, different src
    _expect_invalid(lambda: D.all_gather(torch.ones(2)) if rank == 0 else D.all_reduce(torch.ones(2)),
                    "(collective)")
    chunks = [1] * world if rank else [world] + [0] * (world - 1)
    _expect_invalid(lambda: D.reduce_scatter(torch.ones(world), sizes=chunks), "chunk sizes")
    _expect_invalid(lambda: D.broadcast(torch.ones(2), 0 if rank == 0 else 1), "src")
    x, ids, w = torch.ones(2, 4), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
    _expect_invalid(lambda: D.moe_dispatch(x, ids, w, 2 * world if rank == 0 else 4 * world), "num_experts")
    _expect_invalid(lambda: D.moe_dispatch(x, ids, w, world + 1), "a multiple of the group size")
    _expect_invalid(lambda: D.moe_dispatch(torch.ones(2, 3 + (rank == last)), ids, w, world), "hidden size")
    # check=False: local checks still raise (here on every rank alike), nothing is exchanged
    _expect_invalid(lambda: D.all_to_all(torch.ones(world), None, [2] * world, check=False), "summing to")
    _expect_invalid(lambda: D.reduce_scatter(torch.ones(world + 1), check=False), "divisible by the group size")
    assert torch.equal(D.all_reduce(torch.ones(2)), torch.full((2,), float(world)))
    return 17


def _moe_inputs(src: int, world: int, dtype: torch.dtype):
    num_experts, k, hidden = 2 * world, 3, 6
    tokens = (5, 0, 7, 3)[src % 4]  # rank 1 has no tokens
    x = torch.randn(tokens, hidden, generator=_gen("moe-x", src)).to(dtype)
    # ids in [-1, E]: -1 and E are invalid and dropped; duplicates within a token are kept
    ids = torch.randint(-1, num_experts + 1, (tokens, k), generator=_gen("moe-ids", src)).to(torch.int32)
    if tokens:
        ids[0] = torch.tensor([-1, num_experts, -1])  # a token with no valid expert
    weights = torch.rand(tokens, k, generator=_gen("moe-w", src))
    return x, ids, weights, num_experts


def _experts(world: int, hidden: int, out: int) -> torch.Tensor:
    return torch.randn(2 * world, out, hidden, generator=_gen("moe-experts", world), dtype=torch.float64)


def _dense_moe(x, ids, weights, experts) -> torch.Tensor:
    """The single-process result: out[t] = sum_j weights[t, j] * expert_ids[t, j](x[t])."""
    out = torch.zeros(x.shape[0], experts.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < experts.shape[0]:
                out[t] += float(weights[t, j]) * (experts[e] @ x[t].double())
    return out


def check_moe(rank: int, world: int) -> int:
    n = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        everyone = [_moe_inputs(s, world, dtype) for s in range(world)]
        x, ids, weights, num_experts = everyone[rank]
        per_rank = num_experts // world
        owned = D.owned_experts(num_experts)
        assert owned == range(rank * per_rank, (rank + 1) * per_rank)
        for check in (True, False):
            recv_x, local_ids, recv_w, counts, handle = D.moe_dispatch(x, ids, weights, num_experts,
                                                                       check=check)
            # received rows: local expert, then source rank, then the source's flat index
            want = [(sx[f // sids.shape[1]], e - owned.start, sw.reshape(-1)[f])
                    for e in owned for (sx, sids, sw, _) in everyone
                    for f in range(sids.numel()) if int(sids.reshape(-1)[f]) == e]
            assert recv_x.dtype == dtype and recv_x.shape == (len(want), x.shape[1])
            if want:
                assert _same(recv_x, torch.stack([w[0] for w in want]))
                assert torch.equal(local_ids, torch.tensor([w[1] for w in want], dtype=torch.int32))
                assert torch.equal(recv_w, torch.stack([w[2] for w in want]))
            assert counts.dtype == torch.int32 and counts.tolist() == [
                sum(1 for w in want if w[1] == e) for e in range(per_rank)]
            # run the experts on the received rows, combine, compare with the dense result
            experts = _experts(world, x.shape[1], 4)
            global_ids = local_ids.long() + owned.start
            y = torch.einsum("rhd,rd->rh", experts[global_ids], recv_x.double()).to(dtype)
            out = D.moe_combine(y, handle, check=check)
            ref = _dense_moe(x, ids, weights, experts)
            tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float64: 1e-12}[dtype]
            assert out.dtype == dtype and out.shape == (x.shape[0], 4)
            assert torch.allclose(out.double(), ref, rtol=tol, atol=tol), (dtype, out, ref)
            if x.shape[0]:
                assert torch.equal(out[0], torch.zeros(4, dtype=dtype))  # no valid expert
            n += 1
    x, ids, weights, num_experts = _moe_inputs(rank, world, torch.float32)
    *_, handle = D.moe_dispatch(x, ids, weights, num_experts)
    _expect_invalid(lambda: D.moe_combine(torch.ones(sum(handle.recv_splits) + 1, 4), handle), "y")
    return n + 1


def check_subgroup(rank: int, world: int) -> int:
    """Collectives and MoE dispatch on the group of global ranks 1..world-1: arguments and
    results use group ranks (global rank g is group rank g-1)."""
    members = list(range(1, world))
    group = dist.new_group(members)
    if rank == 0:
        _expect_invalid(lambda: D.all_reduce(torch.ones(2), group=group), "a process group this process belongs to")
        return 1
    size, me = len(members), rank - 1
    sizes = [(2, 0, 1)[r % 3] for r in range(size)]
    parts = [_small_ints((s, 3), torch.float32, "sub-ag", r) for r, s in enumerate(sizes)]
    assert _same(D.all_gather(parts[me], group=group), torch.cat(parts))
    data = _small_ints((2, 2), torch.float32, "sub-bc")
    mine = data if me == size - 1 else torch.zeros(2, 2)
    assert _same(D.broadcast(mine, size - 1, group=group), data)  # src is a group rank
    assert torch.equal(D.all_reduce(torch.ones(2), group=group), torch.full((2,), float(size)))
    num_experts = 2 * size
    x = _small_ints((3, 4), torch.float32, "sub-moe", me)
    ids = torch.tensor([[2 * r + 1 for r in range(min(size, 2))] + [-1] * (2 - min(size, 2))] * 3,
                       dtype=torch.int32)
    recv_x, local_ids, _, counts, handle = D.moe_dispatch(x, ids, torch.ones(3, 2), num_experts, group)
    assert D.owned_experts(num_experts, group) == range(2 * me, 2 * me + 2)
    # every member routes all its tokens to global expert 2r+1 of members r < 2: local expert 1
    assert counts.tolist() == ([0, 3 * size] if me < 2 else [0, 0])
    assert torch.equal(D.moe_combine(recv_x * 2, handle), x * 2 * min(size, 2))
    return 5


def collectives_world(rank: int, world: int, port: int, init_method: str | None = None) -> dict:
    backend = init_world(rank, world, port, init_method=init_method)
    counts = {"backend": backend}
    for check in (check_all_reduce, check_all_gather, check_reduce_scatter, check_all_to_all,
                  check_broadcast, check_mismatches, check_moe, check_subgroup):
        counts[check.__name__] = check(rank, world)
    D.destroy_process_group()
    return counts


# -- multi-process worlds ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_and_moe_in_a_real_world(world, tmp_path):
    init_method = f"file://{tmp_path / 'rendezvous'}" if world == 3 else None  # init_method passes through
    results = run_world(collectives_world, world, init_method)
    assert len(results) == world
    for r in results:
        assert r["backend"] == "gloo"
        assert all(v > 0 for k, v in r.items() if k.startswith("check_")), r


def never_calls_world(rank: int, world: int, port: int, flag: str) -> list[str] | None:
    """Global rank 0 calls a collective on a group whose other member (1 or 2) never does:
    first the payload itself (check=False), then the metadata exchange (check=True)."""
    init_world(rank, world, port, timeout=2)
    # new groups get torch's default timeout (30 min), not the default group's: pass it
    two_seconds = datetime.timedelta(seconds=2)
    pair_a, pair_b = dist.new_group([0, 1], timeout=two_seconds), dist.new_group([0, 2], timeout=two_seconds)
    if rank == 0:
        outcomes = []
        for call in (lambda: D.all_reduce(torch.ones(3), group=pair_a, check=False),
                     lambda: D.all_gather(torch.ones(3), group=pair_b)):
            try:
                call()
                outcomes.append("no error")
            except D.CollectiveTimeoutError as exc:
                outcomes.append(str(exc))
        Path(flag).write_text("done")
        return outcomes
    deadline = time.monotonic() + 60
    while not Path(flag).exists() and time.monotonic() < deadline:  # stay alive, never call
        time.sleep(0.05)
    return None


@pytest.mark.slow
def test_a_rank_that_never_calls_times_out_with_a_clear_error(tmp_path):
    payload, metadata = run_world(never_calls_world, 3, str(tmp_path / "flag"))[0]
    assert payload.startswith("glm5_hal.dist.all_reduce: rank 0 of 2 (gloo) timed out after"), payload
    assert "process-group timeout 2 s" in payload and "did not call all_reduce" in payload
    assert metadata.startswith("glm5_hal.dist.all_gather (metadata check): rank 0 of 2 (gloo) "
                               "timed out after"), metadata
    assert "did not call all_gather" in metadata


def never_joins_world(rank: int, world: int, port: int) -> str:
    try:
        init_world(rank, world, port, timeout=2)
    except D.CollectiveTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_rank_that_never_joins_times_out_with_a_clear_error():
    [message] = run_world(never_joins_world, 2, ranks=[0])
    assert "glm5_hal.dist.init_process_group: rank 0 of 2 (gloo)" in message, message
    assert "timed out after" in message and "not every rank joined" in message


# -- in-process: world size 1, backend choice ---------------------------------------------------
@pytest.fixture
def world_of_one():
    assert not dist.is_initialized()
    D.init_process_group(store=dist.HashStore(), world_size=1, rank=0, timeout=10)
    try:
        yield
    finally:
        D.destroy_process_group()


def test_world_of_one(world_of_one):
    for check in (check_all_reduce, check_all_gather, check_reduce_scatter, check_all_to_all,
                  check_broadcast, check_moe):
        assert check(0, 1) > 0


def test_moe_with_one_rank_matches_the_permute_order(world_of_one):
    """With one rank, the received order is moe_permute's: expert ascending, then flat index."""
    ids = torch.tensor([[3, 1], [-1, 3], [1, 0], [7, 2]], dtype=torch.int32)
    x = torch.arange(8, dtype=torch.float32).view(4, 2)
    recv_x, local_ids, recv_w, counts, handle = D.moe_dispatch(x, ids, torch.ones(4, 2), 4)
    assert handle.send_src.tolist() == [5, 1, 4, 7, 0, 3]  # flat indices t*k + j
    assert local_ids.tolist() == [0, 1, 1, 2, 3, 3] and counts.tolist() == [1, 2, 1, 2]
    assert torch.equal(recv_x, x[torch.tensor([2, 0, 2, 3, 0, 1])])


def test_local_mistakes_name_the_argument(world_of_one):
    t = torch.ones(4, 3)
    for check in (True, False):
        _expect_invalid(lambda: D.all_gather(t, 2, check=check), "all_gather", "'dim'", "[-2, 2)")
        _expect_invalid(lambda: D.all_gather(t, sizes=[3], check=check), "sizes[0] == t.shape[0]")
        _expect_invalid(lambda: D.all_to_all(t, None, [5], check=check), "'input_splits'", "summing to 4")
        _expect_invalid(lambda: D.all_to_all(t, [1, 3], [4], check=check), "1 sizes (one per rank")
        _expect_invalid(lambda: D.all_to_all(t, [-4], [4], check=check), "'output_splits'", "non-negative")
        _expect_invalid(lambda: D.all_reduce(t.bool(), check=check), "'t'", "dtype")
        _expect_invalid(lambda: D.all_reduce(t.int(), "avg", check=check), "'op'", "avg needs a floating")
        _expect_invalid(lambda: D.all_reduce(t, "mean", check=check), "'op'", "one of")
        _expect_invalid(lambda: D.broadcast(t, 1, check=check), "'src'", "[0, 1)")
        ids = torch.zeros(4, 2, dtype=torch.int32)
        _expect_invalid(lambda: D.moe_dispatch(t, ids.long(), torch.ones(4, 2), 2, check=check), "'ids'", "int32")
        _expect_invalid(lambda: D.moe_dispatch(t, ids, torch.ones(4, 3), 2, check=check), "'weights'")
        _expect_invalid(lambda: D.moe_dispatch(t, ids[:3], torch.ones(3, 2), 2, check=check), "'ids'")
        _expect_invalid(lambda: D.moe_dispatch(t, ids, torch.ones(4, 2), 0, check=check), "'num_experts'")
    *_, handle = D.moe_dispatch(t, torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2), 2)
    _expect_invalid(lambda: D.moe_combine(torch.ones(8, 3, dtype=torch.int32), handle), "'y'", "dtype")
    _expect_invalid(lambda: D.moe_combine(torch.ones(8, 3), "handle"), "'handle'")


def test_collectives_need_a_process_group():
    assert not dist.is_initialized()
    _expect_invalid(lambda: D.all_reduce(torch.ones(2)), "all_reduce", "init_process_group")


class _ToyDistBackend(hal.Backend):
    device_type = "toydev"

    def __init__(self, name, dist_backend, priority, available=True):
        super().__init__()
        self.name, self.priority, self._dist, self._ok = name, priority, dist_backend, available

    def probe(self):
        return hal.Availability(self._ok, "toy")

    def capabilities(self):
        return hal.Capabilities(dist_backend=self._dist)


class _ToyPlugin:
    def __init__(self, *backends):
        self.backends = backends

    @hal.hookimpl
    def glm5_hal_register_backends(self, register):
        for b in self.backends:
            register(b)


def test_backend_for_device_mapping(hal_state):
    if torch.accelerator.current_accelerator(check_available=True) is None:
        assert D.backend_for_device() == "gloo"          # no accelerator: the CPU
    assert D.backend_for_device("cpu") == "gloo"         # the cpu backend declares gloo
    assert D.backend_for_device(torch.device("cpu")) == "gloo"
    assert D.backend_for_device("cuda:1") == "nccl"      # torch's default (CUDA; RCCL on DCU)
    # device types of one vendor each, from glm5_hal.vendors, even without the bridge
    assert [D.backend_for_device(d) for d in ("npu", "musa", "mlu:0")] == ["hccl", "mccl", "cncl"]
    with pytest.raises(hal.BackendUnavailableError, match="no process-group backend is known for device type 'toydev'"):
        D.backend_for_device("toydev")
    # the available backend of highest priority for the device type decides
    hal_state(_ToyPlugin(_ToyDistBackend("toy_low", "lowccl", 1), _ToyDistBackend("toy_high", "highccl", 9),
                         _ToyDistBackend("toy_gone", "goneccl", 99, available=False)), "toy_dist")
    assert D.backend_for_device("toydev") == "highccl"
    with pytest.raises(hal.InvalidInputError, match="'device'"):
        D.backend_for_device(3)


def test_backend_for_device_without_the_cpu_backend(hal_state, monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    hal.reload()
    assert D.backend_for_device("cpu") == "gloo"  # torch's own default still applies


VENDOR_BACKENDS = [("hccl", "ascend", "torch_npu"), ("mccl", "musa", "torch_musa"),
                   ("cncl", "cambricon", "torch_mlu"), ("bkcl", "kunlun", "torch_xmlir")]


@pytest.mark.parametrize("name,vendor,bridge", VENDOR_BACKENDS)
def test_vendor_backend_without_its_bridge_fails_before_any_rendezvous(name, vendor, bridge):
    # an address nobody listens on: reaching the rendezvous would fail differently, after retries
    with pytest.raises(hal.BackendUnavailableError) as info:
        D.init_process_group(name, init_method="tcp://127.0.0.1:9", world_size=2, rank=0, timeout=30)
    message = str(info.value)
    assert f"'{name}'" in message and f"vendor {vendor}" in message and f"'{bridge}'" in message
    assert "not installed" in message and not dist.is_initialized()


def test_auto_on_a_vendor_device_names_the_missing_bridge():
    with pytest.raises(hal.BackendUnavailableError, match="vendor ascend.*'torch_npu' is not installed"):
        D.init_process_group(device="npu", init_method="tcp://127.0.0.1:9", world_size=2, rank=0, timeout=30)


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch build has NCCL")
def test_nccl_on_a_cpu_torch_build_says_so():
    with pytest.raises(hal.BackendUnavailableError, match="'nccl' is not available in this torch build.*vendor dcu"):
        D.init_process_group("nccl", init_method="tcp://127.0.0.1:9", world_size=2, rank=0)


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(hal.BackendUnavailableError, match="unknown process-group backend 'nosuchccl'.*gloo"):
        D.init_process_group("nosuchccl", world_size=1, rank=0)
    with pytest.raises(hal.InvalidInputError, match="'timeout'"):
        D.init_process_group("gloo", world_size=1, rank=0, store=dist.HashStore(), timeout=-1)
    assert not dist.is_initialized()


def test_a_bridge_that_fails_to_import_is_reported(tmp_path, monkeypatch):
    (tmp_path / "torch_mlu.py").write_text("raise RuntimeError('libcnrt.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(hal.BackendUnavailableError) as info:
        D.init_process_group("cncl", init_method="tcp://127.0.0.1:9", world_size=2, rank=0, timeout=30)
    message = str(info.value)
    assert "vendor cambricon" in message and "'torch_mlu' is installed but failed to import" in message
    assert "libcnrt.so" in message


FAKE_BRIDGE = '''
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

def _create(store, rank, size, timeout):
    return ProcessGroupGloo(store, rank, size, timeout)

dist.Backend.register_backend("hccl", _create, devices=["cpu"])
'''

BRIDGE_SCENARIO = '''
import json, sys, torch, torch.distributed as dist
import glm5_hal as hal
loaded_before = "torch_npu" in sys.modules
used = hal.dist.init_process_group(device="npu", store=dist.HashStore(), world_size=1, rank=0)
out = hal.dist.all_reduce(torch.ones(3))
print(json.dumps({"used": used, "loaded_before": loaded_before, "loaded": "torch_npu" in sys.modules,
                  "backend": str(dist.get_backend()), "sum": out.tolist()}))
hal.dist.destroy_process_group()
'''


def test_a_vendor_bridge_is_imported_and_its_backend_used(tmp_path):
    """A stand-in torch_npu that registers 'hccl' (backed by gloo here): 'auto' on an npu
    device picks hccl, imports the bridge, and the collectives run through it."""
    (tmp_path / "torch_npu.py").write_text(FAKE_BRIDGE)
    proc = run_python(BRIDGE_SCENARIO, path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"used": "hccl", "loaded_before": False, "loaded": True, "backend": "hccl",
                      "sum": [1.0, 1.0, 1.0]}


def test_docs_vendor_table_matches_vendors_py():
    """docs/distributed.md's backend table says what glm5_hal/vendors.py says."""
    import re
    from glm5_hal.vendors import VENDORS
    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    cells = {}
    for line in text.splitlines():
        m = re.match(r"\| `(\w+)` \|", line)
        if m:
            cells[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
    assert set(cells) == set(VENDORS) | {"cpu"}

    def first_code(cell):
        m = re.search(r"`([^`]+)`", cell)
        return m.group(1) if m else None

    for name, v in VENDORS.items():
        _, chips, device_type, dist_backend, bridge, visible = cells[name]
        assert chips == v.chips
        assert (first_code(device_type), first_code(dist_backend), first_code(visible)) == (
            v.device_type, v.dist_backend, v.visible_devices)
        assert first_code(bridge) == v.bridge
        for field, cell in (("device_type", device_type), ("dist_backend", dist_backend),
                            ("visible_devices", visible)):
            assert ("unconfirmed" in cell) == (field in v.unconfirmed), (name, field, cell)


# -- the benchmark -----------------------------------------------------------------------------
@pytest.mark.slow
def test_collectives_benchmark_runs_and_checks_every_result(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM5_HAL_")}
    proc = subprocess.run([sys.executable, "-m", "glm5_hal.cli", "bench", "--collectives",
                           "--world-size", "2", "--sizes", "4K,64K",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())["collectives"]
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    rows = report["rows"]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter",
                                               "all_to_all", "broadcast"}
    assert {r["size_bytes"] for r in rows} == {4096, 65536}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["busbw_GBps"] >= 0 for r in rows)
    factors = {r["collective"]: r["busbw_GBps"] / r["algbw_GBps"] for r in rows}
    assert factors["all_reduce"] == pytest.approx(1.0) and factors["broadcast"] == pytest.approx(1.0)
    assert factors["all_gather"] == pytest.approx(0.5)
    assert report["metadata_check_us"] > 0
    assert "busbw" in proc.stdout and "wrong" in proc.stdout

