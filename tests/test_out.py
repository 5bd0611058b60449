"""The out= buffers (docs/ops.md, "out= buffers"): every op declared with one (glm5_hal.contract.Out)
writes its result into the caller's buffer bit for bit as it would return it, returns that
same object, refuses every bad buffer with InvalidInputError naming `out` before writing
anything, gives eager's result under every transform, and on the cpu backend's native
kernels writes in place of its own output buffers. The ops come from the op table, each with
inputs from one of its conformance cases, so an op that opts in is covered by opting in."""
from __future__ import annotations


import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import glm5_hal as hal
import glm5_hal.ops  # noqa: F401  (defines the ops)
from glm5_hal.backends import cpu as cpu_backend
from glm5_hal.errors import InvalidInputError
from glm5_hal.opdef import OPS
from op_table_cases import tiny_case, tiny_inputs

BACKENDS = ["reference", "cpu"]
OUT_OPS = [name for name, op in OPS.items() if op.out is not None]
#: the largest inputs (total elements) a case may have to be picked: small keeps this fast, and
#: large enough that every op's pick has a result with a dim > 1 (a strided buffer exists)
MAX_ELEMENTS = 20000
SENTINEL = 7.0


def test_the_ops_fed_from_a_workspace_take_out():
    # the ops whose result has a shape fixed by metadata, which model code and serving engines
    # call with preallocated buffers; an op joining or leaving the list is a contract change
    assert OUT_OPS == ["rms_norm", "silu_and_mul", "indexer_topk_paged", "sparse_mla_attention",
                       "sparse_mla_decode_paged", "dense_mla_decode_paged", "moe_unpermute", "grouped_gemm",
                       "w4a16_gemm", "fp8_block_gemm", "fp8_grouped_gemm", "int8_gemm", "int8_grouped_gemm"]


def _case(name: str):
    return tiny_case(name, MAX_ELEMENTS)


def inputs(name: str) -> tuple:
    return tiny_inputs(name, MAX_ELEMENTS)


def first(result):
    return result[0] if isinstance(result, tuple) else result


