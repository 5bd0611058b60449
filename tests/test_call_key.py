"""glm5_hal._C.call_key (csrc/bindings_tensors.cpp) and the generated ops' use of it: a call
whose metadata passed the op's check before skips the check, so the key must differ wherever
the check could decide differently, and a remembered key must never let bad input through."""
from __future__ import annotations

import pytest
import torch

import glm5_hal as hal
import glm5_hal.ops  # noqa: F401  (defines the ops)
from glm5_hal import _C, opdef
from glm5_hal.errors import InvalidInputError

def key(plan, *args, pin=None):
    return _C.call_key(plan, pin, *args)


def test_call_key_reads_through_the_getters():
    # the one native reader of tensor metadata: if its getters did not resolve at import,
    # call_key would always return None and every call would run its Python check
    assert _C.tensor_reading() == "getters"
    assert key(b"t", torch.zeros(2)) is not None


def test_equal_metadata_gives_equal_keys():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert key(b"tt", a, a) == key(b"tt", b, a)
    assert key(b"t", torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)) == key(b"t", a)
    pair = (torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.zeros(4))
    assert key(b"k", pair) == key(b"k", list(pair))


@pytest.mark.parametrize("plan, first, second", [
    (b"t", torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16)),
    (b"t", torch.zeros(2, 3), torch.zeros(2, 4)),
    (b"t", torch.zeros(2, 3), torch.zeros(3, 2)),
    (b"t", torch.zeros(6), torch.zeros(2, 3)),
    (b"t", torch.zeros(()), torch.zeros(1)),
    (b"t", torch.zeros(2, 3), torch.zeros(2, 3, device="meta")),
    (b"c", torch.zeros(3, 2), torch.zeros(2, 3).t()),
    (b"T", torch.zeros(2), torch.zeros(2, requires_grad=True)),
    (b"o", None, torch.zeros(2)),
    (b"k", torch.zeros(4, 8), (torch.zeros(4, 8), torch.zeros(4))),
    (b"s", 1, True),
    (b"s", 1, 1.0),
    (b"s", 0, False),
    (b"s", 2, 3),
    (b"s", None, "ue8m0"),
    (b"s", torch.float32, torch.bfloat16),
    (b"s", 1e-6, 1e-5),
], ids=["dtype", "size", "transposed shape", "rank", "0-d", "device", "contiguity", "requires_grad",
        "optional", "key pair", "int-bool", "int-float", "zero-false", "int value", "choice", "dtype arg",
        "float value"])
def test_a_difference_the_check_could_see_gives_another_key(plan, first, second):
    assert key(plan, first) != key(plan, second)


def test_what_is_not_read_does_not_split_keys():
    # contiguity and requires_grad are read only where the plan asks
    assert key(b"t", torch.zeros(3, 2)) == key(b"t", torch.zeros(2, 3).t().contiguous())
    assert key(b"t", torch.zeros(2)) == key(b"t", torch.zeros(2, requires_grad=True))


def test_the_pin_is_part_of_the_key():
    x = torch.zeros(2)
    assert key(b"t", x, pin="reference") != key(b"t", x, pin=None)


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("plan, arg", [
    (b"t", torch.zeros(2).as_subclass(_Sub)),   # a subclass may override what the check reads
    (b"t", 3),
    (b"t", None),
    (b"k", (torch.zeros(2),)),
    (b"k", (torch.zeros(2), torch.zeros(2), torch.zeros(2))),
    (b"s", [1, 2]),
    (b"s", torch.tensor(1)),
    (b"x", torch.zeros(2)),
], ids=["subclass", "int as tensor", "None as tensor", "short pair", "long pair", "list scalar",
        "tensor scalar", "unknown plan code"])
def test_what_it_cannot_read_exactly_gives_no_key(plan, arg):
    assert key(plan, arg) is None


def test_a_plan_must_match_the_arguments():
    with pytest.raises(TypeError, match="one plan code per argument"):
        _C.call_key(b"tt", None, torch.zeros(1))


def test_every_op_reads_its_arguments_through_a_call_key():
    ops = {name: op for name, op in opdef.OPS.items() if op.public.__module__.startswith("glm5_hal.ops.")}
    assert len(ops) >= 27
    for name, op in ops.items():
        assert op.contract.plan is not None, name
        assert len(op.contract.plan) == len(op.params), name
        assert "_call_key(" in op.source, name


def hal_error(fn, *args, match):
    """The InvalidInputError of `fn(*args)` pinned to the reference, which validates nothing
    itself: the error must come from dispatch's own checks, not from a kernel."""
    with hal.use("reference"), pytest.raises(InvalidInputError, match=match) as err:
        fn(*args)
    assert "(backend" not in str(err.value)


