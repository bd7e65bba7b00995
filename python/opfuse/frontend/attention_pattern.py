"""Attention written out (matmul, scale, mask, softmax, dropout(p=0), matmul)
in a Dynamo graph, replaced by opfuse.ops.attention: one fused kernel that
never materialises the [B, H, Sq, Sk] scores, with its own backward.

Runs on the torch-level graph Dynamo hands the backend, before AOTAutograd,
so the replacement's autograd formula (not the decomposed one) is what the
backward graph gets. Every candidate (each softmax, each SDPA call) is
recorded with whether it was replaced and why not, for opfuse.explain().

PyTorch's own scaled_dot_product_attention is already a fused kernel (cuDNN
or FlashAttention-2 on an H200); opfuse's forward is at FlashAttention-2's
speed and its backward is not fused yet, so SDPA calls are replaced only
when asked: OPFUSE_ATTENTION=sdpa (or =all).
"""
from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_MATMUL = {operator.matmul, torch.matmul}
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax}
_SDPA = {F.scaled_dot_product_attention, getattr(torch._C._nn, "scaled_dot_product_attention", None)}
_DROPOUT = {F.dropout, torch.dropout, torch.nn.functional.dropout}


@dataclass
class Candidate:
    node: str        # the FX node the pattern ends at (softmax or SDPA call)
    kind: str        # "decomposed" or "sdpa"
    fused: bool
    reason: str      # why not, or what it became


class NoMatch(Exception):
    pass


def _is_fn(n, fns) -> bool:
    return n.op == "call_function" and n.target in fns


def _is_method(n, name) -> bool:
    return n.op == "call_method" and n.target == name


def _val(n):
    return n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None


