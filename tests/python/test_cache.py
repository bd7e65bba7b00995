"""The disk cache of compiled kernels (OPFUSE_CACHE_DIR, runtime/compile_cache.cpp).

Every check runs the compiler in fresh processes (this file run as a script,
see `worker` below) against a temporary cache directory, so that nothing is
served from the in-process variant cache or from a library already loaded:

- a second process compiling the same graph is a cache hit, through
  `_C.CompiledGraph.variant()` and through `opfuse.stats()`;
- corrupted entries (truncated, bit-flipped, emptied or replaced .so; a
  missing or wrong .sum sidecar; a checksum that matches a file that does not
  load) are detected and rebuilt, never a crash, and results stay correct;
- several processes compiling the same graph at once into one empty cache
  all succeed, agree, and leave no temporary files;
- a cache directory that cannot be created gives a clear error naming it
  (and through torch.compile, an eager fallback with that error logged).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


def chain_graph(scale: float) -> str:
    """The seed's chain relu(x + b1) * scale + b2 beside a softmax of it; the
    scale makes each graph's source (and cache key) distinct."""
    return f"""graph {{
  %0 = input() {{name="x"}} : f32[s0, 37]
  %1 = input() {{name="b1"}} : f32[37]
  %2 = input() {{name="b2"}} : f32[37]
  %3 = add(%0, %1) : f32[s0, 37]
  %4 = relu(%3) : f32[s0, 37]
  %5 = scalar() {{value={scale!r}, weak=true}} : f64[]
  %6 = mul(%4, %5) : f32[s0, 37]
  %7 = add(%6, %2) : f32[s0, 37]
  %8 = softmax(%7) {{dim=-1}} : f32[s0, 37]
  return (%7, %8)
}}"""


def content_hash(data: bytes) -> str:
    """runtime/hash.cpp's content_hash, the checksum in an entry's .sum sidecar."""
    mask = (1 << 64) - 1
    a, b = 0xCBF29CE484222325, 0x84222325CBF29CE4
    for c in data:
        a = ((a ^ c) * 0x100000001B3) & mask
        b = (((b ^ (c + 0x9E)) * 0x100000001B3) + 0x9E3779B97F4A7C15) & mask
    return f"{a:016x}{b:016x}"


# -- the worker: one fresh process ----------------------------------------------------


