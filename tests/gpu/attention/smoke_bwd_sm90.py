"""A first launch of the Hopper backward on a few shapes (run under `timeout`: a
deadlocked mbarrier hangs). Prints max errors of dQ, dK, dV against float32
autograd and PyTorch's low-precision autograd; exit 1 when the rule fails."""

import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch  # noqa: E402

import attn_bwd_runtime as br  # noqa: E402
import attn_runtime as ar  # noqa: E402
from test_attention_bwd_gpu import check_grads, randn  # noqa: E402

fwd, bwd = ar.AttentionForward(), br.AttentionBackward()
bad = 0
for D, causal, Sq, Sk, Hq, Hkv in [(128, False, 128, 128, 1, 1), (128, False, 256, 384, 2, 2), (64, False, 256, 384, 2, 2),
                                    (128, True, 300, 517, 4, 2), (64, True, 517, 300, 4, 1), (128, False, 1023, 1024, 2, 2)]:
    q, k, v = (randn(1, h, s, D, dtype=torch.bfloat16, seed=i + D) for i, (h, s) in enumerate([(Hq, Sq), (Hkv, Sk), (Hkv, Sk)]))
    try:
        check_grads(fwd, bwd, q, k, v, causal, seed=3)
        msg = "ok"
    except AssertionError as e:
        msg, bad = f"FAIL {e}", bad + 1
    print(f"D={D} causal={causal} Sq={Sq} Sk={Sk} Hq={Hq} Hkv={Hkv} path={bwd.last_path}: {msg}", flush=True)
# The variant configurations too (an mbarrier or register-pool mistake in one
# of them hangs): a ragged GQA case each through tiles=, against the default.
for D in bwd.sm90.HEAD_DIMS:
    for cfg in bwd.sm90.VARIANTS[D]:
        q, k, v = (randn(1, h, s, D, dtype=torch.bfloat16, seed=i + 7) for i, (h, s) in enumerate([(4, 300), (2, 517), (2, 517)]))
        o, lse = fwd(q, k, v, causal=True)
        dout = randn(*q.shape, dtype=q.dtype, seed=9)
        a = bwd(dout, q, k, v, o, lse, causal=True, tiles=cfg)
        b = bwd(dout, q, k, v, o, lse, causal=True)
        torch.cuda.synchronize()
        err = max((x.float() - y.float()).abs().max().item() / max(1.0, y.float().abs().max().item()) for x, y in zip(a, b))
        ok = err <= 2e-2
        bad += not ok
        print(f"D={D} {cfg.tag()} causal Sq=300 Sk=517 Hq=4 Hkv=2 vs default: rel err {err:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)
sys.exit(1 if bad else 0)
