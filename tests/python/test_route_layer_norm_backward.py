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


def _graph(rows, n, dtype, dynamic_rows, n_dynamic=False, constant_normalized_shape=False):
    """dy, x, mean, rstd, w, b -> native_layer_norm_backward -> three getitems.
    constant_normalized_shape: the normalized_shape argument is the int n even
    where x's width is symbolic, as in graphs of torch.compile(dynamic=True)
    whose model passes a constant shape."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dims = [DimDynamic.DYNAMIC if dynamic_rows else DimDynamic.STATIC,
            DimDynamic.DYNAMIC if n_dynamic else DimDynamic.STATIC]

    def fake(shape, dt, dyn):
        ctx = StatelessSymbolicContext(dynamic_sizes=dyn)
        return mode.from_tensor(torch.empty(shape, dtype=dt, device="meta"), symbolic_context=ctx)

    shape = fake((rows, n), dtype, dims).shape
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
    node = g.call_function(aten.native_layer_norm_backward.default,
                           (ph["dy"], ph["x"], [n if constant_normalized_shape else x.shape[1]], ph["mean"], ph["rstd"], ph["w"], ph["b"], [True, True, True]))
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


def test_leaves_symbolic_widths_and_older_devices(sm90, monkeypatch):
    gm, node = _graph(4096, 4096, torch.bfloat16, True, n_dynamic=True)
    old_gm, old_node = _graph(4096, 4096, torch.bfloat16, False)
    sm90()
    assert route._reason(node) == "symbolic normalized sizes"
    assert route.route_layer_norm_backward(gm) == 0
    sm90((8, 0))
    assert route._reason(old_node) == "older than sm_90"
    gm = old_gm
    monkeypatch.setenv("OPFUSE_LNBWD_WIDE", "0")
    assert route.route_layer_norm_backward(gm) == 0


@pytest.mark.parametrize("n", [768, 4096])
def test_routes_symbolic_widths_of_a_constant_normalized_shape(sm90, n):
    """torch.compile(dynamic=True) makes every dim of x symbolic, but the
    model's normalized_shape stays an int: that int decides, as for static
    graphs (the GPU test test_dynamic_shapes_route_it_too failed on this)."""
    gm, node = _graph(4096, n, torch.bfloat16, True, n_dynamic=True, constant_normalized_shape=True)
    sm90()
    assert isinstance(node.args[1].meta["val"].shape[1], torch.SymInt)
    assert route._reason(node) == ""
    assert route.route_layer_norm_backward(gm) == 1
    assert _targets(gm) == [route.layer_norm_backward_wide]
    small, _ = _graph(4096, 128, torch.bfloat16, True, n_dynamic=True, constant_normalized_shape=True)
    sm90()
    assert route.route_layer_norm_backward(small) == 0
