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

# WAIT_IDLE_S=900 bench/run_cpu.sh: first wait up to that long for the
# 1-minute load average to fall below 0.5 (other builds and tests to finish).
deadline=$(( $(date +%s) + ${WAIT_IDLE_S:-0} ))
while awk '{exit !($1 >= 0.5)}' /proc/loadavg && [ "$(date +%s)" -lt "$deadline" ]; do
  sleep 15
done
echo "load average before the run: $(cut -d' ' -f1-3 /proc/loadavg)"

exec "$PYTHON" -m opfuse.cli bench --device cpu --out bench/results/cpu "$@"
