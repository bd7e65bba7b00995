"""opfuse's benchmark harness: timing, measured ceilings, floors, suites, records.

Importing it does not need opfuse's compiled core; 'opfuse' is just one of the
implementations (see impls.py) and is reported as an error if it is missing.
"""
from .ceilings import measure_copy_bandwidth
from .floors import bytes_moved, floor_ms
from .suites import ALL_SUITES, run_bench
from .timing import Timing, benchmark, summarize

__all__ = ["ALL_SUITES", "Timing", "benchmark", "bytes_moved", "floor_ms",
           "measure_copy_bandwidth", "run_bench", "summarize"]
