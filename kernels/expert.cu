// expert.cu: LoRA deltas of MoE layers straight from the expert pool (router, routed experts),
// and the token-overlay gather.
//
// Expert pool model (metrale_cli/layout/expert_layout.py): one expert entry per (layer, projection,
// expert), gate and up separate; entry n's A (BF16 [max_rank, in_dim]) and B (BF16 [out_dim,
// max_rank]) for slot s are at a_tables[n * max_loras + s] / b_tables[...] (u64, 0 = the slot
// does not adapt it); scale_table f32 and ranks i32 (the slot's widest expert rank) [max_loras].
// `entries` (i32 [num_slices, num_experts]) maps (slice, expert) of one layer to its entry,
// -1 where the layout has none. With r = min(ranks[s], max_rank, t_cols):
//
//   router_lora_*:  logits[b, e] += scale[s] * sum_{j<r} (x[b] . A_s[j]) * B_s[e, j]
//                   (A_s, B_s: entry router_entry of the tables)
//   expert_shrink_*: t[c, p, j] = x[p / x_div] . A(c, e_p, s_p)[j]           j < r
//   expert_expand_*: y[p, c*out_dim + o] += scale[s_p] * sum_{j<r} t[c, p, j] * B(c, e_p, s_p)[o, j]
//   overlay_gather:  emb[b] = rows[s, i] where overlay_ids[s, i] == token_ids[b]
//
// Pairs: pair p = (token p / top_k, its (p % top_k)-th chosen expert e_p = topk_ids[p]), slot
// s_p = slots[p / top_k]. The gate_up delta is 2 slices (c = 0 gate, c = 1 up) written into
// h [P, 2 I] as gate columns then up columns, x_div = top_k; the down delta is 1 slice over the
// activations act [P, I] into y [P, H], x_div = 1.
//
// The align step (metrale_cli/ops/expert_kernels.py plan_pairs, like vLLM's moe_align_block_size)
// sorts the pairs by (slot, expert) into `sorted_pairs` (i32 [P]) and cuts each (slot, expert)
// group into tiles of at most TILE pairs: `tiles` i32 [num_tiles, 4] = (begin, end, slot,
// expert) over sorted positions. A CTA owns one tile: each weight vector it loads feeds all of
// the tile's pairs, so a group's A and B leave HBM once and are read once per tile. Pairs of
// tokens with slot -1 are in no tile; a tile whose entry pointer is 0 or rank is 0 writes zero
// t rows and leaves y alone: y rows of skipped pairs stay untouched, bit for bit.
//
// Buffers (row major; BF16 as raw uint16 bits; base addresses and weight addresses 16-byte
// aligned): x BF16 [rows, in_dim] (x_stride); t F32 [num_slices, P, t_cols]; y BF16 or F32 [P,
// y_stride]; logits BF16 or F32 [T, logits_stride]. in_dim, out_dim, max_rank, t_cols and
// strides are multiples of 8 (the router's num_experts may be any count).
//
// Launch shapes (metrale_cli/ops/expert_kernels.py plans them; the host harness shares the plans):
//   router_lora_*:        grid (T), block 128: one token, its t row in shared memory.
//   expert_shrink_decode: grid (num_tiles, t_cols / 4, num_slices): 4 rank rows of one tile's
//                         EXPERT_DECODE_TILE pairs over all of K, on CUDA cores.
//   expert_shrink_prefill: grid (num_tiles, ceil(t_cols / 64), num_slices): 64 rank rows of one
//                         tile's EXPERT_PREFILL_TILE (8) pairs over all of K on mma.sync
//                         m16n8k16 (the pairs are its 8 columns), the 4 warps splitting K.
//   expert_expand_decode_*: grid (num_tiles, ceil(out_dim / (128 x 8)), num_slices): each thread
//                         owns 8 output rows of one slice for the tile's pairs.
//   expert_expand_prefill_*: the same grid on mma.sync (the pairs its rows, 8 outputs its
//                         columns), t as BF16 hi + lo, the result staged for the y epilogue.
// The prefill kernels need sm_80 or newer (BF16 mma), as sgmv.cu does.
//   overlay_gather:       grid (T), block 128: one token's row.
// Memory-level parallelism (kernels/README.md): loads unconditional (clamped, results masked),
// every pass's loads issued before the first product: EXPERT_*_LOADS, ROUTER_LOADS and
// OVERLAY_LOADS per thread.
//
// Compile alone:
//   nvcc -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Werror -c -o /dev/null kernels/expert.cu
#include "lora_common.cuh"

// The entry's address for a slot: 0 when the layout has no entry, the slot id is outside the
// table, or the slot does not adapt it.
__device__ __forceinline__ ptr_t expert_address(const ptr_t* table, int entry, int slot,
                                                int max_loras) {
  return (entry >= 0 && slot >= 0 && slot < max_loras)
             ? table[static_cast<long long>(entry) * max_loras + slot]
             : 0ull;
}

// The entry of (slice, expert), or -1 (no entry: nothing read, y untouched) for an expert id
// outside [0, num_experts), such as -1 for an expert that lives on another rank.
__device__ __forceinline__ int tile_entry(const int* entries, int slice, int num_experts,
                                          int expert) {
  return (expert >= 0 && expert < num_experts) ? entries[slice * num_experts + expert] : -1;
}

// ---- router ----------------------------------------------------------------------------------

