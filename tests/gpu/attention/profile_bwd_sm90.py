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
import attn_runtime as ar  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("tags", nargs="+")
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--s", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
a = ap.parse_args()
S, D = a.s, a.d
B, H = 16384 // S, 2048 // D
g = torch.Generator(device="cuda").manual_seed(S + D)
q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
fwd, bwd = ar.AttentionForward(), br.AttentionBackward()
o, lse = fwd(q, k, v, causal=a.causal)
cfgs = [bwd.sm90.BwdSm90Config.parse(t) for t in a.tags]
for _ in range(2):
    for cfg in cfgs:
        bwd(dout, q, k, v, o, lse, causal=a.causal, deterministic=False, tiles=cfg)
torch.cuda.synchronize()
print("launched", ", ".join(a.tags), "twice each", flush=True)
