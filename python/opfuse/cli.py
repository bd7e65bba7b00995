"""The `opfuse` command: `opfuse demo` and `opfuse bench`."""
from __future__ import annotations

import argparse
import sys

SUITES = ("chain", "rows", "rows_bwd", "gemm", "launch", "compile")  # the order 'all' runs them in (bench.suites.ALL_SUITES)
SUITE_CHOICES = SUITES + ("all",)


def parse_suites(text: str) -> list[str]:
    """'all' or a comma list such as 'chain,rows' -> ordered, de-duplicated suite names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SUITE_CHOICES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown suite(s) {bad or text!r}; choose from {', '.join(SUITE_CHOICES)}")
    return list(SUITES) if "all" in names else list(dict.fromkeys(names))


def quiet_known_noise() -> None:
    """Silence messages that say nothing about the run on a CPU-only machine."""
    import logging
    import os
    # "No CUDA runtime is found" from Inductor's C++ toolchain probe.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # Kineto's "gpuGetDeviceCount failed" when the profiler starts without a GPU.
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opfuse", description="opfuse: operator fusion "
                                     "for PyTorch. Run the seed's examples or the benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true",
                        help="small sizes and few repetitions (seconds, not minutes)")
    common.add_argument("--impls", default=None,
                        help="comma list from eager,torch.compile,opfuse "
                             "(default: all three; demo --quick: eager,opfuse)")
    common.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda if available, else cpu)")
    common.add_argument("--threads", type=int, default=None,
                        help="CPU threads for eager and compiled code (default: torch's)")

    sub.add_parser("demo", parents=[common],
                   help="the seed's examples: checked against eager, launches, bytes, time")
    bench = sub.add_parser("bench", parents=[common],
                           help="benchmark suites with floors; JSON under bench/results/")
    bench.add_argument("--suite", type=parse_suites, default=parse_suites("all"),
                       help="chain, rows, rows_bwd, gemm, launch, compile, all, or a comma list (default: all)")
    bench.add_argument("--out", default=None,
                       help="directory for the JSON (default: bench/results/<device>/; "
                            "with --quick nothing is written unless --out is given)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_known_noise()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)  # before any compile: Inductor bakes it in
    if args.impls is not None:
        from .bench.impls import parse_impls
        try:
            parse_impls(args.impls)
        except ValueError as exc:
            parser.error(str(exc))
    if args.command == "demo":
        from .demo import run_demo
        return 1 if run_demo(quick=args.quick, impls_text=args.impls,
                             device_name=args.device) else 0

    from .bench.impls import parse_impls
    from .bench.suites import run_bench
    # Quick runs are for smoke-testing; keep them out of the committed results.
    write = args.out is not None or not args.quick
    failures = run_bench(args.suite, parse_impls(args.impls), quick=args.quick,
                         out_dir=args.out, device_name=args.device, write=write)
    if failures:
        print(f"\n{failures} record(s) failed (see ERROR rows)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
