"""Launches for `ncu` on the Hopper backward: D = 128, S = 4096, bf16, hidden
2048 (B = 4, H = 16) as in bench_attention_bwd.py, each configuration named on
the command line (tags, e.g. wgb64s2 wgb64s2k) run twice in turn, so that
`ncu -k regex:attention_bwd_sm90 --launch-skip N --launch-count N` (N = the
number of tags) profiles the second, warm launch of each.

    ncu --clock-control none -k regex:attention_bwd_sm90 --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight ... python tests/gpu/attention/profile_bwd_sm90.py wgb64s2 wgb64s2k
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch  # noqa: E402

import attn_bwd_runtime as br  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("tags", nargs="+")
pb = br.hopper_bench_problem(ap)
a, bwd = pb.a, pb.bwd
cfgs = [bwd.sm90.BwdSm90Config.parse(t) for t in a.tags]
for _ in range(2):
    for cfg in cfgs:
        bwd(pb.dout, pb.q, pb.k, pb.v, pb.o, pb.lse, causal=a.causal, deterministic=False, tiles=cfg)
torch.cuda.synchronize()
print("launched", ", ".join(a.tags), "twice each", flush=True)
