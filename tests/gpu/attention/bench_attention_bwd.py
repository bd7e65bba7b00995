"""Attention forward+backward benchmark in the FlashAttention setup.

hidden 2048 (H = 2048 / D), 16k tokens (B = 16384 / S), bf16, D in {64, 128},
causal and not. TFLOP/s of forward+backward with FLOPs = 3.5 x the forward's
4 * B * H * S * S * D (halved when causal); the backward alone is also timed
(2.5 x). opfuse = the forward + the backward through the ctypes harness (on sm_90 at
D = 64 / 128 attention_fwd_sm90.cu + attention_bwd_sm90.cu; "opfuse:bwd-mma"
times the mma.sync backward of attention_bwd.cu beside it; atomic dQ;
"opfuse-det" the deterministic mode, which stays on mma.sync); PyTorch SDPA's flash and
cuDNN backends fwd+bwd (autograd) in the same run; "opfuse-op" the product's
path, opfuse.ops.attention with autograd (when the package is installed). Median of
triton.testing.do_bench; writes JSON records (suite attention_fwd_bwd) to
--out/attention_fwd_bwd-<UTC time>-<commit>.json.

    python tests/gpu/attention/bench_attention_bwd.py --out $OUT [--seqlens 2048,4096] [--no-det]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

import attn_bwd_runtime as br  # noqa: E402
import attn_runtime as ar  # noqa: E402
from bench_attention_fwd import commit_id, print_ratio_table, product_op, results_name, time_rounds  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--seqlens", default="512,2048,4096,8192,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-det", action="store_true", help="skip the deterministic mode")
    ap.add_argument("--variants", action="store_true", help="also time the backward alone on the variant tiles")
    ap.add_argument("--sm90-variants", action="store_true",
                    help="sm_90: also time the Hopper backward's variant configurations and its early-dV A/B")
    ap.add_argument("--fb-tags", default="",
                    help="sm_90: comma-separated Hopper backward tags also timed as forward+backward (opfuse[TAG])")
    ap.add_argument("--skip", default="", help="comma-separated implementations not to time (e.g. opfuse:bwd-mma,late-dv)")
    a = ap.parse_args(argv)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    fwd, bwd = ar.AttentionForward(), br.AttentionBackward()
    late = None
    skip = set(a.skip.split(",")) - {""}
    if a.sm90_variants and bwd.arch.startswith("sm_90") and "late-dv" not in skip:
        # A/B of the Hopper kernel's early dV issue (BwdSm90Tile::kEarlyDV, on
        # at BLOCK_M = 64): the same kernel compiled with it off.
        import functools
        import types

        b90 = bwd.sm90
        src = b90.source().replace("kEarlyDV = BLOCK_M == 64;", "kEarlyDV = false;")
        assert src != b90.source()
        late = br.AttentionBackward()
        late.sm90 = types.SimpleNamespace(**{n: getattr(b90, n) for n in dir(b90) if not n.startswith("__")})
        late.sm90.compile_problem = functools.partial(b90.compile_problem, src=src)
    commit, date = commit_id(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    dev = torch.cuda.get_device_name()
    records, rows = [], []

    def record(case, impl, metric, value):
        records.append(dict(suite="attention_fwd_bwd", case=case, impl=impl, metric=metric, value=value,
                            floor=None, commit=commit, date=date, device=dev))

    out_dir = pathlib.Path(a.out)
    print(f"device {dev}; commit {commit}", flush=True)
    for D in (int(x) for x in a.dims.split(",")):
        for causal in (False, True):
            for S in (int(x) for x in a.seqlens.split(",")):
                B, H = 16384 // S, 2048 // D
                f_fwd = 4 * B * H * S * S * D / (2 if causal else 1)
                case = f"D{D}_S{S}_{'causal' if causal else 'full'}_bf16_B{B}_H{H}"
                g = torch.Generator(device="cuda").manual_seed(S + D)
                q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
                                 for _ in range(4))
                o, lse = fwd(q, k, v, causal=causal)
                grads = tuple(torch.empty_like(t) for t in (q, k, v))

                def ours_fb(det=False, tiles=None):
                    o2, lse2 = fwd(q, k, v, causal=causal)
                    bwd(dout, q, k, v, o2, lse2, causal=causal, deterministic=det, out=grads, tiles=tiles)

                impls = {"opfuse": (lambda: ours_fb(False), 3.5),
                         "opfuse:bwd": (lambda: bwd(dout, q, k, v, o, lse, causal=causal, deterministic=False,
                                                    out=grads), 2.5)}
                if bwd.sm90.HEAD_DIMS.count(D) and bwd.arch.startswith("sm_90"):
                    # The mma.sync backward beside the Hopper one (the default there).
                    impls["opfuse:bwd-mma"] = (lambda: bwd(dout, q, k, v, o, lse, causal=causal, deterministic=False,
                                                           out=grads, tiles=br.choose_tiles(D)), 2.5)
                if not a.no_det:
                    impls["opfuse-det"] = (lambda: ours_fb(True), 3.5)
                if bwd.arch.startswith("sm_90") and D in bwd.sm90.HEAD_DIMS:
                    # Forward+backward with another Hopper backward tile (the issue's
                    # table line, for a variant before it becomes the default).
                    for t in (x for x in a.fb_tags.split(",") if x):
                        cfg = bwd.sm90.BwdSm90Config.parse(t)
                        if cfg.block_m == (128 if D == 64 else 64):
                            impls[f"opfuse[{t}]"] = (lambda cfg=cfg: ours_fb(False, cfg), 3.5)
                if late is not None and D == 128:
                    impls["opfuse:bwd[late-dv]"] = (lambda: late(dout, q, k, v, o, lse, causal=causal,
                                                                 deterministic=False, out=grads), 2.5)
                if a.sm90_variants and bwd.arch.startswith("sm_90") and D in bwd.sm90.HEAD_DIMS:
                    for cfg in bwd.sm90.VARIANTS[D]:
                        impls[f"opfuse:bwd[{cfg.tag()}]"] = (
                            lambda cfg=cfg: bwd(dout, q, k, v, o, lse, causal=causal, deterministic=False, out=grads,
                                                tiles=cfg), 2.5)
                if a.variants:
                    for kv_t, q_t in list(zip(br.DKDV_TILES[D], br.DQ_TILES[D]))[1:]:
                        impls[f"opfuse:bwd[{kv_t.tag()}]"] = (
                            lambda kv_t=kv_t, q_t=q_t: bwd(dout, q, k, v, o, lse, causal=causal, deterministic=False,
                                                           out=grads, tiles=(kv_t, q_t)), 2.5)
                impls = {n: x for n, x in impls.items() if n not in skip}
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                op = product_op()
                if op is not None and "opfuse-op" not in skip:
                    # The product's path (the torch op with autograd, the C++ launchers,
                    # workspaces from PyTorch's allocator), beside the ctypes harness's "opfuse".
                    def run_op():
                        torch.autograd.grad(op(qg, kg, vg, causal=causal), (qg, kg, vg), dout)
                    impls["opfuse-op"] = (run_op, 3.5)
                for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                    def run(backend=backend):
                        with sdpa_kernel(backend):
                            out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        torch.autograd.grad(out, (qg, kg, vg), dout)
                    impls[name] = (run, 3.5)
                # Sanity: our gradients against flash's (bottom-right = top-left when Sq == Sk).
                ours_fb(False)
                try:
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    ref = torch.autograd.grad(out, (qg, kg, vg), dout)
                    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads, ref))
                except RuntimeError as e:
                    diff = float("nan")
                    print(f"  sdpa-flash unavailable: {e}", flush=True)
                row = dict(case=case, D=D, causal=causal, S=S, maxdiff=diff)
                times = time_rounds({name: fn for name, (fn, _) in impls.items()}, a.rounds, case)
                for name, ts in times.items():
                    ms = min(ts)
                    tf = impls[name][1] * f_fwd / ms / 1e9
                    row[name] = tf
                    record(case, name, "TFLOP/s", round(tf, 1))
                    record(case, name, "ms", round(ms, 4))
                rows.append(row)
                out_dir.mkdir(parents=True, exist_ok=True)  # after every case: a cut run keeps what it measured
                (out_dir / results_name("attention_fwd_bwd", commit)).write_text(json.dumps(records, indent=1))
                print(f"{case:34} grad maxdiff vs flash {diff:.2e}  " +
                      "  ".join(f"{n}={row[n]:.0f}" for n in impls if n in row), flush=True)
                del q, k, v, dout, o, lse, grads, qg, kg, vg
                torch.cuda.empty_cache()

    names = ["opfuse", "opfuse-op", "opfuse-det", "opfuse:bwd", "opfuse:bwd-mma", "sdpa-flash", "sdpa-cudnn"]
    names += sorted({n for r in rows for n in r if n.startswith("opfuse:bwd[") or n.startswith("opfuse[")})
    print_ratio_table("TFLOP/s fwd+bwd (opfuse:bwd = backward alone), bf16, hidden 2048, 16k tokens", rows, names, 11)


if __name__ == "__main__":
    main()
