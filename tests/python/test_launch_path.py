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
from opfuse.bench.launch import find_partition
from opfuse.frontend import runtime


def chain(x, b1, b2):
    return torch.relu(x + b1) * 0.5 + b2


def two_outputs(x, b):
    y = x * b
    return y + 1, y.sum(-1)


def partition_of(fn, *args):
    """The one FusedPartition a compiled call goes through, and its arguments."""
    return find_partition(fn, args)


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


# -- the C++ launcher (_C.Launcher): what a call checks before it runs --------

ADD = """graph {
  %0 = input() {name="x"} : f32[s0]
  %1 = input() {name="y"} : f32[s0]
  %2 = add(%0, %1) : f32[s0]
  return (%2)
}"""


class _Counting(_C.Launcher):
    """A launcher whose misses prepare the layout of the inputs (as
    FusedPartition does) and are counted."""

    def __init__(self, graph, positions=None):
        super().__init__(False, positions)
        self.positions = positions
        self.graph = graph
        self.misses = 0
        self.other_device = 0

    def prepared_for(self, tensors, kind=0):
        shapes, strides = [list(t.shape) for t in tensors], [list(t.stride()) for t in tensors]
        variant, _, _ = self.graph.variant(shapes, strides)
        syms = self.graph.bind(shapes)
        n = syms[0]
        p = _C.PreparedRun(self.graph, variant, syms, strides, -1, torch._C._dynamo.guards._empty_strided_cpu,
                           [((n,), (1,), torch.float32)])
        p.set_result(kind, [(2, None)])
        return p

    def _miss(self, *args):
        self.misses += 1
        tensors = [args[i] for i in self.positions] if self.positions is not None else list(args)
        self.push(runtime._layout_check(tensors, runtime._layout_key(tensors, False), False), self.prepared_for(tensors))
        return self(*args)


def test_launcher_runs_the_first_layout_whose_check_accepts():
    g = _C.CompiledGraph(ADD)
    lau = _Counting(g)
    x, y = torch.randn(10), torch.randn(10)
    torch.testing.assert_close(lau(x, y), x + y)
    assert lau.misses == 1
    for _ in range(3):
        torch.testing.assert_close(lau(x, y), x + y)
    assert lau.misses == 1
    # Another size is another layout; a strided input another again.
    x2, y2 = torch.randn(7), torch.randn(7)
    torch.testing.assert_close(lau(x2, y2), x2 + y2)
    xs = torch.randn(20)[::2]
    torch.testing.assert_close(lau(xs, y), xs + y)
    assert lau.misses == 3 and len(lau.recent) == 3
    torch.testing.assert_close(lau(x, y), x + y)  # still among the recent ones
    assert lau.misses == 3


def test_launcher_keeps_eight_recent_layouts():
    g = _C.CompiledGraph(ADD)
    lau = _Counting(g)
    pairs = [(torch.randn(n), torch.randn(n)) for n in range(1, 11)]
    for x, y in pairs:
        lau(x, y)
    assert len(lau.recent) == 8 and lau.misses == 10
    lau(*pairs[-1])
    assert lau.misses == 10
    torch.testing.assert_close(lau(*pairs[0]), pairs[0][0] + pairs[0][1])  # dropped: prepared again
    assert lau.misses == 11
    first = lau.recent[0][1]
    lau.forget(first)
    assert all(p is not first for _, p in lau.recent)
    lau.clear_recent()
    assert lau.recent == []