template <typename OutT>
__device__ __forceinline__ void router_lora_body(
    const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ slots,
    const ptr_t* __restrict__ a_tables, const ptr_t* __restrict__ b_tables, int router_entry,
    const float* __restrict__ scale_table, const int* __restrict__ ranks, int max_loras,
    OutT* __restrict__ logits,
    long long logits_stride, int in_dim, int num_experts, int max_rank) {
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int slot = slots[b];
  const ptr_t a_addr = expert_address(a_tables, router_entry, slot, max_loras);
  const ptr_t b_addr = expert_address(b_tables, router_entry, slot, max_loras);
  const int rank = (a_addr && b_addr) ? imin(ranks[slot], max_rank) : 0;
  if (rank <= 0) return;  // CTA-uniform: logits stay bit-identical
  const float scale = scale_table[slot];
  const int vecs = (rank + 7) >> 3;

  // t_s: x . A_s[j] for j < rank, zero up to a whole number of ROUTER_COLS vectors.
  __shared__ __align__(16) float t_s[METRALE_MAX_RANK + ROUTER_COLS * 8];
  __shared__ float partial[METRALE_WARPS][BGMV_SHRINK_ROWS];
  const int padded = (vecs + ROUTER_COLS - 1) / ROUTER_COLS * ROUTER_COLS * 8;
  for (int j = tid; j < padded; j += METRALE_THREADS) t_s[j] = 0.f;
  const bf16_t* x_row = x + static_cast<long long>(b) * x_stride;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  for (int j0 = 0; j0 < rank; j0 += BGMV_SHRINK_ROWS) {
    const int rows = imin(BGMV_SHRINK_ROWS, rank - j0);
    float acc[BGMV_SHRINK_ROWS];
#pragma unroll
    for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) acc[i] = 0.f;
    for (int k = tid * 8; k < in_dim; k += METRALE_THREADS * 8) {
      const uint4 xv = load16(x_row + k);
      uint4 av[BGMV_SHRINK_ROWS];
#pragma unroll
      for (int i = 0; i < BGMV_SHRINK_ROWS; ++i)
        av[i] = load16(reinterpret_cast<const bf16_t*>(a_addr) +
                       static_cast<long long>(j0 + imin(i, rows - 1)) * in_dim + k);
#pragma unroll
      for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) acc[i] += dot8(xv, av[i]);
    }
#pragma unroll
    for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) {
      const float v = warp_sum(acc[i]);
      if (lane == 0) partial[warp][i] = v;
    }
    __syncthreads();
    if (tid < rows) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < METRALE_WARPS; ++w) sum += partial[w][tid];
      t_s[j0 + tid] = sum;
    }
    __syncthreads();
  }

  // One thread per expert logit: its B row's rank vectors, ROUTER_COLS per pass.
  for (int e = tid; e < num_experts; e += METRALE_THREADS) {
    const bf16_t* b_row = reinterpret_cast<const bf16_t*>(b_addr) + static_cast<long long>(e) * max_rank;
    float acc = 0.f;
    for (int c = 0; c < vecs; c += ROUTER_COLS) {
      uint4 w[ROUTER_COLS];
#pragma unroll
      for (int q = 0; q < ROUTER_COLS; ++q) w[q] = load16(b_row + (c + q < vecs ? c + q : c) * 8);
#pragma unroll
      for (int q = 0; q < ROUTER_COLS; ++q) acc += dot8_f32(t_s + (c + q) * 8, w[q]);
    }
    OutT* out = logits + static_cast<long long>(b) * logits_stride + e;
    store_out(out, load_out(out) + scale * acc);
  }
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, ROUTER_LORA_MIN_CTAS)
router_lora_f32(const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ slots,
                const ptr_t* __restrict__ a_tables, const ptr_t* __restrict__ b_tables,
                int router_entry, const float* __restrict__ scale_table, const int* __restrict__ ranks,
                int max_loras, float* __restrict__ logits, long long logits_stride, int in_dim,
                int num_experts, int max_rank) {
  router_lora_body(x, x_stride, slots, a_tables, b_tables, router_entry, scale_table, ranks, max_loras,
                   logits, logits_stride, in_dim, num_experts, max_rank);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, ROUTER_LORA_MIN_CTAS)
router_lora_bf16(const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ slots,
                 const ptr_t* __restrict__ a_tables, const ptr_t* __restrict__ b_tables,
                 int router_entry, const float* __restrict__ scale_table, const int* __restrict__ ranks,
                 int max_loras, bf16_t* __restrict__ logits, long long logits_stride,
                 int in_dim, int num_experts, int max_rank) {
  router_lora_body(x, x_stride, slots, a_tables, b_tables, router_entry, scale_table, ranks, max_loras,
                   logits, logits_stride, in_dim, num_experts, max_rank);
}

// ---- routed experts --------------------------------------------------------------------------

struct Tile {
  int begin, end, slot, expert;
};

__device__ __forceinline__ Tile load_tile(const int* tiles, int i) {
  Tile t;
  t.begin = tiles[4 * i];
  t.end = tiles[4 * i + 1];
  t.slot = tiles[4 * i + 2];
  t.expert = tiles[4 * i + 3];
  return t;
}

