"""The frontend pass that sends a compiled graph's layer_norm backward to
the wide-row kernel (frontend/route_layer_norm_backward.py), on graphs built
here with fake CUDA tensors, static and with symbolic row counts (dynamic
shapes), so it runs without a GPU; the kernel itself is tested on the GPU in
test_layer_norm_backward_wide.py."""
import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from opfuse.frontend import route_layer_norm_backward as route

aten = torch.ops.aten


@pytest.fixture
def sm90(monkeypatch):
    """Call it after building the graphs: the pass then sees an sm_90 device
    (fake tensors made while torch.cuda.is_available() says yes would
    initialise CUDA)."""
    def enable(capability=(9, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.delenv("OPFUSE_LNBWD_WIDE", raising=False)
    return enable


def _graph(rows, n, dtype, dynamic_rows, n_dynamic=False, norm_arg="size", unbacked_n=False):
    """dy, x, mean, rstd, w, b -> native_layer_norm_backward -> three getitems.
    norm_arg, the normalized_shape argument: "size" x's width as is (a SymInt
    where n_dynamic), "int" the int n (a model's constant), "node" a graph
    input holding x's width (torch.compile(dynamic=True) makes a closure's
    int one). unbacked_n: x's width a SymInt with no example value."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    dims = [DimDynamic.DYNAMIC if dynamic_rows else DimDynamic.STATIC,
            DimDynamic.DYNAMIC if n_dynamic else DimDynamic.STATIC]

    def fake(shape, dt, dyn):
        ctx = StatelessSymbolicContext(dynamic_sizes=dyn)
        return mode.from_tensor(torch.empty(shape, dtype=dt, device="meta"), symbolic_context=ctx)

    shape = fake((rows, n), dtype, dims).shape
    if unbacked_n:
        shape = (shape[0], env.create_unbacked_symint())
    with mode:
        x = torch.empty(shape, dtype=dtype, device="cuda")
        dy = torch.empty_like(x)
        stat = torch.empty(x.shape[0], 1, device="cuda")
        w = torch.empty(x.shape[1], dtype=dtype, device="cuda")
        outs = [torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)]
    g = torch.fx.Graph()
    names = ("dy", "x", "mean", "rstd", "w", "b")
    ph = {k: g.placeholder(k) for k in names}
    for k, v in zip(names, (dy, x, stat, stat, w, w)):
        ph[k].meta["val"] = v
    if norm_arg == "node":
        width = g.placeholder("n")
        width.meta["val"] = x.shape[1]
    else:
        width = n if norm_arg == "int" else x.shape[1]
    node = g.call_function(aten.native_layer_norm_backward.default,
                           (ph["dy"], ph["x"], [width], ph["mean"], ph["rstd"], ph["w"], ph["b"], [True, True, True]))
    node.meta["val"] = outs
    items = [g.call_function(operator.getitem, (node, i)) for i in range(3)]
    g.output(tuple(items))
    return torch.fx.GraphModule(torch.nn.Module(), g), node


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


@pytest.mark.parametrize("dynamic_rows", [False, True])
@pytest.mark.parametrize("n", [256, 768, 4096, 32768])
def test_routes_16_bit_rows_over_192_columns(sm90, n, dynamic_rows):
    gm, node = _graph(4096, n, torch.bfloat16, dynamic_rows)
    sm90()
    assert isinstance(node.meta["val"][0].shape[0], torch.SymInt) == dynamic_rows
    assert route._reason(node) == ""
    assert route.route_layer_norm_backward(gm) == 1
    assert _targets(gm) == [route.layer_norm_backward_wide]
    new = next(n for n in gm.graph.nodes if n.target is route.layer_norm_backward_wide)
    assert new.args[6:] == (1, [True, True, True])
    assert [u.args[1] for u in new.users] == [0, 1, 2]


@pytest.mark.parametrize("dynamic_rows", [False, True])
def test_leaves_what_the_generated_kernels_take(sm90, dynamic_rows):
    for n, dtype in ((128, torch.bfloat16), (4096, torch.float32)):
        gm, node = _graph(4096, n, dtype, dynamic_rows)
        sm90()
        assert "generated kernels" in route._reason(node)
        assert route.route_layer_norm_backward(gm) == 0
        assert _targets(gm) == [aten.native_layer_norm_backward.default]


def test_leaves_unbacked_widths_and_older_devices(sm90, monkeypatch):
    gm, node = _graph(4096, 4096, torch.bfloat16, True, n_dynamic=True, unbacked_n=True)
    old_gm, old_node = _graph(4096, 4096, torch.bfloat16, False)
    sm90()
    assert route._reason(node) == "symbolic normalized sizes without an example value"
    assert route.route_layer_norm_backward(gm) == 0
    sm90((8, 0))
    assert route._reason(old_node) == "older than sm_90"
    gm = old_gm
    monkeypatch.setenv("OPFUSE_LNBWD_WIDE", "0")
    assert route.route_layer_norm_backward(gm) == 0


@pytest.mark.parametrize("norm_arg", ["size", "int", "node"])
@pytest.mark.parametrize("n", [768, 4096])
def test_routes_symbolic_widths_by_their_example(sm90, n, norm_arg):
    """torch.compile(dynamic=True) makes every dim of x symbolic; the
    normalized_shape argument is then the model's int, x's SymInt width, or
    a graph input holding it (a closure's int: what failed on the GPU at
    5bad02b and eb4b140). The int, else the example width, decides as for
    static graphs; try_run checks each call's width."""
    gm, node = _graph(4096, n, torch.bfloat16, True, n_dynamic=True, norm_arg=norm_arg)
    sm90()
    assert isinstance(node.args[1].meta["val"].shape[1], torch.SymInt)
    assert route._reason(node) == ""
    assert route.route_layer_norm_backward(gm) == 1
    assert _targets(gm) == [route.layer_norm_backward_wide]
    small, small_node = _graph(4096, 128, torch.bfloat16, True, n_dynamic=True, norm_arg=norm_arg)
    sm90()
    assert "generated kernels" in route._reason(small_node)
    assert route.route_layer_norm_backward(small) == 0
