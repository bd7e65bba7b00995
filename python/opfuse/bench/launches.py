"""Counting what eager PyTorch launches for one call, with torch.profiler.

On CUDA we count kernels. On the CPU there are no kernels to count, so we
count the operators that do work: top-level ATen ops, minus pure view ops
(view, transpose, split, ...) which only rewrite metadata; a view op that
had to copy (reshape of a non-contiguous tensor) still counts.
"""
from __future__ import annotations

import os
import warnings

import torch

VIEW_OPS = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias",
            "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::split",
            "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::narrow",
            "aten::slice", "aten::select", "aten::squeeze", "aten::unsqueeze",
            "aten::as_strided", "aten::alias", "aten::detach", "aten::contiguous",
            "aten::flatten", "aten::unflatten", "aten::view_as", "aten::expand_as",
            "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg"}


def _copies(event) -> bool:
    return any(c.name == "aten::copy_" or _copies(c) for c in event.cpu_children)


def count_eager_launches(fn, inputs: tuple, device: torch.device) -> int:
    # Kineto prints a GPU-probe error on CPU-only machines; it is noise here.
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=activities) as prof:
            fn(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        events = list(prof.events())
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events
               if e.cpu_parent is None and e.name.startswith("aten::")
               and (e.name not in VIEW_OPS or _copies(e)))