template <int M>
__device__ __forceinline__ void expert_shrink_body(
    const bf16_t* __restrict__ x, long long x_stride, int x_div,
    const int* __restrict__ sorted_pairs, const int* __restrict__ tiles,
    const ptr_t* __restrict__ a_tables, const int* __restrict__ entries, int num_experts,
    const int* __restrict__ ranks, int max_loras, float* __restrict__ t, int num_pairs,
    int in_dim, int max_rank, int t_cols) {
  const Tile tile = load_tile(tiles, blockIdx.x);
  const int j0 = blockIdx.y * BGMV_SHRINK_ROWS;
  const int slice = blockIdx.z;
  const int tid = threadIdx.x;
  const int count = tile.end - tile.begin;
  if (count <= 0) return;  // a tile past the plan's last one
  const int entry = tile_entry(entries, slice, num_experts, tile.expert);
  const ptr_t a_addr = expert_address(a_tables, entry, tile.slot, max_loras);
  const int rank = a_addr ? imin(imin(ranks[tile.slot], max_rank), t_cols) : 0;
  float* t_slice = t + static_cast<long long>(slice) * num_pairs * t_cols;
  // Pairs past the tile's end re-read its first pair (in bounds) and are never written.
  int pair[M];
#pragma unroll
  for (int m = 0; m < M; ++m) pair[m] = sorted_pairs[tile.begin + (m < count ? m : 0)];
  if (j0 >= rank) {
    // Padding rows, a 0 pointer or rank 0: one store per t element, no pass over A.
    if (tid < M * BGMV_SHRINK_ROWS) {
      const int m = tid / BGMV_SHRINK_ROWS, j = j0 + tid % BGMV_SHRINK_ROWS;
      if (m < count && j < t_cols)
        t_slice[static_cast<long long>(sorted_pairs[tile.begin + m]) * t_cols + j] = 0.f;
    }
    return;
  }
  const int rows = imin(BGMV_SHRINK_ROWS, rank - j0);
  const bf16_t* a_row[BGMV_SHRINK_ROWS];
#pragma unroll
  for (int i = 0; i < BGMV_SHRINK_ROWS; ++i)
    a_row[i] = reinterpret_cast<const bf16_t*>(a_addr) +
               static_cast<long long>(j0 + imin(i, rows - 1)) * in_dim;
  const bf16_t* x_row[M];
#pragma unroll
  for (int m = 0; m < M; ++m) x_row[m] = x + static_cast<long long>(pair[m] / x_div) * x_stride;

  float acc[M][BGMV_SHRINK_ROWS];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) acc[m][i] = 0.f;
  // A pass: the 4 A vectors and the tile's M x vectors at one K position, all issued before
  // the first product; each A vector then feeds M pairs.
  for (int k = tid * 8; k < in_dim; k += METRALE_THREADS * 8) {
    uint4 av[BGMV_SHRINK_ROWS];
    uint4 xv[M];
#pragma unroll
    for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) av[i] = load16(a_row[i] + k);
#pragma unroll
    for (int m = 0; m < M; ++m) xv[m] = load16(x_row[m] + k);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) acc[m][i] += dot8(xv[m], av[i]);
  }

  __shared__ float partial[METRALE_WARPS][M * BGMV_SHRINK_ROWS];
  const int warp = tid >> 5;
  const int lane = tid & 31;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) {
      const float v = warp_sum(acc[m][i]);
      if (lane == 0) partial[warp][m * BGMV_SHRINK_ROWS + i] = v;
    }
  __syncthreads();
  if (tid < M * BGMV_SHRINK_ROWS) {
    const int m = tid / BGMV_SHRINK_ROWS, i = tid % BGMV_SHRINK_ROWS;
    if (m < count && j0 + i < t_cols) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < METRALE_WARPS; ++w) sum += partial[w][tid];
      t_slice[static_cast<long long>(sorted_pairs[tile.begin + m]) * t_cols + j0 + i] =
          i < rows ? sum : 0.f;
    }
  }
}

// ---- the prefill tiles on tensor cores ------------------------------------------------------
//
// A prefill tile's EXPERT_PREFILL_TILE (8) pairs are the n = 8 columns of mma.m16n8k16, with
// the 16 rows weights and k along the weight rows: the shrink computes t^T = A . x^T (16 rank
// rows x 8 pairs a tile), the expand y^T = B . t^T (16 outputs x 8 pairs). Both operands are
// row-major with k contiguous, exactly as the pool and the activations store them, so each lane
// loads them straight from global memory as 16-byte vectors, no shared-memory staging: lane
// (g, q) = (lane / 4, lane % 4) reads 8 consecutive k of a 32-wide chunk, k0 + 8q .. k0 + 8q + 7,
// from weight rows g and g + 8 and from pair g's row. A dot product does not care which k sits
// in which fragment slot as long as both operands agree, so those 8 k fill slots (2q, 2q + 1,
// 2q + 8, 2q + 9) of two successive mma (the first 4 of them, then the last 4): one 16-byte
// load per row and chunk, where the PTX fragment order would take four 4-byte ones.
static_assert(EXPERT_PREFILL_TILE == 8, "a prefill tile's pairs are the mma's 8 columns");

__device__ __forceinline__ void mma_chunk(float (&d)[4], uint4 lo_rows, uint4 hi_rows,
                                          uint4 cols) {
  const unsigned a0[4] = {lo_rows.x, hi_rows.x, lo_rows.y, hi_rows.y};
  const unsigned b0[2] = {cols.x, cols.y};
  mma_bf16_16816(d, a0, b0);
  const unsigned a1[4] = {lo_rows.z, hi_rows.z, lo_rows.w, hi_rows.w};
  const unsigned b1[2] = {cols.z, cols.w};
  mma_bf16_16816(d, a1, b1);
}