def load_extension(path: str):
    """opfuse._C straight from its file: the worker needs neither torch nor the
    package (whose import also re-runs the editable build); the test process
    has imported, and so rebuilt, the same file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("opfuse._C", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(args: dict) -> list:
    """Compiles and runs each graph of args["graphs"]; per graph reports
    compiled / cache_hit from variant(), whether the outputs match the oracle,
    the files the cache gained, or the error raised."""
    import numpy as np

    _C = load_extension(args["extension"])
    cpu_dir = Path(_C.cache_dir()) / "cpu"
    if args.get("barrier"):
        Path(args["barrier"] + f".ready.{os.getpid()}").touch()
        deadline = time.time() + 120
        while not os.path.exists(args["barrier"]) and time.time() < deadline:
            time.sleep(0.005)
    results = []
    for text in args["graphs"]:
        before = set(os.listdir(cpu_dir)) if cpu_dir.is_dir() else set()
        r = {}
        try:
            cg = _C.CompiledGraph(text)
            rng = np.random.default_rng(0)
            inputs = [rng.standard_normal(s).astype(np.float32) for s in ((5, 37), (37,), (37,))]
            shapes = [list(a.shape) for a in inputs]
            strides = [[st // a.itemsize for st in a.strides] for a in inputs]
            syms = cg.bind(shapes)
            v, r["compiled"], r["hit"] = cg.variant(shapes, strides)
            # A second request in this process is served from memory.
            _, r["compiled_again"], _ = cg.variant(shapes, strides)
            n_in = len(inputs)
            outs = [np.full(cg.buffer_shape(n_in + i, syms), np.nan, dtype=np.float32)
                    for i in range(len(cg.buffers()) - n_in)]
            cg.run(v, syms, [a.ctypes.data for a in inputs + outs], strides)
            everything = inputs + outs
            got = [everything[i].reshape(cg.output_shape(o, syms)) for o, i in enumerate(cg.output_buffers())]
            want = [np.asarray(w) for _, w in _C.evaluate(text, [a.astype(np.float64) for a in inputs])]
            r["ok"] = len(got) == len(want) and all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))
        except Exception as e:  # reported, so the test can check the message
            r["error"] = f"{type(e).__name__}: {e}"
        after = set(os.listdir(cpu_dir)) if cpu_dir.is_dir() else set()
        r["new_files"] = sorted(after - before)
        results.append(r)
    return results


def extension_path() -> str:
    from opfuse import _C

    return _C.__file__


def run_workers(cache: Path, graphs, n=1, barrier=False, timeout=300):
    """Runs n worker processes at once; returns their result lists."""
    env = dict(os.environ, OPFUSE_CACHE_DIR=str(cache))
    bar = str(cache.parent / f"barrier-{time.time_ns()}") if barrier else None
    args = json.dumps({"graphs": graphs, "barrier": bar, "extension": extension_path()})
    procs = [subprocess.Popen([sys.executable, str(HERE), args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    if barrier:
        deadline = time.time() + timeout
        while len(list(cache.parent.glob(Path(bar).name + ".ready.*"))) < n and time.time() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.01)
        Path(bar).touch()  # all of them compile from here, at once
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"worker exited with {p.returncode}:\n{stdout}\n{stderr[-4000:]}"
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"worker printed no result:\n{stdout}\n{stderr[-4000:]}"
        out.append(json.loads(lines[-1][len("RESULT "):]))
    return out


def entries(cache: Path):
    d = cache / "cpu"
    return sorted(os.listdir(d)) if d.is_dir() else []


def assert_clean(cache: Path):
    """No temporary files left, and every artifact has a sidecar that matches it."""
    names = entries(cache)
    assert not [n for n in names if ".tmp." in n], f"partial files left behind: {names}"
    for n in names:
        if n.endswith(".so"):
            assert n + ".sum" in names, f"{n} has no checksum: {names}"
            data = (cache / "cpu" / n).read_bytes()
            assert (cache / "cpu" / (n + ".sum")).read_text() == content_hash(data), f"{n}: checksum does not match"
        else:
            assert n.endswith(".so.sum") and n[: -len(".sum")] in names, f"stray file {n}: {names}"


# -- the tests -------------------------------------------------------------------------


def test_second_process_hits_the_cache(tmp_path):
    cache = tmp_path / "cache"
    text = chain_graph(0.5)
    (first,) = run_workers(cache, [text])
    assert first == [{"compiled": True, "hit": False, "compiled_again": False, "ok": True,
                      "new_files": first[0]["new_files"]}], first
    so = [n for n in first[0]["new_files"] if n.endswith(".so")]
    assert len(so) == 1 and first[0]["new_files"] == [so[0], so[0] + ".sum"], first
    assert_clean(cache)
    # A fresh process: the same graph is a hit; a different graph a new entry.
    (second,) = run_workers(cache, [text, chain_graph(0.25)])
    assert second[0] == {"compiled": True, "hit": True, "compiled_again": False, "ok": True, "new_files": []}, second
    assert second[1]["hit"] is False and second[1]["ok"] and len(second[1]["new_files"]) == 2, second
    assert len(entries(cache)) == 4
    assert_clean(cache)


STATS_SCRIPT = r"""
import json, torch, opfuse
def f(x, b1, b2):
    return torch.relu(x + b1) * 0.5 + b2
g = torch.Generator().manual_seed(0)
x, b1, b2 = torch.randn(33, 65, generator=g), torch.randn(65, generator=g), torch.randn(65, generator=g)
opfuse.reset_stats()
y = opfuse.compile(f)(x, b1, b2)
s = opfuse.stats()
print("RESULT " + json.dumps({"ok": bool(torch.allclose(y, f(x, b1, b2), rtol=1e-5, atol=1e-6)),
                              "hits": s["cache_hits"], "misses": s["cache_misses"], "launches": s["kernel_launches"]}))
