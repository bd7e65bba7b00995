"""opfuse inside PyTorch's distributed engines, on the CPU: two processes,
gloo on 127.0.0.1, a small pre-norm transformer trained with
DistributedDataParallel and with FSDP2 (fully_shard), eagerly and compiled
with torch.compile(backend="opfuse") in the same process group; losses,
gradients and parameters must agree, and opfuse must really have run
kernels. Each rank is tests/python/dist_worker.py run as a subprocess with a
hard time limit (see docs/distributed.md)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import opfuse  # noqa: F401  (loads, and if need be rebuilds, opfuse before the workers start)

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 2
TIMEOUT_S = 240  # for all ranks of one launch together

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own session: it and its children
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _launch_once(mode: str, tmp: Path):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("OPFUSE_DISABLE", None)  # the test is about opfuse running
    outs = [tmp / f"{mode}-rank{r}.pt" for r in range(WORLD)]
    logs = [tmp / f"{mode}-rank{r}.log" for r in range(WORLD)]
    procs = []
    t0 = time.monotonic()
    try:
        for r in range(WORLD):
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), mode, str(r), str(WORLD), str(port), str(outs[r])],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for p in procs:
            p.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        _kill(procs)
        tails = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()[-3000:]}" for r in range(WORLD))
        pytest.fail(f"{mode}: workers did not finish in {TIMEOUT_S} s\n{tails}")
    finally:
        _kill(procs)
    wall = time.monotonic() - t0
    results = [torch.load(o, weights_only=False) if o.exists() else None for o in outs]
    failed = [r for r in range(WORLD) if procs[r].returncode != 0 or results[r] is None or "error" in results[r]]
    text = "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n"
                     f"{(results[r] or {}).get('error', '')}\n{logs[r].read_text()[-3000:]}" for r in failed)
    return results, failed, text, wall


def launch(mode: str, tmp: Path):
    """Runs WORLD ranks of dist_worker.py and returns their results. The port
    is found by binding port 0 and released before rank 0 binds it, so
    another process may take it in between: that case is retried."""
    for attempt in range(3):
        results, failed, text, wall = _launch_once(mode, tmp)
        if not failed:
            print(f"{mode}: {wall:.1f} s wall; " + "; ".join(
                f"rank {r['rank']}: imports {r['import_s']:.1f} s, init {r['init_s']:.1f} s, "
                f"eager {r['eager_s']:.1f} s, opfuse {r['opfuse_s']:.1f} s" for r in results))
            return results
        if "address already in use" not in text.lower():
            break
    pytest.fail(f"{mode}: worker failed\n{text}")


def close(actual, expected, rtol, atol, what):
    if isinstance(actual, dict):
        assert actual.keys() == expected.keys(), what
        for k in actual:
            torch.testing.assert_close(actual[k], expected[k], rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")
    else:
        torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}: {m}")


def check_training(results):
    """Per rank: opfuse's run equals eager's in the same process group; across
    ranks: the gradients were really reduced (equal on both ranks although
    each rank saw different data) and the replicas stayed equal."""
    for res in results:
        r = res["rank"]
        (e_loss, e_grad, e_par), (o_loss, o_grad, o_par) = res["eager"], res["opfuse"]
        assert len(o_loss) == res["steps"]
        close(o_loss, e_loss, 1e-4, 1e-5, f"rank {r} losses")
        close(o_grad, e_grad, 1e-3, 1e-6, f"rank {r} final gradients")
        close(o_par, e_par, 1e-4, 1e-6, f"rank {r} final parameters")
    r0, r1 = results[0], results[1]
    assert r0["eager"][0] != r1["eager"][0], "ranks saw the same data: the reduction is not tested"
    for run in ("eager", "opfuse"):
        close(r1[run][1], r0[run][1], 1e-6, 1e-8, f"{run}: rank 1 vs rank 0 gradients")
        close(r1[run][2], r0[run][2], 1e-6, 1e-8, f"{run}: rank 1 vs rank 0 parameters")


def check_opfuse_ran(res):
    """opfuse compiled graphs and ran its own kernels; the test cannot pass by
    running everything eagerly."""
    s = res["stats"]
    assert s["graphs_compiled"] > 1, s
    assert s["kernels_compiled"] > 0, s
    # every step runs opfuse kernels in the forward and in the backward
    assert s["kernel_launches"] >= 2 * res["steps"], s
    assert isinstance(s["fallback_ops"], int) and s["fallback_ops"] >= 0, s


def test_ddp_compiled_with_opfuse_matches_eager(tmp_path):
    results = launch("ddp", tmp_path)
    check_training(results)
    for res in results:
        check_opfuse_ran(res)
        # Dynamo's DDPOptimizer split the graph at bucket boundaries (bucket_cap_mb=1
        # on ~1.6 MiB of parameters) and each piece went through opfuse.
        assert res["ddp_buckets"] and res["ddp_buckets"][0] >= 2, res["ddp_buckets"]
        assert res["aot_graphs"] == res["ddp_buckets"][0], (res["aot_graphs"], res["ddp_buckets"])


def test_fsdp2_compiled_with_opfuse_matches_eager(tmp_path):
    results = launch("fsdp", tmp_path)
    check_training(results)
    for res in results:
        check_opfuse_ran(res)
        # Each block was compiled with fullgraph=True: one graph (the blocks share
        # it: parameters are graph inputs), no graph breaks.
        assert res["aot_graphs"] >= 1 and res["graph_breaks"] == 0, res