// expert_shrink_prefill: a CTA is one tile's 8 pairs x 64 rank rows (grid.y) over all of K,
// the 4 warps splitting K (32-wide chunks, kChunks of them a pass) and kTiles m16 tiles of
// rank rows each (1, 2 or 4: the ones the rank reaches; rows past it re-read the rank's last
// and are never stored). A pass issues kChunks x (1 + 2 kTiles) 16-byte loads per lane before
// its first mma; the warps' partial sums then meet in shared memory.
template <int kTiles, int kChunks>
__device__ __forceinline__ void shrink_mma_rows(const bf16_t* __restrict__ x_row,
                                                const bf16_t* __restrict__ a_addr, int j0,
                                                int rank, int in_dim, float (&acc)[4][4],
                                                int warp, int lane) {
  const int g = lane >> 2;
  const int q8 = (lane & 3) * 8;
  const bf16_t* rows[kTiles][2];
#pragma unroll
  for (int m = 0; m < kTiles; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      rows[m][h] = a_addr + static_cast<long long>(imin(j0 + 16 * m + 8 * h + g, rank - 1)) * in_dim;
  constexpr int kPassK = METRALE_WARPS * kChunks * 32;
  for (int k0 = warp * kChunks * 32; k0 < in_dim; k0 += kPassK) {
    uint4 xv[kChunks];
    uint4 av[kChunks][kTiles][2];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = k0 + 32 * c + q8;
      const int at = col < in_dim ? col : in_dim - 8;  // past K: clamped, and x masked to zero
      xv[c] = load16(x_row + at);
#pragma unroll
      for (int m = 0; m < kTiles; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) av[c][m][h] = load16(rows[m][h] + at);
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 x_kept = keep16(k0 + 32 * c + q8 < in_dim, xv[c]);
#pragma unroll
      for (int m = 0; m < kTiles; ++m) mma_chunk(acc[m], av[c][m][0], av[c][m][1], x_kept);
    }
  }
}

__device__ __forceinline__ void expert_shrink_mma_body(
    const bf16_t* __restrict__ x, long long x_stride, int x_div,
    const int* __restrict__ sorted_pairs, const int* __restrict__ tiles,
    const ptr_t* __restrict__ a_tables, const int* __restrict__ entries, int num_experts,
    const int* __restrict__ ranks, int max_loras, float* __restrict__ t, int num_pairs,
    int in_dim, int max_rank, int t_cols) {
  constexpr int kRows = EXPERT_SHRINK_PREFILL_ROWS;  // 4 m16 tiles
  const Tile tile = load_tile(tiles, blockIdx.x);
  const int j0 = blockIdx.y * kRows;
  const int slice = blockIdx.z;
  const int tid = threadIdx.x;
  const int count = tile.end - tile.begin;
  if (count <= 0) return;  // a tile past the plan's last one
  const int entry = tile_entry(entries, slice, num_experts, tile.expert);
  const ptr_t a_addr = expert_address(a_tables, entry, tile.slot, max_loras);
  const int rank = a_addr ? imin(imin(ranks[tile.slot], max_rank), t_cols) : 0;
  float* t_slice = t + static_cast<long long>(slice) * num_pairs * t_cols;
  if (j0 >= rank) {
    // Padding rows, a 0 pointer or rank 0: one store per t element, no pass over A.
    for (int idx = tid; idx < EXPERT_PREFILL_TILE * kRows; idx += METRALE_THREADS) {
      const int m = idx / kRows, j = j0 + idx % kRows;
      if (m < count && j < t_cols)
        t_slice[static_cast<long long>(sorted_pairs[tile.begin + m]) * t_cols + j] = 0.f;
    }
    return;
  }
  const int warp = tid >> 5;
  const int lane = tid & 31;
  // This lane's pair (mma column g); pairs past the tile's end re-read its first, never stored.
  const int g = lane >> 2;
  const int pair = sorted_pairs[tile.begin + (g < count ? g : 0)];
  const bf16_t* x_row = x + static_cast<long long>(pair / x_div) * x_stride;
  const bf16_t* a_rows = reinterpret_cast<const bf16_t*>(a_addr);
  float acc[4][4];
#pragma unroll
  for (int m = 0; m < 4; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
  const int tiles_used = (imin(kRows, rank - j0) + 15) >> 4;  // CTA-uniform
  if (tiles_used == 1) {
    shrink_mma_rows<1, 6>(x_row, a_rows, j0, rank, in_dim, acc, warp, lane);
  } else if (tiles_used == 2) {
    shrink_mma_rows<2, 3>(x_row, a_rows, j0, rank, in_dim, acc, warp, lane);
  } else {
    shrink_mma_rows<4, 2>(x_row, a_rows, j0, rank, in_dim, acc, warp, lane);
  }

  // The warps' partial tiles (rank row, pair), padded so that a warp's stores and the sum's
  // reads (consecutive rank rows) fall on distinct banks.
  __shared__ float partial[METRALE_WARPS][kRows][EXPERT_PREFILL_TILE + 1];
  const int q2 = (lane & 3) * 2;
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      partial[warp][16 * m + g + 8 * (e >> 1)][q2 + (e & 1)] = acc[m][e];
  __syncthreads();
  for (int idx = tid; idx < EXPERT_PREFILL_TILE * kRows; idx += METRALE_THREADS) {
    const int m = idx / kRows, jj = idx % kRows;
    if (m < count && j0 + jj < t_cols) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < METRALE_WARPS; ++w) sum += partial[w][jj][m];
      t_slice[static_cast<long long>(sorted_pairs[tile.begin + m]) * t_cols + j0 + jj] =
          j0 + jj < rank ? sum : 0.f;
    }
  }
}

