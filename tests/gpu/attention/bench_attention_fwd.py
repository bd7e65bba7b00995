"""Attention forward benchmark in the FlashAttention setup.

hidden 2048 (H = 2048 / D), 16k tokens (B = 16384 / S), bf16, S in
{512, 2048, 8192, 16384}, D in {64, 128} (--dims), causal and not. TFLOP/s with
FLOPs = 4 * B * H * S * S * D (halved when causal), median time of
triton.testing.do_bench (CUDA events). PyTorch SDPA's flash and cuDNN backends
are timed in the same run. Prints a table; writes JSON records
(suite, case, impl, metric, value, floor, commit, date) to
--out/attention_fwd-<UTC time>-<commit>.json.

    python tests/gpu/attention/bench_attention_fwd.py --out $OUT [--variants] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

import attn_runtime as ar  # noqa: E402


def commit_id() -> str:
    c = os.environ.get("OPFUSE_COMMIT")
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ar.REPO).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def bench_ms(fn) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            fn()
        times = []
        for _ in range(30):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]


def time_rounds(fns: dict, rounds: int, case: str, skip=()) -> dict:
    """{name: [ms per round]}: `rounds` rounds over all of `fns` (name ->
    callable), interleaved, so that clock and thermal drift hit every one
    alike (keep the best). A RuntimeError (backend unavailable) is printed and
    that round of that implementation left out (one that failed every round
    maps to an empty list: callers taking min() of it fail, as before this
    helper existed)."""
    times = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in skip:
                continue
            try:
                times.setdefault(name, []).append(bench_ms(fn))
            except RuntimeError as e:
                print(f"  {case} {name}: {e}", flush=True)
    return times


def product_op():
    """opfuse.ops.attention when the package is installed (the GPU scripts build it), else None."""
    try:
        from opfuse import ops
    except ImportError:
        return None
    return ops.attention


def print_ratio_table(title: str, rows, names, width: int):
    """The summary: one row per (D, causal, S), TFLOP/s per implementation in
    `names`, and opfuse over SDPA's flash and cuDNN backends."""
    print("\n" + title)
    print(f"{'D':>3} {'causal':>6} {'S':>6} " + " ".join(f"{n:>{width}}" for n in names) + "  ours/flash ours/cudnn")
    for r in rows:
        ours, fl, cu = r.get("opfuse"), r.get("sdpa-flash"), r.get("sdpa-cudnn")
        ratio = lambda x, y: f"{x / y:10.2f}" if x and y else f"{'-':>10}"  # noqa: E731
        print(f"{r['D']:>3} {str(r['causal']):>6} {r['S']:>6} " +
              " ".join(f"{r[n]:{width}.0f}" if n in r else f"{'-':>{width}}" for n in names) +
              f" {ratio(ours, fl)} {ratio(ours, cu)}")


def ab_impl(fwd, kernel_file, D, causal, q, k, v, out, lse):
    """The default Hopper tile compiled from another version of the kernel
    file: a config of a subclass (equal fields, unequal config) keys its own
    entry in fwd's function cache, which is filled here from that source."""
    sm = fwd.sm90
    base = sm.default_config_sm90(D, causal)

    class AbConfig(sm.Sm90Config):
        pass

    cfg = AbConfig(**{f.name: getattr(base, f.name) for f in __import__("dataclasses").fields(base)})
    src = sm.sm90_source().replace(sm.KERNEL_SOURCE_SM90.read_text(), pathlib.Path(kernel_file).read_text())
    elem = "bf16" if q.dtype == torch.bfloat16 else "f16"
    info = sm.compile_kernel_sm90(fwd.nvrtc, elem, D, causal, cfg, source=src)
    _, fn = fwd.driver.load_function(info["cubin"], info["lowered"], sm.smem_bytes_sm90(D, cfg))
    fwd._functions[(fwd.driver.current_context(), "sm90", elem, D, causal, cfg, None)] = fn
    return lambda: fwd(q, k, v, causal=causal, config=cfg, out=out, lse=lse)


def variant_tiles(sm, tags, D, causal):
    """The Hopper tiles to time for (D, causal): every variant, or those of --tags that name this D (and mask)."""
    if not tags:
        return sm.configs_sm90(D)
    out = []
    for t in filter(None, tags.split(",")):
        d, tag, *which = t.split(":")
        if int(d) == D and (not which or which[0] == ("causal" if causal else "full")):
            out.append(sm.Sm90Config.parse(tag))
    return out


def results_name(suite: str, commit: str) -> str:
    """<suite>-<UTC time>-<commit>.json: the JSON file of one run (same name for the whole run)."""
    if not hasattr(results_name, "stamp"):
        results_name.stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{suite}-{results_name.stamp}-{commit}.json"