def test_launcher_result_kinds_and_positions():
    g = _C.CompiledGraph(ADD)
    x, y = torch.randn(5), torch.randn(5)
    lau = _Counting(g, positions=[0, 2])
    torch.testing.assert_close(lau(x, "not a tensor", y), x + y)  # only the tensor arguments reach the kernel
    p = lau.prepared_for([x, y])
    for kind, check in ((1, lambda r: isinstance(r, tuple) and len(r) == 1), (2, lambda r: isinstance(r, list)),
                        (3, lambda r: isinstance(r, list) and len(r) == 1)):
        p.set_result(kind, [(2, None)])
        r = p.finish([x, y])
        assert check(r), kind
        torch.testing.assert_close(r[0], x + y)
    p.set_result(2, [(0, None), (2, (5, 1))])  # an input returned as it is, a written buffer as a view
    a, b = p.finish([x, y])
    assert a is x and b.shape == (5, 1)
    torch.testing.assert_close(b[:, 0], x + y)
    with pytest.raises(ValueError):
        p.set_result(0, [(0, None), (2, None)])
    with pytest.raises(ValueError):
        p.set_result(2, [(9, None)])


def test_launcher_survives_a_check_that_changes_the_recent_layouts():
    """A check that runs Python which pushes (another thread could) must not
    leave the call on a layout that is gone: the call takes the slow path."""
    g = _C.CompiledGraph(ADD)
    lau = _Counting(g)
    x, y = torch.randn(6), torch.randn(6)
    prepared = lau.prepared_for([x, y])

    def meddling(*ts):
        lau.push(lambda *a: False, lau.prepared_for([x, y]))
        return True

    lau.push(meddling, prepared)
    torch.testing.assert_close(lau(x, y), x + y)
    assert lau.misses == 1


def test_launcher_errors():
    g = _C.CompiledGraph(ADD)

    class NoInit(_C.Launcher):
        def __init__(self):
            pass

    with pytest.raises(TypeError, match="__init__"):
        NoInit()(torch.randn(3))
    lau = _C.Launcher(False)
    with pytest.raises(AttributeError, match="_miss"):
        lau(torch.randn(3))  # nothing pushed and no slow path
    x, y = torch.randn(4), torch.randn(4)
    shapes, strides = [[4], [4]], [[1], [1]]
    variant, _, _ = g.variant(shapes, strides)
    with pytest.raises(ValueError, match="allocator"):
        lau.push(lambda *a: True, _C.PreparedRun(g, variant, g.bind(shapes), strides))
    with pytest.raises(ValueError, match="get_device"):
        _C.Launcher(True)
    bad = _C.PreparedRun(g, variant, g.bind(shapes), strides, -1, lambda *a: "not a tensor", [((4,), (1,), torch.float32)])
    lau.push(lambda *a: True, bad)
    with pytest.raises(AttributeError):
        lau(x, y)  # the allocator's result has no data_ptr: Python's error, not a crash


# -- FusedPartition's guard semantics: every change re-prepares or falls back --


def test_changed_layouts_reprepare_and_are_right():
    """Strides and broadcast are the layout: a change is a miss, then a
    recent layout. Another dtype than the compiled one runs eagerly, every
    call a miss. A storage offset is not the layout: the same prepared
    layout runs, and the vector or scalar kernel is picked from the
    pointers."""
    x, b1, b2 = (torch.randn(16, 24) for _ in range(3))
    part, _ = partition_of(torch.compile(chain, backend="opfuse"), x, b1, b2)
    base = torch.randn(16 * 24 + 5)
    cases = {
        "stride": ([torch.randn(24, 16).t(), b1, b2], 1, 0),
        "stride 0": ([x, torch.randn(24).expand(16, 24), b2], 1, 0),
        "float64": ([t.double() for t in (x, b1, b2)], 1, 1),
        "storage offset": ([base[5:].view(16, 24), b1, b2], 0, 0),
        "storage offset, stride 0": ([x, base[3:27].expand(16, 24), b2], 0, 0),
    }
    for name, (args, first, later) in cases.items():
        slow = part.slow_calls
        got = part(*args)
        torch.testing.assert_close(got, chain(*args), msg=name)
        assert got.dtype == args[0].dtype, name
        assert part.slow_calls == slow + first, name
        torch.testing.assert_close(part(*args), chain(*args), msg=name)
        assert part.slow_calls == slow + first + later, name