#define EXPERT_SHRINK_PARAMS                                                                  \
  const bf16_t *__restrict__ x, long long x_stride, int x_div,                                \
      const int *__restrict__ sorted_pairs, const int *__restrict__ tiles,                    \
      const ptr_t *__restrict__ a_tables, const int *__restrict__ entries, int num_experts,   \
      const int *__restrict__ ranks, int max_loras, float *__restrict__ t, int num_pairs,     \
      int in_dim, int max_rank, int t_cols
#define EXPERT_SHRINK_ARGS                                                                     \
  x, x_stride, x_div, sorted_pairs, tiles, a_tables, entries, num_experts, ranks, max_loras, t, \
      num_pairs, in_dim, max_rank, t_cols

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, EXPERT_SHRINK_DECODE_MIN_CTAS)
expert_shrink_decode(EXPERT_SHRINK_PARAMS) {
  expert_shrink_body<EXPERT_DECODE_TILE>(EXPERT_SHRINK_ARGS);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, EXPERT_SHRINK_PREFILL_MIN_CTAS)
expert_shrink_prefill(EXPERT_SHRINK_PARAMS) {
  expert_shrink_mma_body(EXPERT_SHRINK_ARGS);
}

template <int M, typename OutT>
__device__ __forceinline__ void expert_expand_body(
    const float* __restrict__ t, const int* __restrict__ sorted_pairs,
    const int* __restrict__ tiles, const ptr_t* __restrict__ b_tables,
    const int* __restrict__ entries, int num_experts, const float* __restrict__ scale_table,
    const int* __restrict__ ranks, int max_loras, OutT* __restrict__ y, long long y_stride,
    int num_pairs, int out_dim, int max_rank, int t_cols) {
  const Tile tile = load_tile(tiles, blockIdx.x);
  const int slice = blockIdx.z;
  const int tid = threadIdx.x;
  const int count = tile.end - tile.begin;
  if (count <= 0) return;
  const int entry = tile_entry(entries, slice, num_experts, tile.expert);
  const ptr_t b_addr = expert_address(b_tables, entry, tile.slot, max_loras);
  const int rank = b_addr ? imin(imin(ranks[tile.slot], max_rank), t_cols) : 0;
  if (rank <= 0) return;  // CTA-uniform, before any barrier: y stays bit-identical
  const float scale = scale_table[tile.slot];
  const int vecs = (rank + 7) >> 3;
  const int padded = (vecs + EXPERT_EXPAND_COLS - 1) / EXPERT_EXPAND_COLS * EXPERT_EXPAND_COLS * 8;
  const float* t_slice = t + static_cast<long long>(slice) * num_pairs * t_cols;

  // The tile's t rows, zero past the rank (the last B vector's padding columns meet zeros).
  __shared__ __align__(16) float t_s[M][METRALE_MAX_RANK + EXPERT_EXPAND_COLS * 8];
  int pair[M];
#pragma unroll
  for (int m = 0; m < M; ++m) pair[m] = sorted_pairs[tile.begin + (m < count ? m : 0)];
  for (int idx = tid; idx < M * padded; idx += METRALE_THREADS) {
    const int m = idx / padded, j = idx % padded;
    t_s[m][j] = (m < count && j < rank)
                    ? t_slice[static_cast<long long>(sorted_pairs[tile.begin + m]) * t_cols + j]
                    : 0.f;
  }
  __syncthreads();

  const int o = (blockIdx.y * METRALE_THREADS + tid) * BGMV_EXPAND_ROWS;
  if (o >= out_dim) return;
  const bf16_t* b_rows = reinterpret_cast<const bf16_t*>(b_addr) + static_cast<long long>(o) * max_rank;
  float acc[M][BGMV_EXPAND_ROWS];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int i = 0; i < BGMV_EXPAND_ROWS; ++i) acc[m][i] = 0.f;
  for (int c = 0; c < vecs; c += EXPERT_EXPAND_COLS) {
    // A pass: every row's next EXPERT_EXPAND_COLS vectors (a column past the rank re-reads the
    // pass's first, in bounds, and meets zeros in t_s); each B vector feeds the tile's M pairs.
    uint4 w[BGMV_EXPAND_ROWS][EXPERT_EXPAND_COLS];
#pragma unroll
    for (int i = 0; i < BGMV_EXPAND_ROWS; ++i)
#pragma unroll
      for (int q = 0; q < EXPERT_EXPAND_COLS; ++q) {
        const int col = c + q < vecs ? c + q : c;
        w[i][q] = load16(b_rows + static_cast<long long>(i) * max_rank + col * 8);
      }
#pragma unroll
    for (int q = 0; q < EXPERT_EXPAND_COLS; ++q)
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < BGMV_EXPAND_ROWS; ++i)
          acc[m][i] += dot8_f32(&t_s[m][(c + q) * 8], w[i][q]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m < count) {
      OutT* y_out = y + static_cast<long long>(pair[m]) * y_stride + slice * out_dim + o;
      float yv[BGMV_EXPAND_ROWS];
      load_y8(y_out, yv);
#pragma unroll
      for (int i = 0; i < BGMV_EXPAND_ROWS; ++i) yv[i] += scale * acc[m][i];
      store_y8(y_out, yv);
    }
  }
}

