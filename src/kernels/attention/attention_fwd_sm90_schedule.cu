// Which tiles each CTA of the Hopper attention forward runs
// (attention_fwd_sm90.cu, the kernel, comes after this file; the launchers
// put attention_ptx.cu and attention_sm90_ptx.cu ahead of both).
//
// A tile is BLOCK_M query rows of one (batch, head) and the key blocks they
// see (TileWork). The kernel is persistent: CTA i of G asks for its slot k =
// 0, 1, ... until the answer is -1; the producer thread and every consumer
// thread ask the same questions and get the same answers. The schedules:
// - cta_tile: snake rounds (CTA i takes tile k G + i, or k G + G - 1 - i in
//   odd rounds), causal tiles by decreasing work, or (PAIRS) causal tiles in
//   pairs of query blocks (x, num_m - 1 - x) of one head;
// - cta_split_tile (not causal): whole rounds, then the last tiles' key-block
//   iterations cut into G equal ranges;
// - cta_causal_split_tile: the pairs' whole item rounds, then the pairs
//   schedule's tail cut the same way, its boundaries found once a CTA by
//   causal_tail_schedule.
// The CPU counts of these schedules (their balance) are in
// scripts/attention_schedule_balance.py; docs/attention.md has the designs
// and measurements.

namespace opfuse_attn {

// One output tile (BLOCK_M query rows of one (batch, head)): what it loads.
struct TileWork {
  int m_start, head, batch, head_kv;
  int n_blocks;      // key blocks [0, n_blocks) are visible to some row; 0: none
  int n_mask_start;  // key blocks >= this one need the mask
  // A piece of a tile split between two CTAs (kOptSplit): only key blocks
  // [n_low, n_blocks) are visited, from the last to the first. role: a whole
  // tile (kRoleFull), the first-visited part, written to the workspace as
  // partials (kRoleWrite), or the rest, merged with the other CTA's partials
  // before the epilogue (kRoleMerge).
  int n_low, role;
};
constexpr int kRoleFull = 0, kRoleWrite = 1, kRoleMerge = 2;

// Query block m's first row is m BLOCK_M - row_shift. row_shift = 0, or
// (kOptShift, causal) num_m BLOCK_M - Sq: the blocks then end at Sq and the
// ragged one is the first, whose causal tile is the shortest, rather than the
// last, the longest (rows before 0 see no key, load as zeros through the
// tensor map and are never stored).
template <int BLOCK_M, bool SHIFT>
__device__ __forceinline__ int row_shift_of(const AttnFwdParams& p, int num_m) {
  return SHIFT ? num_m * BLOCK_M - p.seqlen_q : 0;
}

// Key blocks [0, n) that some row of query block m_block sees (the same for
// every head): all of Sk, or (causal, aligned bottom-right) up to the last
// row's diagonal; 0 when no row sees a key (causal, Sq > Sk).
template <bool IS_CAUSAL, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ int tile_key_blocks(const AttnFwdParams& p, int m_block, int row_shift) {
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int m0 = m_block * BLOCK_M - row_shift;
  const int m_end = (m0 + BLOCK_M < Sq) ? m0 + BLOCK_M : Sq;
  int key_end = Sk;
  if (IS_CAUSAL) key_end = (m_end + Sk - Sq < Sk) ? m_end + Sk - Sq : Sk;
  return key_end > 0 ? (key_end + BLOCK_N - 1) / BLOCK_N : 0;
}

// The tile of query block m_block of (batch, head) hb = batch * Hq + head.
template <bool IS_CAUSAL, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ TileWork tile_at(const AttnFwdParams& p, int hb, int m_block, int row_shift = 0) {
  TileWork w;
  w.head = hb % p.heads_q;
  w.batch = hb / p.heads_q;
  w.head_kv = w.head / p.q_per_kv;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  w.m_start = m_block * BLOCK_M - row_shift;
  w.n_blocks = tile_key_blocks<IS_CAUSAL, BLOCK_M, BLOCK_N>(p, m_block, row_shift);
  // Keys [0, full_end) are visible to every row of the tile.
  int full_end = Sk;
  if (IS_CAUSAL) full_end = (w.m_start + Sk - Sq + 1 < Sk) ? w.m_start + Sk - Sq + 1 : Sk;
  w.n_mask_start = full_end > 0 ? full_end / BLOCK_N : 0;
  w.n_low = 0;
  w.role = kRoleFull;
  return w;
}

template <bool IS_CAUSAL, int BLOCK_M, int BLOCK_N, bool SHIFT = false>
__device__ __forceinline__ TileWork tile_work(const AttnFwdParams& p, int num_m, int t) {
  // Not causal: m block fastest (CTAs that run together share a head's K and
  // V in L2). Causal: tiles in order of decreasing work (the last query
  // blocks first, all heads of one m block together, so that CTAs running
  // together still walk the same key blocks): a scheduler that hands tiles
  // out in this order balances like longest-processing-time-first.
  const int hb = IS_CAUSAL ? t % (p.heads_q * p.batch) : t / num_m;
  const int x = IS_CAUSAL ? t / (p.heads_q * p.batch) : t % num_m;
  return tile_at<IS_CAUSAL, BLOCK_M, BLOCK_N>(p, hb, IS_CAUSAL ? num_m - 1 - x : x,
                                             row_shift_of<BLOCK_M, SHIFT>(p, num_m));
}

// Slot k of this CTA's persistent loop: 1 and the tile in w, 0 for an empty
// slot, -1 past the last one. Default: round k hands tiles [k G, k G + G)
// out (G = gridDim.x), CTA i taking k G + i in even rounds and k G + G - 1 - i
// in odd ones.
// PAIRS (causal only, kOptPairs): first items of two tiles of one (batch,
// head), query blocks x and num_m - 1 - x, which have about the same work
// (num_m + 1 key blocks when BLOCK_M = BLOCK_N): item j = (k / 2) G + i goes
// to CTA i, its long tile in the even slot and its short one in the odd one,
// items ordered head by head, so CTAs running together work on a few heads
// (G / (num_m / 2)) instead of one query block of G heads, whose K and V
// together overflow L2 at S = 2048 (H200: 128 heads x 1 MB at D = 128). Then,
// when num_m is odd, the middle blocks (half the work), one a slot, CTAs in
// reverse order: those that got no item in the last, partial pair round first.
template <bool IS_CAUSAL, int BLOCK_M, int BLOCK_N, bool PAIRS, bool SHIFT>
__device__ __forceinline__ int cta_tile(const AttnFwdParams& p, int num_m, int k, TileWork& w) {
  const int G = (int)gridDim.x, i = (int)blockIdx.x;
  const int hbs = p.heads_q * p.batch;
  if constexpr (IS_CAUSAL && PAIRS) {
    const int P2 = num_m / 2;  // pairs a head
    const int NP = P2 * hbs;   // pair items
    const int R2 = (NP + G - 1) / G;
    if (k < 2 * R2) {
      const int j = (k >> 1) * G + i;
      if (j >= NP) return 0;
      const int hb = j / P2, pr = j - hb * P2;
      w = tile_at<IS_CAUSAL, BLOCK_M, BLOCK_N>(p, hb, (k & 1) ? pr : num_m - 1 - pr,
                                               row_shift_of<BLOCK_M, SHIFT>(p, num_m));
      return 1;
    }
    const int r = k - 2 * R2;
    if ((num_m & 1) == 0 || r * G >= hbs) return -1;
    const int j = r * G + (G - 1 - i);
    if (j >= hbs) return 0;
    w = tile_at<IS_CAUSAL, BLOCK_M, BLOCK_N>(p, j, num_m / 2, row_shift_of<BLOCK_M, SHIFT>(p, num_m));
    return 1;
  } else {
    const int num_tiles = num_m * hbs;
    const int base = k * G;
    if (base >= num_tiles) return -1;
    const int t = base + ((k & 1) ? G - 1 - i : i);
    if (t >= num_tiles) return 0;
    w = tile_work<IS_CAUSAL, BLOCK_M, BLOCK_N, SHIFT>(p, num_m, t);
    return 1;
  }
}

// SPLIT (kOptSplit, not causal: every tile has the same nb key blocks): the
// snake rounds above for all but the last 1-2 rounds' worth of tiles, then
// those tail tiles' key-block iterations cut evenly over the G CTAs. The
// plain schedule runs ceil(tiles / G) rounds; 2048 tiles (the FlashAttention
// setup at D = 128) on 132 SMs are 15.5 rounds' work in 16, 3% of the time
// with some SMs idle. With the cut, the tail is tiles - R G tiles in
// [G, 2G), so each CTA's share is at least one tile's iterations and a tile
// is cut at most once, between CTAs i - 1 and i (iteration ranges
// [s_i, s_(i+1)) over the tail tiles in order, which keeps the CTAs running
// together on neighbouring tiles, as the rounds do for L2). CTA i runs its
// tail as: the piece at the end of its range (the first-visited key blocks
// of a tile whose rest is CTA i + 1's), written out as float32 partials
// (kRoleWrite), then its whole tiles, then the piece at the start of its
// range (kRoleMerge), which waits for CTA i - 1's partials of the same tile.
// A CTA waits only for a lower-numbered one, which has its partials out
// before it waits for anything, so the grid cannot deadlock while CTAs start
// in index order (as stream-K GEMMs assume).
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ int cta_split_tile(const AttnFwdParams& p, int num_m, int k, TileWork& w) {
  const int G = (int)gridDim.x, i = (int)blockIdx.x;
  const int tiles = num_m * p.heads_q * p.batch;
  const int R = tiles / G - 1;  // whole rounds first (tiles >= G: the launcher's grid)
  if (k < R) {
    w = tile_work<false, BLOCK_M, BLOCK_N>(p, num_m, k * G + ((k & 1) ? G - 1 - i : i));
    return 1;
  }
  const int nb = (p.seqlen_k + BLOCK_N - 1) / BLOCK_N;
  const int base = (R > 0 ? R : 0) * G;
  // 32-bit: the launcher cuts only when (tiles - base) * nb < 2^31; i * (T % G) < G^2.
  const int T = (tiles - base) * nb, Tq = T / G, Tr = T - Tq * G;
  const int s = i * Tq + (i * Tr) / G, e = (i + 1) * Tq + ((i + 1) * Tr) / G;  // floor(T i / G), floor(T (i + 1) / G)
  const int s_in = s % nb, e_in = e % nb;
  const int full0 = (s + nb - 1) / nb, full1 = e / nb;  // whole tiles [full0, full1)
  int j = k - (R > 0 ? R : 0);
  if (e_in != 0) {
    if (j == 0) {
      w = tile_work<false, BLOCK_M, BLOCK_N>(p, num_m, base + e / nb);
      w.n_low = nb - e_in;  // visits blocks nb - 1 down to nb - e_in
      w.role = kRoleWrite;
      return 1;
    }
    --j;
  }
  if (j < full1 - full0) {
    w = tile_work<false, BLOCK_M, BLOCK_N>(p, num_m, base + full0 + j);
    return 1;
  }
  j -= full1 - full0;
  if (s_in != 0 && j == 0) {
    w = tile_work<false, BLOCK_M, BLOCK_N>(p, num_m, base + s / nb);
    w.n_blocks = nb - s_in;  // visits blocks nb - 1 - s_in down to 0
    w.role = kRoleMerge;
    return 1;
  }
  return -1;
}

// CAUSAL SPLIT (kOptSplit with kOptPairs): the pairs schedule's whole item
// rounds first, R = NP / G - 1 of them (CTA i takes item r G + i, long tile
// then short), then its tail: the pair items [R G, NP) (two tiles each, long
// then short) followed by the middles, laid out as one line of key-block
// iterations and cut into G equal ranges, as cta_split_tile does with equal
// tiles. Causal tiles differ in length, so where a range starts and ends is a
// search over the line's offsets, which are periodic in the pair index (every
// (batch, head) repeats the same P2 item lengths): one division finds the
// head, at most P2 steps the item. One thread of each CTA finds its two
// boundaries before the role split (causal_tail_schedule) and leaves them in
// shared memory for every slot to read. The launcher cuts only when every
// range holds at least the longest tile, so a tile is cut at most once.
// Zero-length tiles (causal, Sq > Sk) go whole to the CTA whose range holds
// their offset (the last CTA also takes those at the line's end).
template <int BLOCK_M, int BLOCK_N, bool SHIFT>
struct CausalTail {
  int num_m, p2, np, j0, n_pair_tiles;
  __device__ __forceinline__ CausalTail(const AttnFwdParams& p, int num_m_) : num_m(num_m_) {
    const int G = (int)gridDim.x;
    p2 = num_m / 2;  // pairs a head
    np = p2 * p.heads_q * p.batch;
    j0 = (np / G - 1 > 0 ? np / G - 1 : 0) * G;  // items of the whole rounds
    n_pair_tiles = 2 * (np - j0);
  }
  __device__ __forceinline__ int rounds() const { return j0 / (int)gridDim.x; }
  __device__ __forceinline__ int blocks(const AttnFwdParams& p, int m) const {
    return tile_key_blocks<true, BLOCK_M, BLOCK_N>(p, m, row_shift_of<BLOCK_M, SHIFT>(p, num_m));
  }
  // Iterations of pair item pr of a head: its long and its short tile.
  __device__ __forceinline__ int item_blocks(const AttnFwdParams& p, int pr) const {
    return blocks(p, num_m - 1 - pr) + blocks(p, pr);
  }
};

// One end of a CTA's tail range: the first tail tile at or after the range
// boundary x, and rem = that tile's offset - x (> 0: tile f - 1 is cut at x,
// its last rem iterations, key blocks [0, rem), on the far side).
struct TailBound {
  int f, rem;
};

// Offsets of the line: item j starts at C(j) = (j / P2) H + sum of the first
// j % P2 item lengths (absolute, from item 0; H a head's sum), the middles
// after C(NP), each Lm long. The smallest tile whose offset is >= x.
template <int BLOCK_M, int BLOCK_N, bool SHIFT>
__device__ __forceinline__ TailBound causal_tail_find(const AttnFwdParams& p, const CausalTail<BLOCK_M, BLOCK_N, SHIFT>& ct,
                                                   i64 H, i64 c_j0, i64 lm, i64 x) {
  const i64 X = c_j0 + x;
  const i64 c_np = (i64)(ct.np / (ct.p2 > 0 ? ct.p2 : 1)) * H;
  TailBound b;
  if (X > c_np) {  // in the middles (lm > 0: the line reaches past C(NP))
    const i64 q = (X - c_np + lm - 1) / lm;
    b.f = ct.n_pair_tiles + (int)q;
    b.rem = (int)(c_np + q * lm - X);
    return b;
  }
  // The smallest item j in [j0, NP] with C(j) >= X, and C(j).
  int j = ct.j0;
  i64 cj = c_j0;
  if (X > c_j0 && H > 0) {
    const i64 hd = (X - 1) / H;  // hd H < X <= (hd + 1) H
    cj = hd * H;
    int q = 0;
    while (cj < X) cj += ct.item_blocks(p, q++);
    j = (int)hd * ct.p2 + q;
  }
  b.f = j < ct.np ? 2 * (j - ct.j0) : ct.n_pair_tiles;
  i64 o = cj;
  if (j > ct.j0) {  // item j - 1 starts before X; its short tile may not
    const int pr = (j - 1) % ct.p2;
    const i64 o_short = cj - ct.item_blocks(p, pr) + ct.blocks(p, ct.num_m - 1 - pr);
    if (o_short >= X) {
      b.f = 2 * (j - 1 - ct.j0) + 1;
      o = o_short;
    }
  }
  b.rem = (int)(o - X);
  return b;
}

// This CTA's causal split schedule into sched[8]: its tail range
// [T i / G, T (i + 1) / G) as {start f, rem, end f, rem}, then the whole item
// rounds R, the pairs a head P2, the pair tiles of the tail and the row shift.
template <int BLOCK_M, int BLOCK_N, bool SHIFT>
__device__ __forceinline__ void causal_tail_schedule(const AttnFwdParams& p, int num_m, int* sched) {
  const CausalTail<BLOCK_M, BLOCK_N, SHIFT> ct(p, num_m);
  const int G = (int)gridDim.x, i = (int)blockIdx.x;
  i64 H = 0, c_j0 = 0;
  const int j0_in = ct.p2 > 0 ? ct.j0 % ct.p2 : 0;
  for (int q = 0; q < ct.p2; ++q) {
    const int L = ct.item_blocks(p, q);
    H += L;
    if (q < j0_in) c_j0 += L;
  }
  if (ct.p2 > 0) c_j0 += (i64)(ct.j0 / ct.p2) * H;
  const int hbs = p.heads_q * p.batch;
  const i64 lm = (num_m & 1) ? ct.blocks(p, num_m / 2) : 0;
  const i64 T = (i64)hbs * H - c_j0 + ((num_m & 1) ? (i64)hbs * lm : 0);
  const TailBound s = causal_tail_find<BLOCK_M, BLOCK_N, SHIFT>(p, ct, H, c_j0, lm, T * i / G);
  TailBound e;
  if (i == G - 1) {
    e.f = ct.n_pair_tiles + ((num_m & 1) ? hbs : 0);  // every tile to the end
    e.rem = 0;
  } else {
    e = causal_tail_find<BLOCK_M, BLOCK_N, SHIFT>(p, ct, H, c_j0, lm, T * (i + 1) / G);
  }
  sched[0] = s.f;
  sched[1] = s.rem;
  sched[2] = e.f;
  sched[3] = e.rem;
  sched[4] = ct.rounds();
  sched[5] = ct.p2;
  sched[6] = ct.n_pair_tiles;
  sched[7] = row_shift_of<BLOCK_M, SHIFT>(p, num_m);
}

// Slot k of the causal split: the whole item rounds, then the tail range as
// cta_split_tile runs it (the piece written out first, the whole tiles, the
// piece merged last). `sched`: what causal_tail_schedule left in shared
// memory (read at every slot rather than held in registers across the loop,
// where the consumers have none to spare).
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ int cta_causal_split_tile(const AttnFwdParams& p, int num_m, int k, const int* sched,
                                                     TileWork& w) {
  const int G = (int)gridDim.x, i = (int)blockIdx.x;
  const int R = sched[4], p2 = sched[5];
  if (k < 2 * R) {
    const int j = (k >> 1) * G + i, hb = j / p2, pr = j - hb * p2;
    w = tile_at<true, BLOCK_M, BLOCK_N>(p, hb, (k & 1) ? pr : num_m - 1 - pr, sched[7]);
    return 1;
  }
  const int f_s = sched[0], rem_s = sched[1], f_e = sched[2], rem_e = sched[3];
  // Tail tile u: pair tiles in item order (long first), then the middles.
  auto tail_tile = [&](int u) {
    const int j0 = R * G, n_pair_tiles = sched[6];
    if (u < n_pair_tiles) {
      const int j = j0 + u / 2, hb = j / p2, pr = j - hb * p2;
      return tile_at<true, BLOCK_M, BLOCK_N>(p, hb, (u & 1) ? pr : num_m - 1 - pr, sched[7]);
    }
    return tile_at<true, BLOCK_M, BLOCK_N>(p, u - n_pair_tiles, num_m / 2, sched[7]);
  };
  int t = k - 2 * R;
  if (rem_e > 0) {
    if (t == 0) {
      w = tail_tile(f_e - 1);
      w.n_low = rem_e;  // visits blocks n_blocks - 1 down to rem_e
      w.role = kRoleWrite;
      return 1;
    }
    --t;
  }
  const int n_whole = f_e - (rem_e > 0 ? 1 : 0) - f_s;
  if (t < n_whole) {
    w = tail_tile(f_s + t);
    return 1;
  }
  t -= n_whole;
  if (rem_s > 0 && t == 0) {
    w = tail_tile(f_s - 1);
    w.n_blocks = rem_s;  // visits blocks rem_s - 1 down to 0
    w.role = kRoleMerge;
    return 1;
  }
  return -1;
}

}  // namespace opfuse_attn