def test_inputs_on_another_device_run_eagerly():
    """A partition compiled for the CPU, called with meta tensors: PyTorch's
    answer (eager), never the CPU kernel on pointers it cannot read."""
    x, b1, b2 = (torch.randn(8, 8) for _ in range(3))
    part, _ = partition_of(torch.compile(chain, backend="opfuse"), x, b1, b2)
    metas = [t.to("meta") for t in (x, b1, b2)]
    out = part(*metas)
    assert out.device.type == "meta" and out.shape == (8, 8)
    torch.testing.assert_close(part(x, b1, b2), chain(x, b1, b2))


# -- opfuse.ops: GraphKernel is a launcher too ---------------------------------


def _softmax_kernel(dtype=torch.float32, device="cpu"):
    from opfuse.ops import _kernel, norms

    return _kernel.graph_kernel(("softmax", dtype, 2, 1), torch.device(device),
                                lambda: norms._softmax_graph("softmax", _kernel.dtype_name(dtype), 2, 1))


def test_ops_kernel_prepares_each_layout_once(device):
    import opfuse.ops as ops

    k = _softmax_kernel(device=device)
    x = torch.randn(33, 70, device=device)
    wide = torch.randn(33, 150, device=device)
    layouts = {"contiguous": x, "transposed": torch.randn(70, 33, device=device).t(),
               "strided": wide[:, ::2][:, :70], "offset": wide[:, 3:73], "broadcast": torch.randn(70, device=device).expand(33, 70)}
    for name, t in layouts.items():
        ops.softmax(t, -1)
        slow = k.slow_calls
        opfuse.reset_stats()
        for _ in range(3):
            got = ops.softmax(t, -1)
            torch.testing.assert_close(got, torch.softmax(t.double(), -1).float(), msg=name)
        assert k.slow_calls == slow, name  # a recent layout each time
        assert opfuse.stats()["kernel_launches"] == 3, name
    a, b = ops.softmax(x, -1), ops.softmax(x, -1)
    assert a.data_ptr() != b.data_ptr() and a._base is None  # fresh outputs


def test_ops_kernel_refuses_inputs_it_was_not_built_for():
    k = _softmax_kernel()
    x = torch.randn(4, 5)
    torch.testing.assert_close(k(x)[0], torch.softmax(x, -1))
    with pytest.raises(TypeError, match="built for torch.float32"):
        k(x.double())
    with pytest.raises(TypeError, match="takes 1 tensors"):
        k(x, x)
    with pytest.raises(ValueError, match="meta"):
        k(x.to("meta"))
    torch.testing.assert_close(k(x)[0], torch.softmax(x, -1))


@pytest.mark.gpu
def test_ops_kernel_under_cuda_graph_capture():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import opfuse.ops as ops

    x = torch.randn(256, 1000, device="cuda")
    ops.softmax(x, -1)  # prepared outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.softmax(x, -1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.softmax(x, -1)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.softmax(x, -1))


