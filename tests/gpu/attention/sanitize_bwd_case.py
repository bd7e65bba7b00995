"""Small backward launches for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool racecheck python tests/gpu/attention/sanitize_bwd_case.py [D,...]

Odd sizes, GQA, causal with Sq > Sk, both dQ modes, every head dim given
(default 64,128,256: the key-group split of D = 256 included).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

import attn_bwd_runtime as br  # noqa: E402
import attn_runtime as ar  # noqa: E402


def main():
    dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
    fwd, bwd = ar.AttentionForward(), br.AttentionBackward()
    for D in dims:
        for causal in (False, True):
            for det in (False, True):
                for Sq, Sk in ((77, 131), (150, 70)):
                    q = torch.randn(1, 4, Sq, D, device="cuda", dtype=torch.bfloat16)
                    k = torch.randn(1, 2, Sk, D, device="cuda", dtype=torch.bfloat16)
                    v = torch.randn(1, 2, Sk, D, device="cuda", dtype=torch.bfloat16)
                    o, lse = fwd(q, k, v, causal=causal)
                    dq, dk, dv = bwd(torch.randn_like(q), q, k, v, o, lse, causal=causal, deterministic=det)
                    torch.cuda.synchronize()
                    bad = any(torch.isnan(t).any().item() for t in (dq, dk, dv))
                    print(f"D={D} causal={causal} det={det} Sq={Sq} Sk={Sk}: {'NaN!' if bad else 'ok'}", flush=True)
                    if bad:
                        sys.exit(3)


if __name__ == "__main__":
    main()
