"""The launch path (FusedPartition.__call__ and _C.PreparedRun): a layout is
prepared once and later calls only check it, so these tests call one
partition directly with inputs that differ in every way a layout can
(strides, dtype, sizes, offsets, requires_grad) and check the results against
eager, which a fast path that keyed on too little would get wrong; and count
the slow path, which a fast path that was not taken would show."""
import threading

import pytest
import torch

import opfuse
from opfuse import _C
from opfuse.frontend import runtime


def chain(x, b1, b2):
    return torch.relu(x + b1) * 0.5 + b2


def two_outputs(x, b):
    y = x * b
    return y + 1, y.sum(-1)


def partition_of(fn, *args):
    """The one FusedPartition a compiled call goes through, and its arguments."""
    found = []
    original = runtime.FusedPartition.__call__

    def spy(self, *a):
        found.append((self, a))
        return original(self, *a)

    runtime.FusedPartition.__call__ = spy
    try:
        fn(*args)
    finally:
        runtime.FusedPartition.__call__ = original
    assert len(found) == 1, f"expected one opfuse partition, found {len(found)}"
    return found[0]


def test_repeated_calls_take_the_fast_path_and_count_exactly(device):
    x, b1, b2 = (torch.randn(64, 33, device=device) for _ in range(3))
    f = torch.compile(chain, backend="opfuse")
    part, args = partition_of(f, x, b1, b2)
    before = part.slow_calls
    opfuse.reset_stats()
    for _ in range(25):
        out = f(x, b1, b2)
    assert part.slow_calls == before  # every call found its layout among the recent ones
    assert opfuse.stats()["kernel_launches"] == 25
    torch.testing.assert_close(out, chain(x, b1, b2))
    opfuse.reset_stats()
    assert opfuse.stats()["kernel_launches"] == 0  # the C++ count is reset too


def _variants(device):
    """Inputs of the chain's compiled layout (64, 33) float32, and others of
    the same shape that differ in strides, offset, dtype or grad."""
    def base():
        return [torch.randn(64, 33, device=device) for _ in range(3)]

    x, b1, b2 = base()
    wide = torch.randn(64, 80, device=device)
    yield "same layout, other tensors", base()
    yield "transposed x", [torch.randn(33, 64, device=device).t(), b1, b2]
    yield "strided x", [wide[:, ::2][:, :33], b1, b2]
    yield "offset x (misaligned)", [wide[:, 1:34], b1, b2]
    yield "broadcast b1 (stride 0)", [x, torch.randn(33, device=device).expand(64, 33), b2]
    yield "float64", [t.double() for t in base()]
    yield "float16", [t.half() for t in base()]
    yield "requires_grad x", [x.clone().requires_grad_(), b1, b2]
    yield "back to the first", [x, b1, b2]


def test_the_fast_path_keys_on_everything_that_matters(device):
    x, b1, b2 = (torch.randn(64, 33, device=device) for _ in range(3))
    part, _ = partition_of(torch.compile(chain, backend="opfuse"), x, b1, b2)
    for name, args in _variants(device):
        for _ in range(2):  # the first call of a layout and a repeated one
            with torch.no_grad():
                got = part(*args)
                want = chain(*args)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            torch.testing.assert_close(got, want, msg=name)


def test_pointer_alignment_is_checked_per_call_within_one_layout(device):
    """Same shape and strides, storage offsets 0 and 1: one layout, and the
    vector or scalar kernel is picked per call from the pointers."""
    base = torch.randn(4 * 1024 + 8, device=device)
    args0 = [base[:4096], torch.randn(4096, device=device), torch.randn(4096, device=device)]
    f = torch.compile(chain, backend="opfuse")
    part, _ = partition_of(f, *args0)
    args1 = [base[1:4097]] + args0[1:]
    for args in (args0, args1, args0, args1):
        torch.testing.assert_close(part(*args), chain(*args))
    assert part.slow_calls <= 1


