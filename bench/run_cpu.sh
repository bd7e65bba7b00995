#!/usr/bin/env bash
# Run the CPU benchmark suites (chain, rows, compile) side by side for eager,
# torch.compile (Inductor) and opfuse, and write JSON under bench/results/cpu/.
#
#   bench/run_cpu.sh                      # all suites, ~5-10 minutes on 2 cores
#   bench/run_cpu.sh --suite chain,rows   # extra arguments go to `opfuse bench`
#
# Run it on an otherwise idle machine: on a 2-core VM any other process stalls
# every parallel region by a scheduler time slice and the numbers mean nothing
# (the harness warns and records the load average).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

load=$(cut -d' ' -f1 /proc/loadavg)
echo "load average before the run: $load"

exec "$PYTHON" -m opfuse.cli bench --device cpu --out bench/results/cpu "$@"