def buffer_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer for `t` holding a sentinel, so that an untouched buffer shows."""
    return torch.full_like(t, SENTINEL, memory_format=torch.contiguous_format)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_bitwise(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(bits(got), bits(expected))


@pytest.fixture(params=BACKENDS)
def backend(request):
    with hal.use(request.param):
        yield request.param


@pytest.mark.parametrize("name", OUT_OPS)
def test_every_out_op_has_inputs(name):
    assert _case(name) is not None, f"{name}: no tiny RESULT conformance case of at most {MAX_ELEMENTS} elements"


@pytest.mark.parametrize("name", OUT_OPS)
def test_out_gets_the_result_bit_for_bit_and_is_returned(name, backend):
    public, args = OPS[name].public, inputs(name)
    expected = public(*args)
    out = buffer_like(first(expected))
    got = public(*args, out=out)
    assert first(got) is out
    assert_bitwise(out, first(expected))
    if isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected)
        for g, e in zip(got[1:], expected[1:]):
            assert_bitwise(g, e)


@pytest.mark.parametrize("name", OUT_OPS)
def test_the_same_out_serves_repeated_calls(name, backend):
    public, args = OPS[name].public, inputs(name)
    out = buffer_like(first(public(*args)))
    address = out.data_ptr()
    for scale in (1.0, 0.5):
        # float inputs scaled, so that each call writes different values
        scaled = tuple(a * scale if isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.bfloat16)
                       else a for a in args)
        assert first(public(*scaled, out=out)) is out
        assert out.data_ptr() == address
        assert_bitwise(out, first(public(*scaled)))


# -- bad buffers: refused, naming out, before anything is written -------------------------------
def _overlapping(args: tuple, like: torch.Tensor, offset_bytes: int | None) -> tuple[tuple, torch.Tensor]:
    """The arguments with the first tensor moved into one byte buffer, and a buffer shaped like
    `like` in that same memory: at the input's start (offset None: a view of the input), or
    ending inside the input's last bytes."""
    index = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    source = args[index]
    in_bytes, out_bytes = source.nbytes, like.nbytes
    align = 16
    start = 0 if offset_bytes is None else max(0, (in_bytes - align) // align * align)
    memory = torch.zeros(max(in_bytes, start + out_bytes) + align, dtype=torch.uint8)
    moved = memory[:in_bytes].view(source.dtype).view(source.shape)
    moved.copy_(source)
    out = memory[start:start + out_bytes].view(like.dtype).view(like.shape)
    out.fill_(SENTINEL)
    return args[:index] + (moved,) + args[index + 1:], out


def _bad_out(kind: str, expected: torch.Tensor, args: tuple) -> tuple[tuple, object]:
    shape = expected.shape
    if kind == "not_a_tensor":
        return args, [[SENTINEL]]
    if kind == "longer":
        return args, torch.full((shape[0] + 1, *shape[1:]), SENTINEL, dtype=expected.dtype)
    if kind == "flattened":   # as many elements, another shape: never resized or reshaped
        return args, torch.full((expected.numel(),), SENTINEL, dtype=expected.dtype)
    if kind == "empty":
        return args, torch.empty(0, dtype=expected.dtype)
    if kind == "dtype":
        return args, torch.full(shape, SENTINEL, dtype=torch.float64)
    if kind == "device":
        return args, torch.empty(shape, dtype=expected.dtype, device="meta")
    if kind == "non_contiguous":
        wide = torch.full((*shape[:-1], 2 * shape[-1]), SENTINEL, dtype=expected.dtype)
        out = wide[..., ::2]      # every other element: the same shape, strided
        assert not out.is_contiguous()
        return args, out
    if kind == "overlapping":
        return _overlapping(args, expected, offset_bytes=16)
    if kind == "view_of_input":
        return _overlapping(args, expected, offset_bytes=None)
    if kind == "requires_grad":
        return args, buffer_like(expected).requires_grad_()
    raise AssertionError(kind)


BAD = ["not_a_tensor", "longer", "flattened", "empty", "dtype", "device", "non_contiguous",
       "overlapping", "view_of_input", "requires_grad"]


def _bad_cases() -> list[tuple[str, str]]:
    # an integer buffer (a fixed integer Out dtype) cannot require grad: no such case
    return [(name, kind) for name in OUT_OPS for kind in BAD
            if not (kind == "requires_grad" and isinstance(OPS[name].out.dtype, torch.dtype)
                    and not OPS[name].out.dtype.is_floating_point)]


@pytest.mark.parametrize("name, kind", _bad_cases())
def test_a_bad_out_is_refused_before_anything_is_written(name, kind, backend):
    public, args = OPS[name].public, inputs(name)
    expected = first(public(*args))
    args, out = _bad_out(kind, expected, args)
    before = out.clone() if isinstance(out, torch.Tensor) and out.device.type != "meta" else None
    inputs_before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    with pytest.raises(InvalidInputError) as info:
        public(*args, out=out)
    assert info.value.arg == "out", str(info.value)
    if before is not None:
        assert torch.equal(bits(out.detach()), bits(before.detach()))
    for a, b in zip([a for a in args if isinstance(a, torch.Tensor)], inputs_before):
        assert torch.equal(bits(a), bits(b))


def test_the_errors_say_what_was_expected():
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(InvalidInputError, match=r"'out'.*shape \[\.\.\., D\].* = \[3, 8\].*shape \[3, 9\]"):
        hal.ops.rms_norm(x, w, 1e-6, out=torch.empty(3, 9))
    with pytest.raises(InvalidInputError, match=r"'out'.*dtype float32 \(the dtype of 'x'\).*bfloat16"):
        hal.ops.rms_norm(x, w, 1e-6, out=torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(InvalidInputError, match=r"'out'.*overlapping 'x'"):
        hal.ops.rms_norm(x, w, 1e-6, out=x)


@pytest.mark.parametrize("name", [n for n in OUT_OPS if OPS[n].differentiable])
def test_out_is_refused_when_autograd_records_the_call(name, backend):
    public, args = OPS[name].public, inputs(name)
    expected = first(public(*args))
    tracked = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                    else a for a in args)
    out = buffer_like(expected)
    with pytest.raises(InvalidInputError, match="automatic differentiation") as info:
        public(*tracked, out=out)
    assert info.value.arg == "out"
    assert (out == SENTINEL).all()
    with torch.no_grad():   # nothing records: out= serves
        assert first(public(*tracked, out=out)) is out
    assert_bitwise(out, expected)


@pytest.mark.parametrize("name", OUT_OPS)
def test_a_remembered_call_still_checks_what_its_key_does_not_hold(name, backend):
    # a call with a buffer that passed is remembered under its call key (metadata only):
    # memory overlap and grad mode are still checked on every call
    op = OPS[name]
    op.clear()
    public, args = op.public, inputs(name)
    expected = first(public(*args))
    for _ in range(2):
        out = buffer_like(expected)
        assert first(public(*args, out=out)) is out
    assert len(op._passed_out) == 1
    moved, out = _overlapping(args, expected, offset_bytes=None)
    with pytest.raises(InvalidInputError, match="overlapping") as info:
        public(*moved, out=out)
    assert info.value.arg == "out"
    assert len(op._passed_out) == 1    # the same key: the overlap was found on the remembered path
    if op.differentiable:
        tracked = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                        else a for a in args)
        with torch.no_grad():
            public(*tracked, out=buffer_like(expected))
        out = buffer_like(expected)
        with pytest.raises(InvalidInputError, match="automatic differentiation"):
            public(*tracked, out=out)     # the same key, grad mode now on
        assert (out == SENTINEL).all()


