"""Training through opfuse: AOTAutograd's forward and backward graphs are
both compiled; losses and gradients match eager's."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse

from small_models import Block


def train(model, steps, data, compile_it):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fwd = torch.compile(model, backend="opfuse") if compile_it else model
    losses = []
    for x, y in data[:steps]:
        opt.zero_grad()
        loss = ((fwd(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    grads = [p.grad.clone() for p in model.parameters()]
    return losses, grads


def check(model, data):
    ref_losses, ref_grads = train(model, 4, data, False)
    opfuse.reset_stats()
    losses, grads = train(model, 4, data, True)
    assert opfuse.stats()["graphs_compiled"] >= 2  # forward and backward
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-5)


def test_mlp_training_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 48), nn.GELU(), nn.LayerNorm(48), nn.Linear(48, 5))
    data = [(torch.randn(37, 24), torch.randn(37, 5)) for _ in range(4)]
    check(model, data)


def test_transformer_block_training_matches_eager():
    torch.manual_seed(1)
    model = Block()
    data = [(torch.randn(3, 11, 32), torch.randn(3, 11, 32)) for _ in range(4)]
    check(model, data)


def test_backward_of_softmax_and_layer_norm_is_fused():
    x = torch.randn(16, 100, requires_grad=True)
    w = torch.randn(100, requires_grad=True)

    def f(x, w):
        return (torch.softmax(torch.nn.functional.layer_norm(x, (100,), w), -1) ** 2).sum()

    fn = torch.compile(f, backend="opfuse")
    fn(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dynamic", [False, True])
def test_layer_norm_weight_gradients_with_no_batch_dims(dynamic):
    # A rank-1 input (or one normalized over all its dims) has no batch dims
    # to sum dweight and dbias over: the IR's sum with no dims summed
    # everything, and the backward fell back (shape [] against [7]).
    def f(x, w, b, m, mw):
        return F.layer_norm(x, x.shape, w, b).tanh(), F.layer_norm(m, m.shape, mw).sin()

    fn = torch.compile(f, backend="opfuse", dynamic=dynamic)
    opfuse.reset_stats()
    for n in (7, 9):
        args = [torch.randn(n), torch.randn(n), torch.randn(n), torch.randn(3, n), torch.randn(3, n)]
        leaves = [a.clone().requires_grad_() for a in args]
        ref = [a.double().requires_grad_() for a in args]
        weights = [torch.randn(n), torch.randn(3, n)]
        got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(fn(*leaves), weights)), leaves)
        want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(f(*ref), weights)), ref)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r.float(), rtol=1e-4, atol=1e-5)
    assert opfuse.stats()["fallback_ops"] == 0