def _rank(n) -> int:
    v = _val(n)
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _arg(n, i, name, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _single_use(n, user) -> None:
    if len(n.users) != 1 or user not in n.users:
        raise NoMatch(f"{n.name} is also used elsewhere (its value would have to be materialised)")


def _transposed_key(kt) -> torch.fx.Node:
    """k from k^T: transpose(-2, -1), .mT or permute(..., last two swapped)."""
    r = _rank(kt)
    if _is_method(kt, "transpose") or _is_fn(kt, {torch.transpose}):
        d0, d1 = kt.args[1], kt.args[2]
        if {d0 % r, d1 % r} == {r - 2, r - 1}:
            return kt.args[0]
    if _is_method(kt, "permute"):
        dims = kt.args[1:] if not isinstance(kt.args[1], (list, tuple)) else kt.args[1]
        dims = [d % r for d in dims]
        if dims == list(range(r - 2)) + [r - 1, r - 2]:
            return kt.args[0]
    if kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT":
        return kt.args[0]
    raise NoMatch("the second operand of the scores' matmul is not k transposed over its last two dims")


def _match_decomposed(sm, graph):
    """Returns (q, k, v, mask, mask_kind, scale, out_node, dead nodes) or raises NoMatch."""
    dim = _arg(sm, 1, "dim")
    if dim is None or _rank(sm) < 0 or dim % _rank(sm) != _rank(sm) - 1:
        raise NoMatch("softmax is not over the last dim")
    if sm.kwargs.get("dtype") is not None or (len(sm.args) > 2 and sm.args[2] is not None):
        raise NoMatch("softmax with a dtype argument")
    # After the softmax: an optional dropout with p = 0, then @ v.
    user = next(iter(sm.users)) if len(sm.users) == 1 else None
    if user is None:
        raise NoMatch("the probabilities are used more than once (returned or reused)")
    dead = [sm]
    if _is_fn(user, _DROPOUT):
        p = _arg(user, 1, "p", 0.5)
        training = _arg(user, 2, "training", True)
        if p != 0 and training:
            raise NoMatch(f"dropout with p={p} (opfuse's attention has no dropout)")
        if len(user.users) != 1:
            raise NoMatch("the dropout's output is used more than once")
        dead.append(user)
        user = next(iter(user.users))
    if not (_is_fn(user, _MATMUL) and user.args[0] is dead[-1]):
        raise NoMatch("the probabilities do not feed a matmul with v")
    out, v = user, user.args[1]
    # Before the softmax: an optional mask, an optional scale, q @ k^T. Each
    # intermediate must be used only by the next step (nothing else needs
    # the [B, H, Sq, Sk] scores).
    x, consumer, mask, mask_kind, scale = sm.args[0], sm, None, None, 1.0
    if _is_method(x, "masked_fill") and x.args[2] == float("-inf"):
        _single_use(x, consumer)
        mask, mask_kind = x.args[1], "masked_out"
        dead.append(x)
        consumer, x = x, x.args[0]
    elif _is_fn(x, {torch.where}) and len(x.args) == 3 and x.args[2] == float("-inf"):
        _single_use(x, consumer)
        mask, mask_kind = x.args[0], "keep"
        dead.append(x)
        consumer, x = x, x.args[1]
    elif _is_fn(x, {operator.add, torch.add}) and all(isinstance(a, torch.fx.Node) for a in x.args[:2]):
        _single_use(x, consumer)
        a, b = x.args[0], x.args[1]
        scores_side = a if _is_scores(a) else b if _is_scores(b) else None
        if scores_side is None:
            raise NoMatch("an add before the softmax whose operands are not scores and a mask")
        mask, mask_kind = (b if scores_side is a else a), "additive"
        dead.append(x)
        consumer, x = x, scores_side
    if _is_fn(x, {operator.mul, torch.mul}) or _is_fn(x, {operator.truediv, torch.div}):
        is_mul = x.target in (operator.mul, torch.mul)
        c = [a for a in x.args[:2] if isinstance(a, (int, float))]
        t = [a for a in x.args[:2] if isinstance(a, torch.fx.Node)]
        if len(c) == 1 and len(t) == 1 and (is_mul or x.args[1] is c[0]) and c[0] != 0:
            _single_use(x, consumer)
            scale = float(c[0]) if is_mul else 1.0 / float(c[0])
            dead.append(x)
            consumer, x = x, t[0]
    if not _is_fn(x, _MATMUL):
        raise NoMatch("the softmax's input is not (a scaled, masked) q @ k^T")
    _single_use(x, consumer)
    q, kt = x.args[0], x.args[1]
    k = _transposed_key(kt)
    dead.append(x)
    if len(kt.users) == 1:
        dead.append(kt)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if _rank(t) != 4:
            raise NoMatch(f"{name} is not [B, H, S, D] (rank {_rank(t)})")
    qv, kv, vv = (_val(t) for t in (q, k, v))
    if len({t.dtype for t in (qv, kv, vv)}) != 1 or not qv.is_floating_point():
        raise NoMatch("q, k and v do not share one floating dtype")
    if kv.shape != vv.shape or kv.shape[0] != qv.shape[0] or kv.shape[3] != qv.shape[3] or qv.shape[1] % kv.shape[1]:
        raise NoMatch(f"shapes q {list(qv.shape)}, k {list(kv.shape)}, v {list(vv.shape)} are not "
                      "q [B, Hq, Sq, D], k = v [B, Hkv, Sk, D]")
    if mask is not None:
        mv = _val(mask)
        if not isinstance(mv, torch.Tensor):
            raise NoMatch("the mask is not a tensor")
        if (mask_kind == "additive") == (mv.dtype == torch.bool):
            raise NoMatch(f"a {mv.dtype} mask used as {mask_kind}")
    return q, k, v, mask, mask_kind, scale, out, dead


def _is_scores(n) -> bool:
    x = n
    if _is_fn(x, {operator.mul, torch.mul, operator.truediv, torch.div}):
        x = next((a for a in x.args[:2] if isinstance(a, torch.fx.Node)), None)
    return x is not None and _is_fn(x, _MATMUL)


def _replace_decomposed(gm, sm) -> str:
    from ..ops import attention

    q, k, v, mask, mask_kind, scale, out, dead = _match_decomposed(sm, gm.graph)
    g = gm.graph
    with g.inserting_before(out):
        attn_mask = mask
        if mask_kind == "masked_out":  # masked_fill(mask, -inf) drops where mask is True
            attn_mask = g.call_function(torch.logical_not, (mask,))
        new = g.call_function(attention, (q, k, v), {"causal": False, "scale": scale, "attn_mask": attn_mask})
    new.meta.update({k_: v_ for k_, v_ in out.meta.items() if k_ in ("example_value", "val", "stack_trace")})
    out.replace_all_uses_with(new)
    for n in [out] + dead:
        if len(n.users) == 0:
            g.erase_node(n)
    return f"opfuse.ops.attention(scale={scale:.6g}, mask={mask_kind or 'none'})"


def _replace_sdpa(gm, node) -> str:
    from ..ops import attention

    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    p = _arg(node, 4, "dropout_p", 0.0)
    causal = _arg(node, 5, "is_causal", False)
    scale = node.kwargs.get("scale")
    if p not in (0, 0.0):
        raise NoMatch(f"dropout_p={p} (opfuse's attention has no dropout)")
    if node.kwargs.get("enable_gqa") is False and _rank(k) == 4 and _val(q).shape[1] != _val(k).shape[1]:
        raise NoMatch("fewer key/value heads without enable_gqa")
    if any(_rank(t) != 4 for t in (q, k, v)):
        raise NoMatch("q, k, v are not [B, H, S, D]")
    if mask is not None and causal:
        raise NoMatch("both attn_mask and is_causal")
    if causal and _val(q).shape[2] != _val(k).shape[2]:
        raise NoMatch("is_causal with Sq != Sk (SDPA aligns it top-left, opfuse bottom-right)")
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(attention, (q, k, v), {"causal": bool(causal), "scale": scale, "attn_mask": mask})
    new.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ in ("example_value", "val", "stack_trace")})
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return f"opfuse.ops.attention(causal={bool(causal)})"


def fuse_attention(gm: torch.fx.GraphModule) -> list[Candidate]:
    """Replaces the attention patterns of a Dynamo graph in place; returns every candidate."""
    want = os.environ.get("OPFUSE_ATTENTION", "decomposed")
    take_sdpa = want in ("sdpa", "all")
    take_decomposed = want in ("decomposed", "all")
    found = []

    def attempt(n, kind, wanted, why_not, replace):
        if not wanted:
            found.append(Candidate(n.name, kind, False, why_not))
            return False
        try:
            found.append(Candidate(n.name, kind, True, replace(gm, n)))
            return True
        except NoMatch as e:
            found.append(Candidate(n.name, kind, False, str(e)))
            return False

    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _SDPA and n.target is not None:
            changed |= attempt(n, "sdpa", take_sdpa, "left to PyTorch's fused SDPA (cuDNN/flash on the GPU); "
                               "OPFUSE_ATTENTION=sdpa takes it", _replace_sdpa)
        elif _is_fn(n, _SOFTMAX) or _is_method(n, "softmax"):
            changed |= attempt(n, "decomposed", take_decomposed, "OPFUSE_ATTENTION excludes decomposed attention",
                               _replace_decomposed)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return found
