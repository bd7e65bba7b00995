"""Balance of the Hopper attention forward's static schedules, counted on the CPU.

Mirrors the slot functions of src/kernels/attention/attention_fwd_sm90_schedule.cu
(`cta_tile`: snake rounds, or the causal pairs schedule) and prints, for the
FlashAttention setup (hidden 2048, 16k tokens), each CTA's work in key
blocks (plus `--tile-cost` blocks for a tile's fixed costs), the makespan
over the mean (the imbalance) and the split tail's makespan
(`cta_split_tile`: whole rounds, then the tail cut into equal ranges;
causal: `cta_causal_split_tile`, the pairs schedule's whole item rounds,
then its tail cut the same way). A model of the schedule, not of the kernel's speed: it says how much
a perfect balance could gain, before any GPU time is spent.

    python3 scripts/attention_schedule_balance.py [--sms 132] [--tile-cost 0]
"""

from __future__ import annotations

import argparse
import math


def n_blocks(x: int, block_m: int, block_n: int, s: int, causal: bool) -> int:
    """Key blocks of query block x (Sq = Sk = s), as tile_at counts them."""
    key_end = min((x + 1) * block_m, s) if causal else s
    return math.ceil(key_end / block_n)


def rounds_work(s, block_m, block_n, hbs, g, causal, pairs, tile_cost):
    num_m = math.ceil(s / block_m)
    work = [0.0] * g
    if causal and pairs:
        p2 = num_m // 2
        n_items = p2 * hbs
        for k in range(2 * math.ceil(n_items / g)):
            for i in range(g):
                j = (k >> 1) * g + i
                if j < n_items:
                    pr = j % p2
                    x = pr if k & 1 else num_m - 1 - pr
                    work[i] += tile_cost + n_blocks(x, block_m, block_n, s, True)
        if num_m & 1:
            for r in range(math.ceil(hbs / g)):
                for i in range(g):
                    if r * g + (g - 1 - i) < hbs:
                        work[i] += tile_cost + n_blocks(num_m // 2, block_m, block_n, s, True)
    else:
        tiles = num_m * hbs
        for t in range(tiles):
            k, r = divmod(t, g)
            i = g - 1 - r if k & 1 else r
            x = (num_m - 1 - t // hbs) if causal else t % num_m
            work[i] += tile_cost + n_blocks(x, block_m, block_n, s, causal)
    return work


def split_makespan(s, block_m, block_n, hbs, g, tile_cost):
    """Non-causal split tail: R = tiles / G - 1 whole rounds, then equal ranges of the tail's iterations
    (a cut tile's two pieces each pay the tile cost)."""
    num_m = math.ceil(s / block_m)
    tiles, nb = num_m * hbs, n_blocks(0, block_m, block_n, s, False)
    r = max(tiles // g - 1, 0)
    t_tail = (tiles - r * g) * nb
    worst = 0.0
    for i in range(g):
        lo, hi = t_tail * i // g, t_tail * (i + 1) // g
        pieces = (hi - 1) // nb - lo // nb + 1
        worst = max(worst, r * (tile_cost + nb) + (hi - lo) + pieces * tile_cost)
    return worst


def causal_split_makespan(s, block_m, block_n, hbs, g, tile_cost):
    """Causal split tail (`cta_causal_split_tile`): R = NP / G - 1 whole pair-item rounds, then the tail
    (items [R G, NP), long tile then short, then the middles) cut into equal ranges of iterations."""
    num_m = math.ceil(s / block_m)
    p2 = num_m // 2
    n_items = p2 * hbs
    blocks = [n_blocks(x, block_m, block_n, s, True) for x in range(num_m)]
    r = max(n_items // g - 1, 0)
    work = [0.0] * g
    for k in range(r):
        for i in range(g):
            pr = (k * g + i) % p2
            work[i] += 2 * tile_cost + blocks[num_m - 1 - pr] + blocks[pr]
    tail = [blocks[num_m - 1 - j % p2] if u == 0 else blocks[j % p2] for j in range(r * g, n_items) for u in (0, 1)]
    tail += [blocks[num_m // 2]] * (hbs if num_m & 1 else 0)
    offsets = [0]
    for length in tail:
        offsets.append(offsets[-1] + length)
    t_tail = offsets[-1]
    for i in range(g):
        lo, hi = t_tail * i // g, t_tail * (i + 1) // g
        pieces = sum(1 for u, length in enumerate(tail) if offsets[u] < hi and offsets[u] + length > lo)
        work[i] += (hi - lo) + pieces * tile_cost
    return max(work)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--tile-cost", type=float, default=0.0, help="a tile's fixed cost, in key blocks")
    a = ap.parse_args(argv)
    print(f"{a.sms} CTAs, tile cost {a.tile_cost} key blocks; work in key blocks")
    for d, block_m, heads in ((64, 192, 32), (128, 128, 16)):
        for causal in (False, True):
            for s in (2048, 8192, 16384):
                hbs = 16384 // s * heads
                work = rounds_work(s, block_m, 128, hbs, a.sms, causal, causal, a.tile_cost)
                mean = sum(work) / a.sms
                line = (f"D{d:<4}{'causal' if causal else 'full':7}S{s:<6} rounds: makespan {max(work):8.1f} "
                        f"mean {mean:8.1f} imbalance {100 * (max(work) / mean - 1):4.1f}%")
                sp = (causal_split_makespan if causal else split_makespan)(s, block_m, 128, hbs, a.sms, a.tile_cost)
                line += f"   split tail: {sp:8.1f} ({100 * (sp / mean - 1):4.1f}%)"
                print(line)


if __name__ == "__main__":
    main()