def test_a_remembered_call_still_runs_the_value_checks():
    cache = torch.zeros(2, 4, 8)
    values = torch.ones(3, 8)
    with hal.use("reference"):
        hal.ops.kv_cache_write(cache, values, torch.tensor([0, 1, 2]))
    assert any(k[0] == "reference" for k in opdef.lookup("kv_cache_write")._passed)
    # same metadata, an index out of range: the data-dependent check still runs
    hal_error(hal.ops.kv_cache_write, cache, values, torch.tensor([0, 1, 8]), match="slot_mapping")


def test_a_remembered_call_does_not_let_other_metadata_through():
    cache = torch.zeros(2, 4, 8)
    with hal.use("reference"):
        hal.ops.kv_cache_write(cache, torch.ones(1, 8), torch.tensor([0]))
    strided = torch.zeros(2, 8, 4).transpose(1, 2)   # same shape and dtype, not contiguous
    hal_error(hal.ops.kv_cache_write, strided, torch.ones(1, 8), torch.tensor([0]), match="contiguous")
    x, w = torch.randn(3, 8), torch.ones(8)
    hal.ops.rms_norm(x, w, 1e-6)
    hal_error(hal.ops.rms_norm, x, w, float("nan"), match="eps")
    hal_error(hal.ops.rms_norm, x, w, True, match="eps")
    hal_error(hal.ops.rms_norm, x, torch.ones(4), 1e-6, match="weight")


def test_a_tensor_cannot_answer_for_its_own_contiguity():
    # is_contiguous is a method: an attribute set on the tensor would shadow it, so the check
    # calls the class's; a lie must neither pass nor be remembered for honest tensors
    op = opdef.lookup("kv_cache_write")
    op.clear()
    lie = torch.zeros(2, 8, 4).transpose(1, 2)
    lie.is_contiguous = lambda *a, **k: True
    hal_error(hal.ops.kv_cache_write, lie, torch.ones(1, 8), torch.tensor([0]), match="contiguous")
    hal_error(hal.ops.kv_cache_write, torch.zeros(2, 8, 4).transpose(1, 2), torch.ones(1, 8),
              torch.tensor([0]), match="contiguous")
    assert not op._passed


