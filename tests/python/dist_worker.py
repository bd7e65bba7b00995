"""One rank of the distributed tests (tests/python/test_distributed_cpu.py;
on GPUs tests/gpu/distributed/test_distributed_nccl.py).

Run as a script by the test, once per rank:

    python dist_worker.py MODES RANK WORLD PORT OUT [DEVICE]

MODES is a comma-separated list of "ddp", "fsdp" (FSDP2, each block
compiled) and "fsdp-whole" (FSDP2, the root compiled; not in CI). DEVICE
is "cpu" (the default: gloo) or "cuda" (NCCL, rank r on cuda:r; used by
tests/gpu/distributed/test_distributed_nccl.py). The rank joins the process
group on 127.0.0.1:PORT and, for each mode, trains the same small
transformer twice in that one process group -- first eagerly,
then compiled with torch.compile(backend="opfuse") -- from the same initial
weights on the same data, and saves what the test compares (losses, final
gradients and parameters, opfuse.stats(), Dynamo's counters) to OUT with
torch.save, one dict per mode. Nothing is asserted here: the test reads OUT
and asserts, so a failure reads as a pytest diff, not a dead worker. All
modes run in one process pair because importing torch and opfuse costs a
rank more than ten seconds on a loaded two-core machine.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()

import copy
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from small_models import Block


class TinyTransformer(nn.Module):
    def __init__(self, d_in: int, d: int, heads: int, layers: int, d_out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, heads, qkv_bias=False) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# One model for both modes, so the FSDP2 run finds most kernels in the disk
# cache the DDP run filled. Its size is set by DDP: Dynamo's DDPOptimizer
# asserts that the bucket cap is at least DDP's first bucket (1 MiB), so
# bucket_cap_mb cannot go below 1 and several buckets need more than 1 MiB
# of parameters: d=128 with 2 blocks is ~0.4 M floats (~1.6 MiB), two buckets.
CONFIG = dict(d_in=24, d=128, heads=4, layers=2, d_out=8, batch=2, seq=9, steps=4)


def make_model_and_data(cfg, rank, device):
    # Drawn on the CPU, then moved: the same numbers on either device.
    torch.manual_seed(0)  # same weights on every rank
    model = TinyTransformer(cfg["d_in"], cfg["d"], cfg["heads"], cfg["layers"], cfg["d_out"]).to(device)
    g = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    data = [(torch.randn(cfg["batch"], cfg["seq"], cfg["d_in"], generator=g).to(device),
             torch.randn(cfg["batch"], cfg["seq"], cfg["d_out"], generator=g).to(device))
            for _ in range(cfg["steps"])]
    return model, data


# SGD with momentum, not Adam, in both modes: Adam's first steps move each
# parameter by about lr * sign(grad), so a gradient element that is rounding
# noise (e.g. 1e-9 in one run, -1e-9 in the other) moves the parameter by lr
# in opposite directions, and elementwise parameter equality would need a
# tolerance of lr * steps -- too loose to catch anything.
def _loop(fwd, params_of, opt, data):
    losses = []
    grads = None
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(fwd(x), y)
        loss.backward()
        if i == len(data) - 1:
            grads = params_of("grad")
        opt.step()
        losses.append(loss.detach().item())
    return losses, grads, params_of("param")


def train_ddp(base, data, compile_it):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    dev = next(model.parameters()).device
    ddp = DDP(model, bucket_cap_mb=1, device_ids=[dev.index] if dev.type == "cuda" else None)
    fwd = torch.compile(ddp, backend="opfuse") if compile_it else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def params_of(what):
        # copies on the CPU: the test compares them there
        return {n: (p.grad if what == "grad" else p).detach().to("cpu", copy=True) for n, p in model.named_parameters()}

    return _loop(fwd, params_of, opt, data)


def train_fsdp(base, data, compile_it, mesh, whole=False):
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    if compile_it and not whole:
        # PyTorch's recipe for FSDP2 + torch.compile (torchtitan's): compile
        # each block, then shard. nn.Module.compile compiles in place, so
        # parameter and state_dict names stay as they were; FSDP2's hooks on
        # the block (all-gather before its forward and backward,
        # reduce-scatter after its backward) are dynamo-disabled and run
        # eagerly around the compiled forward. fullgraph=True makes a graph
        # break inside a block an error.
        for blk in model.blocks:
            blk.compile(backend="opfuse", fullgraph=True)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # whole=True (not in CI; kept to reproduce docs/distributed.md): compile
    # the root. Dynamo skips the root frame (FSDP2's hooks are
    # dynamo-disabled and are called inside the loop over blocks) and
    # compiles each block's forward as its own frame.
    fwd = torch.compile(model, backend="opfuse") if compile_it and whole else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def params_of(what):
        # DTensor shards -> full tensors (a collective: every rank calls it)
        return {n: (p.grad if what == "grad" else p).detach().full_tensor().to("cpu", copy=True)
                for n, p in model.named_parameters()}

    return _loop(fwd, params_of, opt, data)


def run_mode(mode, rank, world, bucket_log, device):
    """Eager, then opfuse, for one mode; returns what the test compares."""
    import opfuse
    import torch._dynamo
    from torch._dynamo.utils import counters

    res = {}
    base, data = make_model_and_data(CONFIG, rank, device)
    res["num_params"] = sum(p.numel() for p in base.parameters())
    res["device"] = str(next(base.parameters()).device)
    res["steps"] = len(data)
    if mode == "ddp":
        run = lambda c: train_ddp(base, data, c)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        run = lambda c: train_fsdp(base, data, c, mesh, whole=mode == "fsdp-whole")

    torch._dynamo.reset()
    t0 = time.perf_counter()
    res["eager"] = run(False)
    res["eager_s"] = time.perf_counter() - t0
    opfuse.reset_stats()
    counters.clear()
    bucket_log.buckets.clear()
    t0 = time.perf_counter()
    res["opfuse"] = run(True)
    res["opfuse_s"] = time.perf_counter() - t0
    res["stats"] = opfuse.stats()
    res["aot_graphs"] = counters["aot_autograd"]["total"]  # Dynamo graphs handed to opfuse
    res["graph_breaks"] = sum(counters["graph_break"].values())
    res["ddp_buckets"] = list(bucket_log.buckets)
    dist.barrier()
    return res


def main(argv):
    modes, rank, world, port, out = argv[0].split(","), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    device_type = argv[5] if len(argv) > 5 else "cpu"
    torch.set_num_threads(1)
    result = {"rank": rank, "world": world, "device": device_type}
    try:
        import opfuse  # noqa: F401  (registers the backend)

        result["import_s"] = time.perf_counter() - _T0
        from opfuse.testing import DDPBucketLog

        bucket_log = DDPBucketLog.attach()
        if device_type == "cuda":
            # opfuse runs a CUDA partition only on the current device (else it
            # falls back to eager), so each rank makes its GPU current first.
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            # TF32 off (PyTorch's default, made explicit): the test compares
            # float32 runs with the CPU test's tight tolerances.
            torch.backends.cuda.matmul.allow_tf32 = False
            backend, extra = "nccl", dict(device_id=device)
        else:
            device, backend, extra = torch.device("cpu"), "gloo", {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60 if device.type == "cpu" else 180), **extra)
        result["init_s"] = time.perf_counter() - _T0 - result["import_s"]
    except BaseException:
        result["error"] = traceback.format_exc()
    else:
        # A failure in one mode is recorded and the next mode still runs: a
        # bug that raises on every rank alike leaves the group usable.
        for mode in modes:
            try:
                result[mode] = run_mode(mode, rank, world, bucket_log, device)
            except BaseException:
                result[mode] = {"error": traceback.format_exc()}
        try:
            dist.destroy_process_group()
        except BaseException:
            pass
    torch.save(result, out)
    return 1 if "error" in result or any("error" in result[m] for m in modes if m in result) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