@pytest.mark.gpu
def test_other_current_device():
    """Inputs on cuda:1 while cuda:0 is current: the partition runs eagerly,
    an opfuse.ops kernel runs on its own device."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    import opfuse.ops as ops

    x, b1, b2 = (torch.randn(64, 33, device="cuda:1") for _ in range(3))
    with torch.cuda.device(1):
        part, _ = partition_of(torch.compile(chain, backend="opfuse"), x, b1, b2)
        torch.testing.assert_close(ops.softmax(x, -1), torch.softmax(x, -1))
    with torch.cuda.device(0):
        torch.testing.assert_close(part(x, b1, b2), chain(x, b1, b2))
        torch.testing.assert_close(ops.softmax(x, -1), torch.softmax(x, -1))
    torch.cuda.synchronize(1)


def test_launch_bench_reports_every_layer_per_kernel(capsys):
    """`opfuse bench --suite launch` (quick) on the CPU: both graphs, every
    layer, per call and per fused kernel, in records that pass the schema."""
    from opfuse.bench import launch, records

    info = records.run_info(torch.device("cpu"))
    recs = launch.run_launch_suite(torch.device("cpu"), info, quick=True)
    for r in recs:
        records.validate_record(r)
    got = {(r["case"], r["impl"]): r for r in recs}
    steps = {"loop", "layout check", "alloc + free", "data_ptr", "finish", "run"}
    gemm_steps = {"loop", "layout check", "alloc written", "data_ptr", "bump_launch", "run", "partition python",
                  "partition c++"}
    assert set(got) == ({(f"{g}-host", layer) for g in launch.graphs(torch.device("cpu")) for layer in launch.LAYERS}
                        | {("chain-4K-steps-host", step) for step in steps}
                        | {("mlp-16x32x64-gemm-steps-host", step) for step in gemm_steps})
    assert got[("chain-4K-host", "partition")]["kernels"] == 1
    multi = got[("multi-64x64-host", "partition")]
    assert multi["kernels"] >= 2
    assert multi["host_us_per_kernel"] == pytest.approx(multi["host_us"] / multi["kernels"])
    assert all(r["host_us"] > 0 and r["host_us_min"] <= r["host_us"] for r in recs)
    assert "us/kernel" in capsys.readouterr().out


def test_launch_steps_are_the_partition_calls_own(device):
    """The launch bench's step-by-step rows call what the partition's call
    does: the layout check accepts the inputs, "finish" returns the chain's
    value and "run" writes it into the preallocated output."""
    from opfuse.bench import launch, launch_parts

    dev = torch.device(device)
    fn, args = launch.graphs(dev)["chain-4K"]
    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, backend="opfuse")
    compiled_fn(*args)
    part, part_args = launch.find_partition(compiled_fn, args)
    steps = launch_parts.part_calls(part, part_args, dev)
    assert steps["layout check"]() is True
    torch.testing.assert_close(steps["finish"](), fn(*args))
    out = steps["run"]()[0]
    torch.testing.assert_close(out, fn(*args))
    assert steps["alloc + free"]().shape == out.shape


# -- the driver's floor under the launch path ---------------------------------

@pytest.mark.parametrize("arch", [80, 90])
def test_launch_floor_kernel_compiles(arch):
    """The empty kernel the launch bench times compiles with NVRTC alone (no
    CUDA headers) and takes one argument block the size of the chain's."""
    try:
        _C.nvrtc_version()
    except RuntimeError as e:
        pytest.skip(f"NVRTC not available: {e}")
    cubin, ptx, log = _C.nvrtc_compile(_C.launch_floor_source(), arch, False)
    assert len(cubin) > 0
    # 4 pointers + 1 size + 1 stride, 8 bytes each.
    assert ".param .align 8 .b8 opfuse_launch_floor_param_0[48]" in ptx


@pytest.mark.gpu
def test_launch_bench_reports_the_driver_floor_on_cuda():
    """On CUDA the suite adds the driver's floor: an empty kernel's launch,
    positive, and not above what opfuse's C++ run of the chain costs by
    more than noise (the run does that launch and more)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from opfuse.bench import launch, records

    dev = torch.device("cuda")
    info = records.run_info(dev)
    recs = launch.run_launch_suite(dev, info, quick=True)
    for r in recs:
        records.validate_record(r)
    got = {(r["case"], r["impl"]): r for r in recs}
    assert {step for case, step in got if case == "chain-4K-steps-host"} >= {"device", "stream", "alloc + free"}
    floor = got[("driver-floor-host", "cuLaunchKernel (empty kernel)")]
    assert 0 < floor["host_us_min"] <= floor["host_us"]
    assert floor["host_us_min"] <= 1.5 * got[("chain-4K-host", "run")]["host_us"]
