"""GPT-2 small (124M parameters) training steps under DistributedDataParallel:
eager, torch.compile(backend="opfuse") and torch.compile (Inductor), one
after the other in the same process group, on the same weights and data.

    python bench/ddp_gpt2.py --out DIR                      # spawns 2 ranks itself
    torchrun --nproc-per-node 2 bench/ddp_gpt2.py --out DIR
    OMP_NUM_THREADS=1 python bench/ddp_gpt2.py --out DIR --device cpu --size tiny   # gloo, a smoke run

Each step: zero_grad, forward and cross-entropy loss (inside the compiled
model) under bf16 autocast, backward (DDP's allreduce), fused AdamW. Per
variant: the first steps (compilation) are timed apart, then --steps steps
are timed one by one between synchronizations; the step time of a step is
the slowest rank's. Rank 0 writes DIR/ddp_gpt2.json after every variant, so
a variant that fails, hangs or overruns leaves the others' numbers. Without
torchrun's environment the script is its own launcher: it starts --nproc
copies of itself, each in its own session, kills them all if they are not
done 30 s after --time-limit, and exits non-zero if a rank failed, the time
ran out or a variant raised.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta

# NVLink multicast stays off (a rule of the shared GPU machines); set before
# torch loads NCCL, and inherited by every rank the launcher starts.
NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.update(NO_MULTICAST)

SIZES = {
    "gpt2": dict(vocab=50257, seq=1024, layers=12, d=768, heads=12, batch=16),
    "tiny": dict(vocab=512, seq=64, layers=2, d=64, heads=2, batch=2),  # for a CPU smoke run
}
VARIANTS = ("eager", "opfuse", "inductor")  # Inductor last: its compile is the likeliest to fail or overrun


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for ddp_gpt2.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", choices=tuple(SIZES), default="gpt2")
    p.add_argument("--batch", type=int, help="sequences per rank (default: per size)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: per size)")
    p.add_argument("--attn", choices=("sdpa", "math"), default="sdpa",
                   help="F.scaled_dot_product_attention (a fallback op for opfuse) or matmul + mask + softmax")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16", help="autocast dtype; f32: no autocast")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, compilation included (at least 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--nproc", type=int, default=2, help="ranks the launcher starts")
    p.add_argument("--time-limit", type=float, default=300, help="seconds for the whole run (launcher kills after)")
    p.add_argument("--min-left", type=float, default=60,
                   help="a compiled variant starts only if this many seconds of the limit are left")
    return p.parse_args(argv)


# -- the model: GPT-2 small in plain PyTorch ---------------------------------

def build_model(cfg, attn):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(d, -1))
            if attn == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                # The mask is made here, not held as a buffer: DDP would
                # broadcast a buffer before every forward.
                s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
                causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                y = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, vocab, seq, layers, d, heads):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
            for m in self.modules():  # GPT-2's initialisation
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.blocks:
                x = blk(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))

    return GPT(cfg["vocab"], cfg["seq"], cfg["layers"], cfg["d"], cfg["heads"])


def count_params(cfg, attn):
    import torch

    with torch.device("meta"):  # no memory, no initialisation cost
        return sum(p.numel() for p in build_model(cfg, attn).parameters())


# -- one rank ------------------------------------------------------------------

def run_variant(name, cfg, args, device, data, world, bucket_log):
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import opfuse

    torch._dynamo.reset()
    torch.manual_seed(0)  # same weights in every variant and on every rank
    model = build_model(cfg, args.attn).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if name == "eager":
        fwd = ddp
    else:  # compile the DDP wrapper: Dynamo's DDPOptimizer splits the graph at bucket boundaries
        fwd = torch.compile(ddp, backend="opfuse" if name == "opfuse" else "inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    x, y = data
    amp = args.dtype == "bf16"

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    counters.clear()
    bucket_log.buckets.clear()
    opfuse.reset_stats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, warm_s = [], []
    for _ in range(args.warmup):
        sync()
        t0 = time.perf_counter()
        losses.append(step().item())  # .item() synchronizes
        warm_s.append(time.perf_counter() - t0)
    compile_stats = opfuse.stats()
    times = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    run_stats = opfuse.stats()
    # The step time of a step is the slowest rank's.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    times = t.tolist()
    tokens = x.numel() * world
    median = statistics.median(times)
    res = dict(
        step_ms_median=1e3 * median, step_ms_min=1e3 * min(times), step_ms_max=1e3 * max(times),
        tokens_per_s=tokens / median, tokens_per_s_per_gpu=tokens / median / world,
        first_step_s=warm_s[0], warmup_s=sum(warm_s), losses=losses,
        dynamo_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
        aot_graphs=counters["aot_autograd"]["total"], ddp_buckets=list(bucket_log.buckets),
    )
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if name == "opfuse":
        launches = run_stats["kernel_launches"] - compile_stats["kernel_launches"]
        res["opfuse"] = dict(compile_stats, kernel_launches_per_step=launches / args.steps)
    return res


def release(device):
    """Frees the last variant's compiled graphs and memory (also after a failure)."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def worker(args):
    t_start = time.monotonic()
    import torch
    import torch.distributed as dist

    import opfuse  # noqa: F401  (registers the backend)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(args.out, exist_ok=True)
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)  # opfuse launches on the current device only
        torch.backends.cuda.matmul.allow_tf32 = True
        pg = dict(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        pg = dict(backend="gloo")
    # Generous: a collective waits for the slower rank's compilation.
    dist.init_process_group(init_method="env://", timeout=timedelta(seconds=240), **pg)

    cfg = dict(SIZES[args.size])
    cfg["batch"] = args.batch or cfg["batch"]
    cfg["seq"] = args.seq or cfg["seq"]
    g = torch.Generator().manual_seed(1000 + rank)  # different data on each rank, same in every variant
    tokens = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    data = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))

    from opfuse.testing import DDPBucketLog

    bucket_log = DDPBucketLog.attach()

    result = dict(config=dict(cfg, attn=args.attn, dtype=args.dtype, warmup=args.warmup, steps=args.steps,
                              world=world, device=args.device,
                              params=count_params(cfg, args.attn)),
                  env=dict(torch=torch.__version__, commit=os.environ.get("OPFUSE_COMMIT", "unknown"),
                           gpu=torch.cuda.get_device_name(device) if args.device == "cuda" else None,
                           nccl=".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None),
                  variants={}, complete=False)
    out_path = os.path.join(args.out, "ddp_gpt2.json")

    def save():
        if rank == 0:
            with open(out_path + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(out_path + ".tmp", out_path)

    def all_ranks_agree(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    for name in args.variants.split(","):
        left = args.time_limit - (time.monotonic() - t_start)
        if name != "eager" and not all_ranks_agree(left >= args.min_left):
            result["variants"][name] = dict(skipped=f"{left:.0f} s of the time limit left (< {args.min_left:.0f})")
            save()
            continue
        t0 = time.monotonic()
        try:
            res = run_variant(name, cfg, args, device, data, world, bucket_log)
        except Exception:
            # An error raised on every rank alike (e.g. a compile error) leaves
            # the group usable, so the next variant still runs.
            res = dict(error=traceback.format_exc()[-4000:])
            print(f"[rank {rank}] {name} failed:\n{res['error']}", file=sys.stderr, flush=True)
        release(device)
        res["wall_s"] = time.monotonic() - t0
        res["ok_on_all_ranks"] = all_ranks_agree("error" not in res)
        result["variants"][name] = res
        save()
        if rank == 0:
            print(f"{name}: " + (res["error"].splitlines()[-1] if "error" in res else
                                 f"{res['step_ms_median']:.1f} ms/step, {res['tokens_per_s']:.0f} tokens/s, "
                                 f"first step {res['first_step_s']:.1f} s") + f" ({res['wall_s']:.0f} s)", flush=True)
    result["complete"] = True
    save()
    if rank == 0:
        print_summary(result)
    dist.destroy_process_group()


def print_summary(result):
    variants = result["variants"]
    eager = variants.get("eager", {})
    print(f"\nDDP {result['config']['world']} x {result['env']['gpu'] or 'cpu'}, {result['config']['params'] / 1e6:.1f} M "
          f"params, batch {result['config']['batch']} x {result['config']['seq']} per rank, {result['config']['dtype']}")
    print(f"{'variant':10} {'ms/step':>9} {'tokens/s':>11} {'vs eager':>8} {'1st step s':>10} {'loss[0]':>8}")
    for name, r in variants.items():
        if "step_ms_median" not in r:
            why = (r.get("skipped") or r.get("error") or "no result").strip().splitlines()[-1]
            print(f"{name:10} {why[:100]}")
            continue
        speed = eager["step_ms_median"] / r["step_ms_median"] if "step_ms_median" in eager else float("nan")
        print(f"{name:10} {r['step_ms_median']:9.1f} {r['tokens_per_s']:11.0f} {speed:8.2f} {r['first_step_s']:10.1f} "
              f"{r['losses'][0]:8.4f}")
        if "opfuse" in r:
            print(f"{'':10} opfuse: {r['opfuse']}")


# -- the launcher ----------------------------------------------------------------

def launch(args, argv):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(args.out, exist_ok=True)
    # The ranks run in sessions of their own (so that a kill reaches their
    # compile workers too); an outer `timeout` signals only this process, so
    # SIGTERM unwinds through the `finally` below that kills the ranks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs = []
    for r in range(args.nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env,
                                      start_new_session=True))
    deadline = time.monotonic() + args.time_limit + 30  # the workers stop starting variants before it
    timed_out = False
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the rank and its children (compile workers)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.wait()
    codes = [p.returncode for p in procs]
    path = os.path.join(args.out, "ddp_gpt2.json")
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = dict(variants={}, complete=False)
    result["launcher"] = dict(timed_out=timed_out, exit_codes=codes, time_limit_s=args.time_limit)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"launcher: exit codes {codes}{', killed at the time limit' if timed_out else ''}; {path}", flush=True)
    failed = [n for n, v in result.get("variants", {}).items() if "error" in v]
    if failed:
        print(f"launcher: failed variants: {', '.join(failed)} (errors in the JSON)", flush=True)
    return 0 if not timed_out and not any(codes) and result.get("complete") and not failed else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.warmup = max(1, args.warmup)
    if "LOCAL_RANK" in os.environ:  # started by torchrun or by launch()
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
