"""Where a GPT-2 (124M) training step spends its time on one GPU, per
implementation: torch.profiler's CUDA-time table (top kernels) and the step's
wall time. Used to explain bench/ddp_gpt2.py's numbers.

    python bench/profile_gpt2.py [--variants eager,opfuse] [--rows 30] > profile.txt
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ddp_gpt2 import SIZES, build_model  # noqa: E402


def main():
    import torch
    import opfuse

    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="eager,opfuse")
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    cfg = dict(SIZES["gpt2"], batch=args.batch)
    dev = torch.device("cuda")
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dev)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dev)
    for name in args.variants.split(","):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(cfg, "sdpa").to(dev)
        fwd = model if name == "eager" else torch.compile(model, backend="opfuse" if name == "opfuse" else "inductor")
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, y)
            loss.backward()
            opt.step()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 5 * 1e3
        opfuse.reset_stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"\n===== {name}: {ms:.1f} ms/step (batch {cfg['batch']}x{cfg['seq']}), opfuse stats {opfuse.stats()}")
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70)
        print(table)
        del model, opt, fwd
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