def test_alternating_layouts_stay_on_the_fast_path(device):
    x, b1, b2 = (torch.randn(64, 33, device=device) for _ in range(3))
    xt = torch.randn(33, 64, device=device).t()
    part, _ = partition_of(torch.compile(chain, backend="opfuse"), x, b1, b2)
    part(x, b1, b2)
    part(xt, b1, b2)
    slow = part.slow_calls
    for _ in range(10):
        torch.testing.assert_close(part(x, b1, b2), chain(x, b1, b2))
        torch.testing.assert_close(part(xt, b1, b2), chain(xt, b1, b2))
    assert part.slow_calls == slow


def test_dynamic_sizes_get_a_layout_each(device):
    """Symbolic sizes: one partition, called with several sizes (and SymInt
    arguments beside the tensors)."""
    f = torch.compile(chain, backend="opfuse", dynamic=True)
    sizes = [(5, 7), (64, 33), (1, 1000), (5, 7)]
    part, args = partition_of(f, *(torch.randn(3, 9, device=device) for _ in range(3)))
    tensor_positions = part.tensor_positions
    for shape in sizes:
        xs = [torch.randn(*shape, device=device) for _ in range(3)]
        call_args = list(args)
        for i, t in zip(tensor_positions, xs):
            call_args[i] = t
        # The SymInt arguments are the sizes Dynamo passes: the new shape's.
        sym_values = iter(shape)
        for i, a in enumerate(call_args):
            if isinstance(a, int):
                call_args[i] = next(sym_values)
        torch.testing.assert_close(part(*call_args), chain(*xs), msg=str(shape))
    assert part.slow_calls <= 1 + len(set(sizes))


def test_outputs_are_fresh_tensors_of_their_own(device):
    """No output shares storage with another call's or another output: users
    may keep, mutate, resize or save them."""
    x, b = torch.randn(16, 40, device=device), torch.randn(40, device=device)
    f = torch.compile(two_outputs, backend="opfuse")
    a1, s1 = f(x, b)
    a2, s2 = f(x, b)
    ptrs = {a1.data_ptr(), s1.data_ptr(), a2.data_ptr(), s2.data_ptr()}
    assert len(ptrs) == 4
    for t in (a1, s1):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert t._base is None
    a1.add_(1)
    torch.testing.assert_close(a2, two_outputs(x, b)[0])
    s1.resize_(100)
    torch.testing.assert_close(s2, two_outputs(x, b)[1])


def test_training_outputs_can_be_modified_in_place():
    """Outputs of the compiled forward that require grad are not views, so
    autograd lets the user modify them in place."""
    x = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    f = torch.compile(lambda x, b: torch.relu(x + b) * 2, backend="opfuse")
    y = f(x, b)
    y.mul_(3)
    y.sum().backward()
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (torch.relu(x2 + b2) * 2 * 3).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_calls_from_several_threads_count_exactly():
    x, b1, b2 = (torch.randn(32, 32) for _ in range(3))
    f = torch.compile(chain, backend="opfuse")
    f(x, b1, b2)
    opfuse.reset_stats()
    errors = []

    def work():
        try:
            for _ in range(50):
                torch.testing.assert_close(f(x, b1, b2), chain(x, b1, b2))
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert opfuse.stats()["kernel_launches"] == 200


def test_prepared_run_checks_its_pointers():
    g = _C.CompiledGraph("""graph {
  %0 = input() {name="x"} : f32[s0]
  %1 = input() {name="y"} : f32[s0]
  %2 = add(%0, %1) : f32[s0]
  return (%2)
}""")
    x, y = torch.randn(10), torch.randn(10)
    shapes, strides = [[10], [10]], [[1], [1]]
    variant, _, _ = g.variant(shapes, strides)
    p = _C.PreparedRun(g, variant, g.bind(shapes), strides)
    out = torch.empty(10)
    with pytest.raises(ValueError, match="pointers"):
        p.launch([x.data_ptr(), y.data_ptr()])
    p.launch([x.data_ptr(), y.data_ptr(), out.data_ptr()])
    torch.testing.assert_close(out, x + y)
    with pytest.raises(RuntimeError, match="allocator"):
        p.call([x, y])  # built without one
