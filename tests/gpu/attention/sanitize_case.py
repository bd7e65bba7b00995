"""A few small attention launches for compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck python3 tests/gpu/attention/sanitize_case.py

Odd lengths, Sq > Sk with causal (rows that see no key), GQA, a partial last
key block and a partial last query block, for every head dim's default tile.
Exits non-zero if an output is far off, so a silent failure is visible too.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

import attn_runtime as ar  # noqa: E402
from attn_reference import attention_fp32  # noqa: E402


def main():
    fwd = ar.AttentionForward()
    dims = [int(d) for d in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64, 128]
    bad = 0
    for D in dims:
        for causal in (False, True):
            for (Sq, Sk) in ((77, 141), (200, 70), (1, 65)):
                q = torch.randn(1, 4, Sq, D, device="cuda").bfloat16()
                k = torch.randn(1, 2, Sk, D, device="cuda").bfloat16()
                v = torch.randn(1, 2, Sk, D, device="cuda").bfloat16()
                o, lse = fwd(q, k, v, causal=causal)
                torch.cuda.synchronize()
                ref, _, _ = attention_fp32(q, k, v, causal)
                err = (o.float() - ref).abs().max().item()
                ok = err < 2e-2
                bad += not ok
                print(f"D={D} causal={causal} Sq={Sq} Sk={Sk} err={err:.2e} {'ok' if ok else 'BAD'}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