"""


def run_script(cache: Path, script: str, timeout=300):
    env = dict(os.environ, OPFUSE_CACHE_DIR=str(cache))
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}:\n{p.stdout}\n{p.stderr[-4000:]}"
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result:\n{p.stdout}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_stats_count_hits_and_misses_across_processes(tmp_path):
    cache = tmp_path / "cache"
    first = run_script(cache, STATS_SCRIPT)
    assert first == {"ok": True, "hits": 0, "misses": 1, "launches": 1}, first
    second = run_script(cache, STATS_SCRIPT)
    assert second == {"ok": True, "hits": 1, "misses": 0, "launches": 1}, second
    assert_clean(cache)


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path):
    data = bytearray(p.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))


def _garbage_with_matching_sum(p: Path):
    # The checksum passes, the library does not load: the entry must still be rebuilt.
    data = b"\x7fELF this is not a shared object" * 100
    p.write_bytes(data)
    Path(str(p) + ".sum").write_text(content_hash(data))


def _truncated_with_matching_sum(p: Path):
    data = p.read_bytes()[:4096]
    p.write_bytes(data)
    Path(str(p) + ".sum").write_text(content_hash(data))


CORRUPTIONS = {
    "truncated_so": _truncate,
    "flipped_bytes": _flip,
    "empty_so": lambda p: p.write_bytes(b""),
    "deleted_so": lambda p: p.unlink(),
    "deleted_sum": lambda p: Path(str(p) + ".sum").unlink(),
    "wrong_sum": lambda p: Path(str(p) + ".sum").write_text("0" * 32),
    "empty_sum": lambda p: Path(str(p) + ".sum").write_text(""),
    "garbage_so_matching_sum": _garbage_with_matching_sum,
}


def test_corrupted_entries_are_rebuilt(tmp_path):
    """One graph per kind of damage (their entries differ), populated by one
    process, damaged, then compiled again by a fresh process."""
    cache = tmp_path / "cache"
    kinds = list(CORRUPTIONS)
    graphs = [chain_graph(0.5 + i) for i in range(len(kinds))]
    (populate,) = run_workers(cache, graphs)
    so_of = {}
    for kind, r in zip(kinds, populate):
        assert r["ok"] and not r["hit"], (kind, r)
        (so,) = [n for n in r["new_files"] if n.endswith(".so")]
        so_of[kind] = cache / "cpu" / so
    assert_clean(cache)  # the sidecar is the content_hash of the artifact
    for kind, damage in CORRUPTIONS.items():
        damage(so_of[kind])
    (again,) = run_workers(cache, graphs)
    for kind, r in zip(kinds, again):
        assert "error" not in r, (kind, r)
        assert r["ok"], f"{kind}: wrong results after rebuilding: {r}"
        assert r["compiled"] and not r["hit"], f"{kind}: a damaged entry was served from the cache: {r}"
    assert_clean(cache)
    # Repaired entries are ordinary hits again.
    (third,) = run_workers(cache, graphs)
    for kind, r in zip(kinds, third):
        assert r["ok"] and r["hit"], (kind, r)


def test_concurrent_processes_share_one_cache(tmp_path):
    cache = tmp_path / "cache"
    graphs = [chain_graph(0.5), chain_graph(1.5)]
    results = run_workers(cache, graphs, n=4, barrier=True)
    for proc in results:
        for r in proc:
            assert "error" not in r, r
            assert r["ok"] and r["compiled"], r
    names = entries(cache)
    assert not [n for n in names if ".tmp." in n], f"partial files left behind: {names}"
    assert len([n for n in names if n.endswith(".so")]) == 2, names
    assert len([n for n in names if n.endswith(".so.sum")]) == 2, names
    # Whatever the interleaving, a later process loads correct kernels.
    (later,) = run_workers(cache, graphs)
    for r in later:
        assert r["ok"] and "error" not in r, r


def test_unwritable_cache_dir_gives_a_clear_error(tmp_path):
    # A regular file where the cache directory should be: it can be neither
    # created nor written, even by root.
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    cache = blocker / "cache"
    (results,) = run_workers(cache, [chain_graph(0.5)])
    r = results[0]
    assert "error" in r, f"compiled into an impossible cache dir? {r}"
    assert r["error"].startswith("RuntimeError"), r
    assert str(blocker) in r["error"], f"the error does not name the cache path: {r['error']}"
    assert blocker.read_text() == "not a directory"


def test_unwritable_cache_dir_falls_back_to_eager_through_the_frontend(tmp_path, monkeypatch):
    """torch.compile(backend="opfuse") with a cache it cannot write: the
    partition runs eagerly, correctly, with a warning that names the path."""
    import logging

    import torch

    import opfuse

    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(blocker / "cache"))  # read at every compile

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("opfuse")
    logger.addHandler(handler)
    try:
        def f(x, b1, b2):  # a constant no other test uses, so nothing is cached in memory
            return torch.relu(x + b1) * 0.4375 + b2

        g = torch.Generator().manual_seed(0)
        x, b1, b2 = torch.randn(17, 33, generator=g), torch.randn(33, generator=g), torch.randn(33, generator=g)
        opfuse.reset_stats()
        y = opfuse.compile(f)(x, b1, b2)
        stats = opfuse.stats()
    finally:
        logger.removeHandler(handler)
    torch.testing.assert_close(y, f(x, b1, b2))
    assert stats["kernel_launches"] == 0 and stats["fallback_ops"] > 0, stats
    messages = [r.getMessage() for r in records]
    assert any("falls back to eager" in m and str(blocker) in m for m in messages), messages


def test_truncated_so_with_matching_checksum_is_rebuilt(tmp_path):
    """The checksum passes (it was computed over the same truncated bytes) and
    load_library() maps segments past the end of the file: the process dies
    with SIGBUS instead of rebuilding, as it does for a file that fails to load."""
    cache = tmp_path / "cache"
    graphs = [chain_graph(0.5)]
    (populate,) = run_workers(cache, graphs)
    (so,) = [n for n in populate[0]["new_files"] if n.endswith(".so")]
    _truncated_with_matching_sum(cache / "cpu" / so)
    (again,) = run_workers(cache, graphs)  # asserts the worker exited normally
    assert again[0]["ok"] and not again[0]["hit"], again


if __name__ == "__main__":
    print("RESULT " + json.dumps(worker(json.loads(sys.argv[1]))), flush=True)