class _ContiguousLie(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.is_contiguous:
            return True
        return func(*args, **(kwargs or {}))


def test_nothing_is_remembered_under_a_torch_function_mode():
    op = opdef.lookup("kv_cache_write")
    op.clear()
    strided = torch.zeros(2, 8, 4).transpose(1, 2)
    with _ContiguousLie(), hal.use("reference"):
        try:   # the mode fools the Python check; the call then goes through torch.ops, whose
            # kernel checks again outside the mode (or the reference's own view() fails)
            hal.ops.kv_cache_write(strided, torch.ones(1, 8), torch.tensor([0]))
        except (RuntimeError, InvalidInputError):
            pass
    assert not op._passed
    hal_error(hal.ops.kv_cache_write, torch.zeros(2, 8, 4).transpose(1, 2), torch.ones(1, 8),
              torch.tensor([0]), match="contiguous")


def test_the_getters_path_declines_under_a_torch_function_mode():
    t = torch.arange(4, dtype=torch.int32)
    assert _C.call_key(b"t", None, t) is not None and _C.sum_of(t) == 6
    with _ContiguousLie():
        assert _C.call_key(b"t", None, t) is None and _C.sum_of(t) is None


def test_a_tensor_cannot_answer_for_its_data_pointer():
    t = torch.arange(4, dtype=torch.int32)
    t.data_ptr = lambda: 16   # the native scan takes the class's data_ptr, not this
    assert _C.sum_of(t) == 6


def test_tensors_whose_storage_holds_no_data_are_not_scanned():
    # under functionalize a CPU tensor is a wrapper without memory of its own: the native scan
    # declines it and the torch formulation runs
    from torch.func import functionalize

    def write(cache, values, slots):
        with hal.use("reference"):
            hal.ops.kv_cache_write(cache, values, slots)
        return cache

    out = functionalize(write)(torch.zeros(2, 4, 8), torch.ones(2, 8), torch.tensor([0, 5]))
    assert out.view(-1, 8)[5].eq(1).all() and out.view(-1, 8)[1].eq(0).all()
    with pytest.raises(InvalidInputError, match="slot_mapping"):
        functionalize(write)(torch.zeros(2, 4, 8), torch.ones(2, 8), torch.tensor([0, 9]))
    assert functionalize(lambda t: torch.tensor(_C.sum_of(t) is None))(torch.arange(3))


def test_requires_grad_after_a_remembered_call_goes_through_autograd():
    x, w = torch.randn(3, 8), torch.ones(8)
    assert hal.ops.rms_norm(x, w, 1e-6).grad_fn is None
    x.requires_grad_()
    out = hal.ops.rms_norm(x, w, 1e-6)
    assert out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad():
        assert hal.ops.rms_norm(x, w, 1e-6).grad_fn is None


def test_remembered_keys_are_bounded(monkeypatch):
    monkeypatch.setattr(opdef, "_PASSED_LIMIT", 8)
    op = opdef.lookup("silu_and_mul")
    for n in range(1, 30):
        hal.ops.silu_and_mul(torch.ones(1, 2 * n))
        assert len(op._passed) <= 8


def test_pinned_calls_are_keyed_apart():
    x, w = torch.randn(3, 8), torch.ones(8)
    expected = hal.ops.rms_norm(x, w, 1e-6)
    with hal.use("reference"):
        assert hal.explain("rms_norm", x, w, 1e-6).chosen == "reference.rms_norm"
        torch.testing.assert_close(hal.ops.rms_norm(x, w, 1e-6), expected)
    pins = {k[0] for k in opdef.lookup("rms_norm")._passed}
    assert {None, "reference"} <= pins


def test_the_torch_custom_op_remembers_calls_too():
    op = opdef.lookup("kv_cache_write")
    op.clear()
    cache, values = torch.zeros(2, 4, 8), torch.ones(2, 8)
    with hal.use("reference"):
        torch.ops.glm5_hal.kv_cache_write(cache, values, torch.tensor([0, 5]))
    assert len(op._passed) == 1 and cache.view(-1, 8)[5].eq(1).all()
    hal_error(torch.ops.glm5_hal.kv_cache_write, cache, values, torch.tensor([0, 8]), match="slot_mapping")
    hal_error(torch.ops.glm5_hal.kv_cache_write, cache, torch.ones(2, 4), torch.tensor([0, 1]), match="values")


def test_more_metadata_than_the_key_holds_gives_no_key():
    # the key's words live on the stack (256): far more than any op's arguments need
    t = torch.zeros((1,) * 8)
    assert key(b"t" * 20, *[t] * 20) is not None            # 20 * 9 words
    assert key(b"t" * 40, *[t] * 40) is None                 # 40 * 9 words


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _key_inside(transform):
    """call_key of a plain tensor read inside `transform` (a function of a tensor)."""
    seen = []

    def probe(t):
        seen.append(key(b"t", torch.zeros(2)))
        return t
    transform(probe)(torch.ones(3))
    return seen[0]


def _in_function_mode(f):
    def run(t):
        with _ContiguousLie():
            return f(t)
    return run


@pytest.mark.parametrize("transform", [
    _in_function_mode,
    lambda f: torch.vmap(f),
    lambda f: lambda t: torch.func.grad(lambda a: f(a).sum())(t),
    lambda f: lambda t: torch.func.jvp(f, (t,), (t,))[0],
    lambda f: torch.func.functionalize(f),
    lambda f: lambda t: torch.jit.trace(f, (t,), check_trace=False)(t),
], ids=["function mode", "vmap", "grad", "jvp", "functionalize", "jit.trace"])
def test_no_key_under_a_transform(transform):
    # a transform's tensors may be wrappers without data: the call must go through torch.ops
    assert key(b"t", torch.zeros(2)) is not None
    assert _key_inside(transform) is None


def test_no_key_under_a_dispatch_mode_or_forward_ad():
    import torch.autograd.forward_ad as forward_ad
    with _Passthrough():
        assert key(b"t", torch.zeros(2)) is None
    with forward_ad.dual_level():
        assert key(b"t", torch.zeros(2)) is None
    assert key(b"t", torch.zeros(2)) is not None


def test_a_remembered_paged_call_does_not_admit_a_cache_that_is_not_paged():
    """kv_cache_write's check reads whether the cache is paged (each block contiguous, blocks
    apart): the call key carries it, so a non-paged cache of the same sizes after a paged one is
    still rejected, and a block-strided page view is still accepted after a contiguous cache."""
    values, slots = torch.randn(2, 8), torch.tensor([0, 5])
    with hal.use("cpu"):
        hal.ops.kv_cache_write(torch.zeros(2, 4, 8), values, slots)
        hal.ops.kv_cache_write(torch.zeros(2, 6, 8)[:, :4], values, slots)    # pages of 6 rows
        with pytest.raises(hal.InvalidInputError, match="a paged layout"):
            hal.ops.kv_cache_write(torch.zeros(2, 8, 4).transpose(1, 2), values, slots)
    plan = opdef.OPS["kv_cache_write"].contract.plan
    assert plan.startswith(b"g")
    keys = {_C.call_key(plan, None, c, values, slots) for c in
            (torch.zeros(2, 4, 8), torch.zeros(2, 6, 8)[:, :4], torch.zeros(2, 8, 4).transpose(1, 2))}
    assert len(keys) == 2    # contiguous and page view are both paged: one key; the transpose another