def test_a_value_error_leaves_out_untouched(backend):
    x, w = torch.randn(6, 8), torch.randn(2, 4, 8)
    out = torch.full((6, 4), SENTINEL)
    with pytest.raises(InvalidInputError, match="tokens_per_expert"):
        hal.ops.grouped_gemm(x, w, torch.tensor([2, 3], dtype=torch.int32), out=out)   # sums to 5, not 6
    assert (out == SENTINEL).all()


@pytest.mark.parametrize("name", ["indexer_topk_paged", "sparse_mla_decode_paged", "dense_mla_decode_paged"])
def test_a_paging_error_leaves_out_untouched(name, backend):
    # the native kernels check the block table and lengths themselves, before writing
    public, args = OPS[name].public, inputs(name)
    out = buffer_like(first(public(*args)))
    lens = OPS[name].params.index("context_lens")
    bad = args[:lens] + (torch.full_like(args[lens], 1 << 20),) + args[lens + 1:]
    with pytest.raises(InvalidInputError, match="context_lens"):
        public(*bad, out=out)
    assert (out == SENTINEL).all()


def test_a_buffer_disjoint_from_the_inputs_in_the_same_memory_is_accepted():
    # a workspace slice next to an input's rows (not overlapping them) is fine
    memory = torch.randn(6, 8)
    x, w = memory[:3], torch.randn(8)
    out = memory[3:]
    assert hal.ops.rms_norm(x, w, 1e-6, out=out) is out
    assert_bitwise(out, hal.ops.rms_norm(x, w, 1e-6))


def test_a_strided_input_spans_its_first_to_its_last_element():
    # x: the first 8 columns of 4 rows of 16, elements [0, 56) of the memory; a buffer from
    # element 50 overlaps its last row, one from element 56 does not
    memory, w = torch.randn(100), torch.randn(8)
    x = memory[:64].view(4, 16)[:, :8]
    expected = hal.ops.rms_norm(x, w, 1e-6)
    with pytest.raises(InvalidInputError, match="overlapping 'x'"):
        hal.ops.rms_norm(x, w, 1e-6, out=memory[50:82].view(4, 8))
    out = memory[56:88].view(4, 8)
    assert hal.ops.rms_norm(x, w, 1e-6, out=out) is out
    assert_bitwise(out, expected)