// expert_expand_prefill_*: a CTA is one tile's 8 pairs x 1024 outputs (grid.y) of one slice,
// with the operands the other way round from the shrink: y = t . B^T, the 8 pairs the mma's
// rows (its rows 8-15 zero) and 8 outputs its columns, so that a B row's 16-byte vector is the
// B fragment of two mma as loaded (its words 0-1, then 2-3: B rows are contiguous in k, the
// fragment's column layout), and no register moves sit between the loads and the mma. The
// tile's t rows sit in shared memory as BF16 pairs hi + lo (t = hi + lo to about 2^-17: the
// tensor cores take BF16, and one rounding would cost t 2^-9 of its precision), zero past the
// rank. A warp takes n8 tiles of outputs, reading each output's B row in 32-wide rank chunks,
// kChunks of them (the power of two at or above ceil(r / 32); chunks past the rank re-read its
// last vector and meet zeros in t), 16 / kChunks tiles a pass: 16 B vectors per lane before the
// first mma. The result goes to a shared stage [pair][output] that the y epilogue reads as
// 16-byte vectors.
constexpr int kExpandRows = METRALE_THREADS * BGMV_EXPAND_ROWS;  // outputs per CTA
constexpr int kStagePitch = kExpandRows + 8;  // a half-warp's float2 stores on distinct banks
constexpr int kTPitch = METRALE_MAX_RANK + 8;  // BF16 t row, 16-byte aligned

template <int kChunks>
__device__ __forceinline__ void expand_mma_cols(const bf16_t* __restrict__ b_rows,
                                                long long max_rank, int rows, int vecs,
                                                const bf16_t (*t_hi)[kTPitch],
                                                const bf16_t (*t_lo)[kTPitch],
                                                float (*stage)[kStagePitch], int warp,
                                                int lane) {
  constexpr int kTiles = 16 / kChunks;  // n8 tiles of outputs per pass
  const int g = lane >> 2;
  const int q = lane & 3;
  const int n_tiles = rows >> 3;  // rows is a multiple of 8
  int col[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) col[c] = imin(4 * c + q, vecs - 1) * 8;
  constexpr int kStep = METRALE_WARPS * kTiles;
  // The B vectors of the warp's pass at tile nt0 (rows past the CTA's re-read its last).
  auto load_pass = [&](uint4 (&w)[kTiles][kChunks], int nt0) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      const bf16_t* b_row = b_rows + static_cast<long long>(imin(8 * (nt0 + n) + g, rows - 1)) *
                                         max_rank;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) w[n][c] = load16(b_row + col[c]);
    }
  };
  // Double-buffered in registers: the next pass's loads are issued before this pass's mma, so
  // they are in flight while the tensor cores work (past the last pass: this one again, unused).
  uint4 w[kTiles][kChunks];
  load_pass(w, warp * kTiles);
  for (int nt0 = warp * kTiles; nt0 < n_tiles; nt0 += kStep) {
    uint4 next[kTiles][kChunks];
    load_pass(next, nt0 + kStep < n_tiles ? nt0 + kStep : nt0);
    float d[kTiles][4];
#pragma unroll
    for (int n = 0; n < kTiles; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      // Pair g's t at this lane's 8 k of the chunk, hi and lo: the A fragments of its rows
      // g (rows g + 8 are zero).
      const uint4 th = *reinterpret_cast<const uint4*>(&t_hi[g][32 * c + 8 * q]);
      const uint4 tl = *reinterpret_cast<const uint4*>(&t_lo[g][32 * c + 8 * q]);
      const unsigned a[4][4] = {{th.x, 0u, th.y, 0u}, {th.z, 0u, th.w, 0u},
                                {tl.x, 0u, tl.y, 0u}, {tl.z, 0u, tl.w, 0u}};
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        const unsigned b0[2] = {w[n][c].x, w[n][c].y};
        const unsigned b1[2] = {w[n][c].z, w[n][c].w};
        mma_bf16_16816(d[n], a[0], b0);
        mma_bf16_16816(d[n], a[1], b1);
        mma_bf16_16816(d[n], a[2], b0);
        mma_bf16_16816(d[n], a[3], b1);
      }
    }
    // d[n][0..1]: pair g, outputs 2q and 2q + 1 of tile n (d[n][2..3] are the zero rows').
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      if (nt0 + n < n_tiles) {
        float2 v;
        v.x = d[n][0];
        v.y = d[n][1];
        *reinterpret_cast<float2*>(&stage[g][8 * (nt0 + n) + 2 * q]) = v;
      }
    }
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int c = 0; c < kChunks; ++c) w[n][c] = next[n][c];
  }
}