def gemm_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", nargs="?", const="all", choices=["all", "sm90"],
                    help="also time the variant tiles (sm90: only the Hopper kernel's)")
    ap.add_argument("--quick", action="store_true", help="S in {2048, 8192} only")
    ap.add_argument("--seqlens", default=None, help="comma-separated S values")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds; the best median is kept")
    ap.add_argument("--skip", default="", help="comma-separated implementations not to time (e.g. opfuse-mma,sdpa-flash)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="which masks to run")
    ap.add_argument("--dims", default="64,128", help="comma-separated head dims (H = 2048 / D)")
    ap.add_argument("--tags", default=None,
                    help="with --variants sm90: time only these Hopper tiles, comma-separated D:tag[:full|causal] "
                         "(e.g. 128:wg128x176s2pd:full)")
    ap.add_argument("--ab-kernel", default=None,
                    help="another attention_fwd_sm90.cu: its default tile is timed as opfuse@ab, interleaved")
    a = ap.parse_args(argv)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    fwd = ar.AttentionForward()
    commit, date = commit_id(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    dev = torch.cuda.get_device_name()
    records = []

    def record(case, impl, metric, value, suite="attention_fwd"):
        records.append(dict(suite=suite, case=case, impl=impl, metric=metric, value=value, floor=None,
                            commit=commit, date=date, device=dev))

    ceiling = gemm_ceiling()
    record("bf16_gemm_8192", "torch.matmul", "TFLOP/s", round(ceiling, 1), suite="ceiling")
    print(f"device {dev}; bf16 GEMM 8192^3 ceiling {ceiling:.0f} TFLOP/s; commit {commit}", flush=True)

    seqlens = [512, 2048, 8192, 16384]
    if a.quick:
        seqlens = [2048, 8192]
    if a.seqlens:
        seqlens = [int(s) for s in a.seqlens.split(",")]
    rows = []
    for D in (int(d) for d in a.dims.split(",")):
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]:
            for S in seqlens:
                B, H = 16384 // S, 2048 // D
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                case = f"D{D}_S{S}_{'causal' if causal else 'full'}_bf16_B{B}_H{H}"
                g = torch.Generator(device="cuda").manual_seed(S + D)
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(3))
                out = torch.empty_like(q)
                lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
                impls = {}
                # "opfuse" is the default dispatch (sm_90: the Hopper kernel for
                # D = 64, 128, 256 unless OPFUSE_ATTN_SM90=0); "opfuse-mma" the mma.sync tile.
                cfg0 = ar.choose_config(D, S, S, causal, fwd.arch, fwd.smem_limit)
                impls["opfuse"] = lambda: fwd(q, k, v, causal=causal, out=out, lse=lse)
                fwd(q, k, v, causal=causal, out=out, lse=lse)  # sets fwd.last_config (and compiles)
                if fwd.last_config != cfg0:
                    impls["opfuse-mma"] = (lambda cfg=cfg0: fwd(q, k, v, causal=causal, config=cfg, out=out, lse=lse))
                if a.variants and fwd.sm90.sm90_unsupported_reason(fwd.arch, D, S) == "":
                    for cfg in variant_tiles(fwd.sm90, a.tags, D, causal):
                        if cfg != fwd.last_config:
                            impls[f"opfuse[{cfg.tag()}]"] = (
                                lambda cfg=cfg: fwd(q, k, v, causal=causal, config=cfg, out=out, lse=lse))
                if a.ab_kernel and fwd.sm90.sm90_unsupported_reason(fwd.arch, D, S) == "":
                    impls["opfuse@ab"] = ab_impl(fwd, a.ab_kernel, D, causal, q, k, v, out, lse)
                if a.variants == "all":
                    for cfg in [ar.default_config(D, fwd.arch, fwd.smem_limit)] + ar.VARIANT_CONFIGS[D]:
                        if (cfg != cfg0 and f"opfuse[{cfg.tag()}]" not in impls
                                and ar.smem_bytes(D, cfg) <= (fwd.smem_limit or 1 << 30)):
                            impls[f"opfuse[{cfg.tag()}]"] = (
                                lambda cfg=cfg: fwd(q, k, v, causal=causal, config=cfg, out=out, lse=lse))
                op = product_op()
                if op is not None:
                    # The product's path: the torch op, the C++ launcher, workspaces from PyTorch's
                    # allocator (the harness above builds tensor maps and launches through ctypes).
                    impls["opfuse-op"] = lambda: op(q, k, v, causal=causal)
                for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                    def run(backend=backend):
                        with sdpa_kernel(backend):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    impls[name] = run
                # Sanity: our output against flash's (same bottom-right = top-left mask when Sq == Sk).
                fwd(q, k, v, causal=causal, out=out, lse=lse)
                cfg_default = fwd.last_config
                try:
                    ref = impls["sdpa-flash"]()
                    diff = (out.float() - ref.float()).abs().max().item()
                except RuntimeError as e:  # backend unavailable
                    diff = float("nan")
                    print(f"  sdpa-flash unavailable: {e}", flush=True)
                row = dict(case=case, D=D, causal=causal, S=S, maxdiff=diff, cfg=cfg_default.tag())
                # Rounds over all implementations, interleaved, best median kept.
                times = time_rounds(impls, a.rounds, case, skip=set(filter(None, a.skip.split(","))))
                for name, ts in times.items():
                    ms = min(ts)
                    tf = flops / ms / 1e9
                    row[name] = tf
                    record(case, name, "TFLOP/s", round(tf, 1))
                    record(case, name, "ms", round(ms, 4))
                    row[name + ":spread"] = (max(ts) - min(ts)) / min(ts)
                rows.append(row)
                print(f"{case:34} [{cfg_default.tag()}] maxdiff vs flash {diff:.2e}  " +
                      "  ".join(f"{n}={row[n]:.0f}(±{100 * row[n + ':spread']:.0f}%)" for n in impls if n in row),
                      flush=True)
                del q, k, v, out, lse
                torch.cuda.empty_cache()

    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # One file a run (two runs into one folder used to overwrite each other).
    (out_dir / results_name("attention_fwd", commit)).write_text(json.dumps(records, indent=1))

    names = []
    for r in rows:
        for n in r:
            if (n.startswith("opfuse") or n.startswith("sdpa")) and ":" not in n and n not in names:
                names.append(n)
    print_ratio_table("TFLOP/s, bf16, hidden 2048, 16k tokens (B = 16384/S, H = 2048/D)", rows, names, 22)


if __name__ == "__main__":
    main()