def test_a_buffer_that_saved_for_backward_sees_its_version_bumped():
    # a native write into out bumps its version as an in-place op does, so a graph that
    # saved the old values refuses its backward instead of using the new ones
    x, w = torch.randn(3, 8), torch.randn(8)
    out = torch.randn(3, 8)
    scale = torch.randn(3, 8, requires_grad=True)
    product = scale * out       # saves out
    with hal.use("cpu"):
        hal.ops.rms_norm(x, w, 1e-6, out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()


# -- the cpu backend writes into out ------------------------------------------------------------
@pytest.mark.parametrize("name", OUT_OPS)
def test_the_cpu_kernels_take_out(name):
    impl = hal.get_backend("cpu").impls[name]
    assert impl.takes_out, f"cpu.{name} allocates its output and has it copied into out="


def test_the_cpu_backend_writes_into_out_without_a_cached_buffer():
    # outputs of 1 MiB and more come from the output cache (backends/cpu/buffers.py): with
    # out= none is taken, and the call writes straight into the caller's memory
    x, w = torch.randn(512, 1024), torch.randn(1024)
    with hal.use("cpu"):
        expected = hal.ops.rms_norm(x, w, 1e-6)
        del expected
        before = cpu_backend.cached_output_stats()
        hal.ops.rms_norm(x, w, 1e-6)
        taken = cpu_backend.cached_output_stats()
        assert taken["hits"] + taken["misses"] > before["hits"] + before["misses"]   # a buffer without out=
        out = torch.empty(512, 1024)
        for _ in range(3):
            assert hal.ops.rms_norm(x, w, 1e-6, out=out) is out
        after = cpu_backend.cached_output_stats()
    counters = ("hits", "misses", "uncached")
    assert [after[c] for c in counters] == [taken[c] for c in counters]
    assert_bitwise(out, hal.ops.rms_norm(x, w, 1e-6))


def test_a_backend_without_out_gets_its_result_copied():
    # the reference implementations take no out: dispatch copies their result in
    assert not hal.get_backend("reference").impls["rms_norm"].takes_out
    x, w = torch.randn(3, 8), torch.randn(8)
    out = torch.empty(3, 8)
    with hal.use("reference"):
        assert hal.ops.rms_norm(x, w, 1e-6, out=out) is out
        assert_bitwise(out, hal.ops.rms_norm(x, w, 1e-6))


# -- transforms: the functional custom op, then out.copy_ ----------------------------------------
class OutCall:
    """The op as a function of its tensors and an out buffer (scalars fixed), returning what
    the op returns (a tuple: the buffer first, then any further results)."""

    def __init__(self, name: str):
        self.op = OPS[name]
        self.leaves, self.spec = pytree.tree_flatten(inputs(name))
        self.where = [i for i, a in enumerate(self.leaves) if isinstance(a, torch.Tensor)]
        args = self.args([self.leaves[i] for i in self.where])
        self.expected = self.op.public(*args)

    def args(self, tensors) -> tuple:
        leaves = list(self.leaves)
        for i, t in zip(self.where, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i].clone() for i in self.where]

    def out(self) -> torch.Tensor:
        return buffer_like(first(self.expected))

    def __call__(self, *tensors_and_out):
        *tensors, out = tensors_and_out
        got = self.op.public(*self.args(tensors), out=out)
        return got if isinstance(got, tuple) else (got,)

    def check(self, got) -> None:
        expected = self.expected if isinstance(self.expected, tuple) else (self.expected,)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("tracing", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("name", OUT_OPS)
def test_make_fx(name, tracing, backend):
    call = OutCall(name)
    graph = make_fx(call, tracing_mode=tracing)(*call.tensors, call.out())
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert any(t.startswith(f"glm5_hal.{name}") for t in targets), graph.code
    assert "aten.copy_.default" in targets, graph.code
    out = call.out()
    got = graph(*call.tensors, out)
    assert got[0] is out or torch.equal(got[0], out)
    call.check((out, *got[1:]))


@pytest.mark.parametrize("name", OUT_OPS)
def test_fake_tensor_mode(name, backend):
    call = OutCall(name)
    tensors, out, wrong = call.tensors, call.out(), torch.empty(3, dtype=first(call.expected).dtype)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in tensors]
        out, wrong = mode.from_tensor(out), mode.from_tensor(wrong)
        got = call(*fakes, out)
        assert got[0] is out
        with pytest.raises(InvalidInputError) as info:
            call(*fakes, wrong)
        assert info.value.arg == "out"


@pytest.mark.parametrize("name", OUT_OPS)
def test_vmap(name, backend):
    call = OutCall(name)
    first_inputs = call.tensors
    second_inputs = [t * 0.5 if t.dtype in (torch.float32, torch.bfloat16) else t.clone() for t in first_inputs]
    expected = [call(*ts, call.out()) for ts in (first_inputs, second_inputs)]
    outs = torch.stack([call.out(), call.out()])
    got = torch.vmap(call)(*[torch.stack(pair) for pair in zip(first_inputs, second_inputs)], outs)
    for k, g in enumerate(got):
        torch.testing.assert_close(g, torch.stack([e[k] for e in expected]), rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(outs, torch.stack([e[0] for e in expected]), rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("name", OUT_OPS)
def test_functionalize(name, backend):
    call = OutCall(name)
    out = call.out()
    got = torch.func.functionalize(call)(*call.tensors, out)
    call.check(got)
    call.check((out, *got[1:]))     # the write reached the caller's buffer


@pytest.mark.slow
@pytest.mark.parametrize("name", OUT_OPS)
def test_compile_fullgraph(name, backend):
    call = OutCall(name)
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=False)
    out = call.out()
    got = compiled(*call.tensors, out)
    call.check(got)
    call.check((out, *got[1:]))


@pytest.mark.parametrize("name", OUT_OPS)
def test_an_inference_buffer_is_written_only_inside_inference_mode(name, backend):
    # torch refuses in-place writes to inference tensors outside inference mode; a native
    # write would bypass that, so out= refuses such a buffer first, naming it
    public, args = OPS[name].public, inputs(name)
    expected = first(public(*args))
    with torch.inference_mode():
        out = buffer_like(expected)
    with pytest.raises(InvalidInputError, match="inference tensor outside inference mode") as info:
        public(*args, out=out)
    assert info.value.arg == "out"
    assert (out == SENTINEL).all()
    with torch.inference_mode():
        assert first(public(*args, out=out)) is out
    assert_bitwise(out, expected)