// The expand at rank 16 or below (kVecs = 1 or 2 vectors per B row), where a 32-wide chunk
// would have lanes re-read their row's vectors: each lane loads its own row's vector, the quad
// covering 4 / kVecs n8 tiles (lane q: tile q / kVecs, vector q % kVecs). The mma's 16 rows
// keep them apart: rows 0-7 are the pairs seen through the lanes of the first tile of a view,
// rows 8-15 through the second (each lane's t fragment is zero in the other half), so one mma
// over a view's lanes yields two tiles' outputs, D rows 0-7 and 8-15. At one vector per row
// the quad's 4 tiles are two views (lanes 0, 2 and 1, 3). A pass is 8 kVecs loads per lane, all
// of the CTA's rows, every warp's load s covering the next 4 / kVecs tiles after the other
// warps'.
template <int kVecs>
__device__ __forceinline__ void expand_mma_narrow(const bf16_t* __restrict__ b_rows,
                                                  long long max_rank, int rows,
                                                  const bf16_t (*t_hi)[kTPitch],
                                                  const bf16_t (*t_lo)[kTPitch],
                                                  float (*stage)[kStagePitch], int warp,
                                                  int lane) {
  constexpr int kLoadTiles = 4 / kVecs;  // n8 tiles one warp load covers
  constexpr int kViews = 2 / kVecs;
  // Loads per lane: one pass covers the CTA's 1024 outputs (8 x 4 warps x 4 tiles at one
  // vector a row, 16 x 4 x 2 at two), every load distinct.
  constexpr int kSteps = 8 * kVecs;
  const int g = lane >> 2;
  const int q = lane & 3;
  const int mine = q / kVecs;             // this lane's tile within a load
  const int view = mine % kViews;
  const int half = mine / kViews;
  const int n_tiles = rows >> 3;
  // This lane's t values (its vector's 8, hi and lo); a view's A fragment puts them in the
  // rows of the lane's half, zeros elsewhere and in the views the lane is not part of.
  const uint4 th = *reinterpret_cast<const uint4*>(&t_hi[g][8 * (q % kVecs)]);
  const uint4 tl = *reinterpret_cast<const uint4*>(&t_lo[g][8 * (q % kVecs)]);
  const unsigned words[4][2] = {{th.x, th.y}, {th.z, th.w}, {tl.x, tl.y}, {tl.z, tl.w}};
  static_assert(kSteps * METRALE_WARPS * kLoadTiles * 8 == kExpandRows, "one pass a CTA");
  uint4 w[kSteps];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int tile = (s * METRALE_WARPS + warp) * kLoadTiles + mine;
    w[s] = load16(b_rows + static_cast<long long>(imin(8 * tile + g, rows - 1)) * max_rank +
                  8 * (q % kVecs));
  }
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const unsigned b0[2] = {w[s].x, w[s].y};
    const unsigned b1[2] = {w[s].z, w[s].w};
#pragma unroll
    for (int v = 0; v < kViews; ++v) {
      const bool lo_rows = v == view && half == 0, hi_rows = v == view && half == 1;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const unsigned a[4] = {lo_rows ? words[m][0] : 0u, hi_rows ? words[m][0] : 0u,
                               lo_rows ? words[m][1] : 0u, hi_rows ? words[m][1] : 0u};
        mma_bf16_16816(d, a, m & 1 ? b1 : b0);
      }
      // D rows 0-7: pair g of the view's first tile (outputs 2q, 2q + 1); rows 8-15: its
      // second.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tile = (s * METRALE_WARPS + warp) * kLoadTiles + h * kViews + v;
        if (tile < n_tiles) {
          float2 out;
          out.x = d[2 * h];
          out.y = d[2 * h + 1];
          *reinterpret_cast<float2*>(&stage[g][8 * tile + 2 * q]) = out;
        }
      }
    }
  }
}

template <typename OutT>
__device__ __forceinline__ void expert_expand_mma_body(
    const float* __restrict__ t, const int* __restrict__ sorted_pairs,
    const int* __restrict__ tiles, const ptr_t* __restrict__ b_tables,
    const int* __restrict__ entries, int num_experts, const float* __restrict__ scale_table,
    const int* __restrict__ ranks, int max_loras, OutT* __restrict__ y, long long y_stride,
    int num_pairs, int out_dim, int max_rank, int t_cols) {
  constexpr int M = EXPERT_PREFILL_TILE;
  const Tile tile = load_tile(tiles, blockIdx.x);
  const int slice = blockIdx.z;
  const int tid = threadIdx.x;
  const int count = tile.end - tile.begin;
  if (count <= 0) return;
  const int entry = tile_entry(entries, slice, num_experts, tile.expert);
  const ptr_t b_addr = expert_address(b_tables, entry, tile.slot, max_loras);
  const int rank = b_addr ? imin(imin(ranks[tile.slot], max_rank), t_cols) : 0;
  const int o0 = blockIdx.y * kExpandRows;
  if (rank <= 0 || o0 >= out_dim) return;  // CTA-uniform, before any barrier: y untouched
  const float scale = scale_table[tile.slot];
  const int vecs = (rank + 7) >> 3;
  const int chunks = (rank + 31) >> 5;
  const int padded = (chunks <= 1 ? 1 : chunks <= 2 ? 2 : chunks <= 4 ? 4 : 8) * 32;
  const int rows = imin(kExpandRows, out_dim - o0);
  const float* t_slice = t + static_cast<long long>(slice) * num_pairs * t_cols;

  __shared__ __align__(16) bf16_t t_hi[M][kTPitch];
  __shared__ __align__(16) bf16_t t_lo[M][kTPitch];
  __shared__ __align__(16) float stage[M][kStagePitch];
  int pair[M];
#pragma unroll
  for (int m = 0; m < M; ++m) pair[m] = sorted_pairs[tile.begin + (m < count ? m : 0)];
  for (int idx = tid; idx < M * padded; idx += METRALE_THREADS) {
    const int m = idx / padded, j = idx % padded;
    const float v = (m < count && j < rank)
                        ? t_slice[static_cast<long long>(pair[m]) * t_cols + j]
                        : 0.f;
    const bf16_t hi = f32_to_bf16(v);
    t_hi[m][j] = hi;
    t_lo[m][j] = f32_to_bf16(v - bf16_to_f32(hi));
  }
  __syncthreads();

  const int warp = tid >> 5;
  const int lane = tid & 31;
  const bf16_t* b_rows = reinterpret_cast<const bf16_t*>(b_addr) + static_cast<long long>(o0) * max_rank;
  if (vecs <= 2) {  // CTA-uniform: rank 16 or below
    if (vecs == 1) {
      expand_mma_narrow<1>(b_rows, max_rank, rows, t_hi, t_lo, stage, warp, lane);
    } else {
      expand_mma_narrow<2>(b_rows, max_rank, rows, t_hi, t_lo, stage, warp, lane);
    }
  } else {
  switch (padded) {
    case 32: expand_mma_cols<1>(b_rows, max_rank, rows, vecs, t_hi, t_lo, stage, warp, lane); break;
    case 64: expand_mma_cols<2>(b_rows, max_rank, rows, vecs, t_hi, t_lo, stage, warp, lane); break;
    case 128: expand_mma_cols<4>(b_rows, max_rank, rows, vecs, t_hi, t_lo, stage, warp, lane); break;
    default: expand_mma_cols<8>(b_rows, max_rank, rows, vecs, t_hi, t_lo, stage, warp, lane); break;
  }
  }
  __syncthreads();

  // y: this thread's 8 outputs of every pair, all loaded before the first store (pairs past
  // the tile's end re-read the first pair's row and are not stored).
  const int o = tid * BGMV_EXPAND_ROWS;
  if (o >= rows) return;
  OutT* y_out[M];
  float yv[M][BGMV_EXPAND_ROWS];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    y_out[m] = y + static_cast<long long>(pair[m]) * y_stride + slice * out_dim + o0 + o;
    load_y8(y_out[m], yv[m]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m < count) {
#pragma unroll
      for (int i = 0; i < BGMV_EXPAND_ROWS; ++i) yv[m][i] += scale * stage[m][o + i];
      store_y8(y_out[m], yv[m]);
    }
  }
}

#define EXPERT_EXPAND_PARAMS(OutT)                                                             \
  const float *__restrict__ t, const int *__restrict__ sorted_pairs,                           \
      const int *__restrict__ tiles, const ptr_t *__restrict__ b_tables,                       \
      const int *__restrict__ entries, int num_experts, const float *__restrict__ scale_table, \
      const int *__restrict__ ranks, int max_loras, OutT *__restrict__ y, long long y_stride,  \
      int num_pairs, int out_dim, int max_rank, int t_cols
#define EXPERT_EXPAND_ARGS                                                                     \
  t, sorted_pairs, tiles, b_tables, entries, num_experts, scale_table, ranks, max_loras, y,    \
      y_stride, num_pairs, out_dim, max_rank, t_cols

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, EXPERT_EXPAND_DECODE_MIN_CTAS)
expert_expand_decode_bf16(EXPERT_EXPAND_PARAMS(bf16_t)) {
  expert_expand_body<EXPERT_DECODE_TILE>(EXPERT_EXPAND_ARGS);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, EXPERT_EXPAND_DECODE_MIN_CTAS)
expert_expand_decode_f32(EXPERT_EXPAND_PARAMS(float)) {
  expert_expand_body<EXPERT_DECODE_TILE>(EXPERT_EXPAND_ARGS);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, EXPERT_EXPAND_PREFILL_MIN_CTAS)
expert_expand_prefill_bf16(EXPERT_EXPAND_PARAMS(bf16_t)) {
  expert_expand_mma_body(EXPERT_EXPAND_ARGS);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, EXPERT_EXPAND_PREFILL_MIN_CTAS)
expert_expand_prefill_f32(EXPERT_EXPAND_PARAMS(float)) {
  expert_expand_mma_body(EXPERT_EXPAND_ARGS);
}

// ---- token overlays --------------------------------------------------------------------------

// overlay_ids i32 [max_loras, max_tokens]: each slot's overlaid token ids ascending, its first
// overlay_counts[s] valid; rows BF16 [max_loras, max_tokens, hidden]: row i replaces token
// overlay_ids[s, i]'s embedding. emb BF16 [T, emb_stride]; hidden a multiple of 8.
extern "C" __global__ void __launch_bounds__(METRALE_THREADS, OVERLAY_GATHER_MIN_CTAS)
overlay_gather(const int* __restrict__ token_ids, const int* __restrict__ slots,
               const int* __restrict__ overlay_ids, const int* __restrict__ overlay_counts,
               const bf16_t* __restrict__ rows, int max_loras, int max_tokens, int hidden,
               bf16_t* __restrict__ emb, long long emb_stride) {
  const int b = blockIdx.x;
  const int slot = slots[b];
  if (slot < 0 || slot >= max_loras) return;
  const int token = token_ids[b];
  const int* ids = overlay_ids + static_cast<long long>(slot) * max_tokens;
  int lo = 0, hi = overlay_counts[slot];
  while (lo < hi) {  // first index whose id is >= token
    const int mid = (lo + hi) >> 1;
    if (ids[mid] < token) lo = mid + 1; else hi = mid;
  }
  if (lo >= overlay_counts[slot] || ids[lo] != token) return;  // not overlaid: row untouched
  const bf16_t* src = rows + (static_cast<long long>(slot) * max_tokens + lo) * hidden;
  bf16_t* dst = emb + static_cast<long long>(b) * emb_stride;
  constexpr int kStep = METRALE_THREADS * 8;
  for (int c = threadIdx.x * 8; c < hidden; c += OVERLAY_LOADS * kStep) {
    uint4 v[OVERLAY_LOADS];
#pragma unroll
    for (int q = 0; q < OVERLAY_LOADS; ++q) v[q] = load16(src + (c + q * kStep < hidden ? c + q * kStep : c));
#pragma unroll
    for (int q = 0; q < OVERLAY_LOADS; ++q)
      if (c + q * kStep < hidden) *reinterpret_cast<uint4*>(dst + c + q * kStep) = v[q];
  }
}
