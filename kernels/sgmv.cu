// sgmv.cu: prefill LoRA delta (SGMV: runs of tokens that share a pool slot), on tensor cores.
//
// Segments: seg_starts i32 [S + 1] (non-decreasing), seg_slots i32 [S]; tokens
// [seg_starts[i], seg_starts[i + 1]) use slot seg_slots[i]. Tokens outside every segment, and
// segments whose slot is -1, out of the table, has a 0 pointer or rank 0, are skipped exactly as
// in bgmv.cu. With s, r, A_s, B_s as there:
//
//   sgmv_shrink:  t[b, j] = sum_k x[b, k] * A_s[j, k]                       j < r
//                 (split-K: split z's partial sum over its K chunk, the splits added in order)
//                 t[b, j] = 0                                             j >= r, or token skipped
//   sgmv_expand:  y[b, o] += scale_table[s] * sum_{j < r} t[b, j] * B_s[o, j]
//                 y[b, :] untouched (bit for bit) when the token is skipped
//
// Buffers and alignment as in bgmv.cu (t F32 [T, t_cols], written once: split-K's partials go
// to the workspace and the CTA drawing a tile's last ticket sums them in split order and
// stores t, as there; no memset; y BF16 or F32).
//
// Fused slices, as in bgmv.cu: the projections of a layer that share x (q, k and v; gate and up)
// are one shrink and one expand launch, slice z taking its own table row (a_table, b_table u64
// [num_slices, max_loras]), its own t plane (t F32 [num_slices, T, t_cols]) and, in the expand,
// its own columns of one y (slice_cols i32 [num_slices + 1]); the slot, its rank and its scale
// are the chunk's in every slice. The expand takes the slice on grid.z. The shrink does not:
// its 64-column tiles run over the slices' rank columns side by side (column c is rank row
// c % t_cols of slice c / t_cols), so where the slices' ranks fit in one tile (q, k and v at
// rank 16: 48 columns) a chunk's x tiles are streamed once for all of them, not once a slice.
//
// token_order (i32 [T], or null for the identity) lets the decode path run here: the host sorts a
// batch's tokens by slot (a segment plan, plans.plan_batch) and the segments then index sorted
// positions, while x, t and y stay in token order (position p is token token_order[p]). Each
// adapter's weight tile is then read once per 64 tokens instead of once per token. Products run on mma.sync m16n8k16 (BF16 in, F32 accumulate), so
// sm_80 or newer. The expand rounds the F32 t to BF16 for the tensor cores (the largest error
// source: relative 2^-9 per t element); the shrink is exact up to F32 summation order.
//
// Work: one CTA per (chunk, column tile), never walking segments. The launcher cuts every segment
// into chunks of at most 64 consecutive positions (plans.segment_chunks: on the host, O(S),
// from the seg_starts it already copies to check them) and passes them as chunks i32 [C, 4] =
// (begin, end, slot, 0): one 16-byte load gives a CTA its rows and its slot, where a CTA of a
// fixed 64-token window used to binary-search the segments (a chain of log2(S + 1) dependent
// loads) and then walk every segment meeting its window, each a pass of its own with a pipeline
// refill and two barriers. Tokens before the first segment form chunks of slot -1, so the
// shrink still writes t's every row; empty segments have no chunk.
//
// Pipelines: each K tile (shrink) or rank chunk (expand) of 64 is streamed into shared memory by
// cp.async (lora_common.cuh), SGMV_*_STAGES tiles in flight per thread: the prologue issues that
// many, and every iteration waits for the oldest, works on it, and refills its stage with the
// tile that many further on. Rows outside the chunk and columns past K or the rank are
// zero-filled by the copy (source size 0), not loaded: a chunk of one token moves one x row.
// The rank loop stops at r: the shrink skips 8-column mma tiles at or past r and never loads A
// rows >= r; the expand's K loop ends at r.
//
// Launch shapes (planned by metrale_cli/ops/plans.py, which the host harness shares):
//   sgmv_shrink:    grid (ceil(num_slices x t_cols / 64), chunks, num_splits), block 128 (4 warps
//                   x 16 tokens); 3 stages of a 64 x 64 x tile and a 64 x 64 A tile (48 KiB).
//   sgmv_expand_*:  grid (ceil(ceil(out_dim / 64) / out_tiles), chunks, num_slices), block 128,
//                   out_dim the widest slice's (a narrower slice's spare CTAs exit); a chunk's
//                   tokens x out_tiles tiles of 64 outputs, its (output tile, rank chunk) items
//                   through 2 stages of an F32 t tile and a B tile (48 KiB); each output tile's
//                   F32 result is staged through the stage just read, so the y
//                   read-modify-write is 16-byte coalesced; its y vectors are loaded a tile
//                   ahead (two register sets), so no item waits a round trip for them. out_tiles (costs.expand_out_tiles)
//                   is 1 where chunks fill the device, more for small chunks: a CTA then pays
//                   its metadata once for several B tiles.
// Shared tiles are unpadded, 64 elements a row, with their 16-byte vectors XOR-swizzled by row
// (bf16_at, f32_at) so that the fragment reads of a warp hit distinct banks: padding would not
// let three stages fit in the 48 KiB of static shared memory a CTA may have.
//
// Compile alone:
//   nvcc -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Werror -c -o /dev/null kernels/sgmv.cu
#include "lora_common.cuh"

#define SG_M SGMV_TILE  // positions per chunk, and per CTA: 4 warps x 16 rows (the mma M)
#define SG_N SGMV_TILE  // rank columns (shrink) or output columns (expand) per CTA: 8 n8 tiles
#define SG_K SGMV_TILE  // K elements per shared-memory tile, and a tile's row length
// A 64 x 64 BF16 tile is 512 16-byte vectors: 4 per thread, rows tid / 8 + 16 i, vector tid % 8.
#define SG_TILE_VECS 4
// A 64 x 64 F32 tile is 1024: 8 per thread, rows tid / 16 + 8 i, vector tid % 16.
#define SG_T_VECS 8

// Element offset of (row, col) in a 64 x 64 BF16 tile: 16-byte vector col / 8 of a row is
// stored at vector (col / 8) ^ (row % 8), so the 8 rows g of a fragment read (same column) fall
// on 8 distinct groups of 4 banks.
__device__ __forceinline__ int bf16_at(int row, int col) {
  return row * SG_K + ((((col >> 3) ^ row) & 7) << 3) + (col & 7);
}
// The same for a 64 x 64 F32 tile (16 vectors of 4 a row): vector (col / 4) ^ 2 (row % 8), so
// the 8-byte fragment reads of a half warp (rows g < 4, columns 2q) hit 32 distinct banks.
__device__ __forceinline__ int f32_at(int row, int col) {
  return row * SG_K + ((((col >> 2) ^ (row << 1)) & 15) << 2) + (col & 3);
}

// The token at sorted position p.
__device__ __forceinline__ int token_at(const int* __restrict__ order, int p) {
  return order ? order[p] : p;
}

// A CTA's chunk: positions [begin, begin + rows) of one segment, all with `slot`.
struct Chunk {
  int begin;
  int rows;
  int slot;
};
__device__ __forceinline__ Chunk chunk_at(const int* __restrict__ chunks, int c) {
  const uint4 v = load16(chunks + 4 * static_cast<long long>(c));
  return Chunk{static_cast<int>(v.x), static_cast<int>(v.y) - static_cast<int>(v.x),
               static_cast<int>(v.z)};
}

// acc[nt] += A_tile[warp rows, kk..kk+15] * B_tile[nt*8.., kk..kk+15]^T for the n8 tiles nt
// whose bit is set in `live`.
__device__ __forceinline__ void mma_k16(float (&acc)[SG_N / 8][4], const bf16_t* a_tile,
                                        const bf16_t* b_tile, int warp, int lane, int kk,
                                        unsigned live) {
  const int g = lane >> 2;
  const int c = kk + (lane & 3) * 2;
  const int r0 = warp * 16 + g;
  unsigned af[4];
  af[0] = lds32(&a_tile[bf16_at(r0, c)]);
  af[1] = lds32(&a_tile[bf16_at(r0 + 8, c)]);
  af[2] = lds32(&a_tile[bf16_at(r0, c + 8)]);
  af[3] = lds32(&a_tile[bf16_at(r0 + 8, c + 8)]);
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) {
    if ((live >> nt) & 1u) {
      unsigned bf[2];
      bf[0] = lds32(&b_tile[bf16_at(nt * 8 + g, c)]);
      bf[1] = lds32(&b_tile[bf16_at(nt * 8 + g, c + 8)]);
      mma_bf16_16816(acc[nt], af, bf);
    }
  }
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, SGMV_SHRINK_MIN_CTAS)
sgmv_shrink(const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ chunks,
            const int* __restrict__ token_order, const ptr_t* __restrict__ a_table,
            const int* __restrict__ ranks, int max_loras, float* __restrict__ t, int num_tokens,
            int in_dim, int max_rank, int t_cols, int k_chunk, int num_slices, float* partials,
            unsigned* tickets) {
  __shared__ __align__(16) bf16_t x_tile[SGMV_SHRINK_STAGES][SG_M * SG_K];
  __shared__ __align__(16) bf16_t a_tile[SGMV_SHRINK_STAGES][SG_N * SG_K];
  // The CTA's 64 columns of the slices' rank columns side by side: column c is rank row
  // c % t_cols of slice c / t_cols (its own A table row and t plane). t_cols is a multiple of
  // 8, so every n8 tile lies in one slice, and where the slices' ranks fit in one tile the x
  // tiles of a chunk are read once for all of them.
  const int n0 = blockIdx.x * SG_N;
  const int columns = num_slices * t_cols;
  const Chunk chunk = chunk_at(chunks, blockIdx.y);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int k_begin = blockIdx.z * k_chunk;
  const int k_end = imin(in_dim, k_begin + k_chunk);
  // Splits that start past K (the planner rounds k_chunk up) take no ticket; the last of the
  // `active` ones reduces.
  const int active = imin(gridDim.z, (in_dim + k_chunk - 1) / k_chunk);
  const int split = blockIdx.z;
  const int listed = slot_rank(ranks, chunk.slot, max_loras);
  const int rank = imin(imin(listed, max_rank), t_cols);
  // Each n8 tile's slice's table entry (the slice clamped into the table, so that no load
  // waits behind a branch: all of them side by side with the rank, one round trip after the
  // chunk), and the tiles with rank rows of an adapted slice (CTA-uniform).
  ptr_t entry[SG_N / 8];
  unsigned live = 0;
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) {
    const int c = n0 + nt * 8;
    const int slice = c / t_cols;
    entry[nt] = slot_address(a_table + static_cast<long long>(imin(slice, num_slices - 1)) *
                                           max_loras,
                             chunk.slot, max_loras);
    if (c < columns && c - slice * t_cols < rank && entry[nt]) live |= 1u << nt;
  }
  const int k_tiles = live && k_begin < k_end ? (k_end - k_begin + SG_K - 1) / SG_K : 0;
  // An empty trailing split returns (CTA-uniform, before any barrier). A tile with nothing to
  // add (a skipped chunk, columns past the rank: the same for every split) is stored as zeros
  // by split 0 alone, with no ticket; that test waits for the table entries, so it comes after
  // the pipeline's issue (no copy waits behind it), where k_tiles = 0 has skipped the loop.
  const bool split_k = live && active > 1;
  if (split >= active) return;

  float acc[SG_N / 8][4];
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  if (k_tiles > 0) {
    const bool warp_active = warp * 16 < chunk.rows;
    const int vec = (tid & 7) * 8;
    // This thread's 4 x rows and 4 A rows; a row without data names x's first row (a valid
    // address) and copies nothing.
    const bf16_t* x_src[SG_TILE_VECS];
    const bf16_t* a_src[SG_TILE_VECS];
    bool x_keep[SG_TILE_VECS], a_keep[SG_TILE_VECS];
#pragma unroll
    for (int i = 0; i < SG_TILE_VECS; ++i) {
      const int row = (tid >> 3) + 16 * i;
      x_keep[i] = row < chunk.rows;
      x_src[i] = x + static_cast<long long>(token_at(token_order, chunk.begin + (x_keep[i] ? row : 0))) *
                         x_stride;
      const int c = n0 + row;
      const int slice = c / t_cols;
      const int j = c - slice * t_cols;
      a_keep[i] = ((live >> (row >> 3)) & 1u) && j < rank;
      // The row's n8 tile is row / 8 = 2 i + tid / 64: a select between two constant indices
      // keeps `entry` in registers (an index unknown at compile time would put it in local
      // memory).
      const ptr_t a_addr = (tid >> 6) ? entry[2 * i + 1] : entry[2 * i];
      a_src[i] = a_keep[i] ? reinterpret_cast<const bf16_t*>(a_addr) +
                                 static_cast<long long>(j) * in_dim
                           : x;
    }
    // Issue K tile kt into its stage (columns at or past k_end: zero-filled).
    auto issue = [&](int kt) {
      const int col = k_begin + kt * SG_K + vec;
      const bool col_ok = col < k_end;
      const int at = col_ok ? col : k_begin;
      const int stage = kt % SGMV_SHRINK_STAGES;
#pragma unroll
      for (int i = 0; i < SG_TILE_VECS; ++i) {
        const int row = (tid >> 3) + 16 * i;
        cp_async16(&x_tile[stage][bf16_at(row, vec)], x_src[i] + at, col_ok && x_keep[i] ? 16 : 0);
        cp_async16(&a_tile[stage][bf16_at(row, vec)], a_src[i] + at, col_ok && a_keep[i] ? 16 : 0);
      }
    };
#pragma unroll
    for (int s = 0; s < SGMV_SHRINK_STAGES; ++s) {
      if (s < k_tiles) issue(s);
      cp_async_commit();  // empty groups too, so that every wait counts whole tiles
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<SGMV_SHRINK_STAGES - 1>();  // tile kt is here; the younger ones may fly
      __syncthreads();                           // and so is every other thread's share of it
      const int stage = kt % SGMV_SHRINK_STAGES;
      if (warp_active) {
#pragma unroll
        for (int kk = 0; kk < SG_K; kk += 16)
          mma_k16(acc, x_tile[stage], a_tile[stage], warp, lane, kk, live);
      }
      __syncthreads();  // every warp is done with the stage before it is refilled
      if (kt + SGMV_SHRINK_STAGES < k_tiles) issue(kt + SGMV_SHRINK_STAGES);
      cp_async_commit();
    }
  }

  if (!live && split > 0) return;
  if (split_k) {
    // Each split's 64 x 64 partial tile, laid out by (fragment value, thread) so that a warp's
    // stores and the last CTA's loads are 128 contiguous bytes; the last CTA sums the splits in
    // order (lora_common.cuh, split_last) into its registers and stores t as one split does.
    // Where the tile's rank rows lie in its first 16 columns (live < 4: rank 16, the decode
    // case) only those 2 of its 8 column groups are stored, the ones the last CTA reads back.
    const long long tile = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
    const long long tiles = static_cast<long long>(gridDim.y) * gridDim.x;
    constexpr int kValues = SG_N / 8 * 4;
    const int stored = live < 4u ? 2 : SG_N / 8;
#pragma unroll
    for (int nt = 0; nt < SG_N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nt < stored) __stcg(&partials[((split * tiles + tile) * kValues + nt * 4 + e) * METRALE_THREADS + tid],
               acc[nt][e]);
    // The ticket's shared word: the first stage's, whose copies have all landed and whose
    // mma reads ended at the loop's last barrier.
    if (!split_last(tickets, tile, active, reinterpret_cast<unsigned*>(x_tile[0]))) return;
#pragma unroll
    for (int nt = 0; nt < SG_N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
    auto partial = [&](int z, int nt, int e) {
      return __ldcg(&partials[((z * tiles + tile) * kValues + nt * 4 + e) * METRALE_THREADS + tid]);
    };
    if (live < 4u) {
      // Rank rows only in the first 16 columns (a rank-16 tile, the decode case): 8 values a
      // split, so SGMV_SPLITS_PER_TRIP splits' loads are issued before the first add (one round
      // trip per that many splits), then added in split order.
      int z = 0;
      for (; z + SGMV_SPLITS_PER_TRIP <= active; z += SGMV_SPLITS_PER_TRIP) {
        float v[SGMV_SPLITS_PER_TRIP][2][4];
#pragma unroll
        for (int u = 0; u < SGMV_SPLITS_PER_TRIP; ++u)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) v[u][nt][e] = partial(z + u, nt, e);
#pragma unroll
        for (int u = 0; u < SGMV_SPLITS_PER_TRIP; ++u)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] += v[u][nt][e];
      }
      for (; z < active; ++z)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] += partial(z, nt, e);
    } else {
      // Each thread's 32 values a split, SGMV_WIDE_SPLITS_PER_TRIP splits' loads before the
      // first add, then the rest one split a round trip; added in split order.
      int z = 0;
      for (; z + SGMV_WIDE_SPLITS_PER_TRIP <= active; z += SGMV_WIDE_SPLITS_PER_TRIP) {
        float v[SGMV_WIDE_SPLITS_PER_TRIP][SG_N / 8][4];
#pragma unroll
        for (int u = 0; u < SGMV_WIDE_SPLITS_PER_TRIP; ++u)
#pragma unroll
          for (int nt = 0; nt < SG_N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) v[u][nt][e] = partial(z + u, nt, e);
#pragma unroll
        for (int u = 0; u < SGMV_WIDE_SPLITS_PER_TRIP; ++u)
#pragma unroll
          for (int nt = 0; nt < SG_N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] += v[u][nt][e];
      }
      for (; z < active; ++z) {
#pragma unroll
        for (int nt = 0; nt < SG_N / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] += partial(z, nt, e);
      }
    }
  }

  // Rows of a skipped chunk and columns past the rank hold exact zeros here; every t element
  // of the CTA's rows and columns is stored once, by its one split or split-K's last CTA.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + (lane >> 2) + h * 8;
    if (row >= chunk.rows) continue;
    const long long token = token_at(token_order, chunk.begin + row);
#pragma unroll
    for (int nt = 0; nt < SG_N / 8; ++nt) {
      const int col = n0 + nt * 8 + (lane & 3) * 2;
      if (col < columns) {
        // col and col + 1 are in one slice (t_cols is even): its plane, its rank row.
        const int slice = col / t_cols;
        float* out = t + (slice * static_cast<long long>(num_tokens) + token) * t_cols +
                     (col - slice * t_cols);
        out[0] = acc[nt][2 * h];
        out[1] = acc[nt][2 * h + 1];
      }
    }
  }
}

// y row update for 8 consecutive outputs: one 16-byte BF16 vector, or two F32 float4.
struct Y8 {
  uint4 v[2];
};
__device__ __forceinline__ Y8 load_y(const bf16_t* y) {
  Y8 r;
  r.v[0] = *reinterpret_cast<const uint4*>(y);
  r.v[1] = r.v[0];
  return r;
}
__device__ __forceinline__ Y8 load_y(const float* y) {
  Y8 r;
  r.v[0] = reinterpret_cast<const uint4*>(y)[0];
  r.v[1] = reinterpret_cast<const uint4*>(y)[1];
  return r;
}
__device__ __forceinline__ void add_store_y(bf16_t* y, const Y8& old, const float* delta,
                                            float scale) {
  uint4 v = old.v[0];
  unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = pack_bf16x2(bf16_lo(w[i]) + scale * delta[2 * i], bf16_hi(w[i]) + scale * delta[2 * i + 1]);
  *reinterpret_cast<uint4*>(y) = v;
}
__device__ __forceinline__ void add_store_y(float* y, const Y8& old, const float* delta,
                                            float scale) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float4 v;
    v.x = __uint_as_float(old.v[h].x) + scale * delta[4 * h];
    v.y = __uint_as_float(old.v[h].y) + scale * delta[4 * h + 1];
    v.z = __uint_as_float(old.v[h].z) + scale * delta[4 * h + 2];
    v.w = __uint_as_float(old.v[h].w) + scale * delta[4 * h + 3];
    reinterpret_cast<float4*>(y)[h] = v;
  }
}

template <typename OutT>
__device__ __forceinline__ void sgmv_expand_body(
    const float* __restrict__ t, const int* __restrict__ chunks,
    const int* __restrict__ token_order, const ptr_t* __restrict__ b_table,
    const float* __restrict__ scale_table, const int* __restrict__ ranks, int max_loras,
    OutT* __restrict__ y, long long y_stride, int num_tokens, int out_dim, int max_rank,
    int t_cols, int out_tiles, const int* __restrict__ slice_cols) {
  __shared__ __align__(16) float t_tile[SGMV_EXPAND_STAGES][SG_M * SG_K];
  __shared__ __align__(16) bf16_t b_tile[SGMV_EXPAND_STAGES][SG_N * SG_K];
  const int first_tile = blockIdx.x * out_tiles;
  // grid.z is the fused slice, as in bgmv.cu: its B table row, its t plane and its columns of
  // y (slice_cols[z] up to slice_cols[z + 1]; null for one slice: all out_dim columns), the
  // bounds read beside the chunk, not behind it. out_dim is the slice's width from here on.
  const int slice = blockIdx.z;
  const int col0 = slice_cols ? slice_cols[slice] : 0;
  if (slice_cols) out_dim = slice_cols[slice + 1] - col0;
  // The CTA's items: (output tile, rank chunk) pairs, the rank chunks of one output tile in a
  // row, all streamed through one pipeline. A narrower slice's spare CTAs have no tile and
  // return after the bounds, before anything else is read. CTA-uniform, before any barrier.
  const int tiles = imin(out_tiles, (out_dim + SG_N - 1) / SG_N - first_tile);
  if (tiles <= 0) return;
  const Chunk chunk = chunk_at(chunks, blockIdx.y);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  t += static_cast<long long>(slice) * num_tokens * t_cols;
  const ptr_t b_addr = slot_address(b_table + static_cast<long long>(slice) * max_loras,
                                    chunk.slot, max_loras);
  const int listed = slot_rank(ranks, chunk.slot, max_loras);
  const int rank = b_addr ? imin(imin(listed, max_rank), t_cols) : 0;
  // A skipped chunk leaves its y rows untouched. CTA-uniform, before any barrier.
  if (rank <= 0) return;
  const float scale = scale_table[chunk.slot];
  const int r_tiles = (rank + SG_K - 1) / SG_K;
  const int items = tiles * r_tiles;
  const bool warp_active = warp * 16 < chunk.rows;
  const bf16_t* b_rows = reinterpret_cast<const bf16_t*>(b_addr);

  // This thread's t rows (positions of the chunk) and B rows (outputs; past out_dim: the last
  // row, copying nothing). Columns at or past the rank are zero-filled, neither loaded nor
  // trusted to be zero padding.
  // The t rows are kept as 32-bit element offsets into the slice's plane (token x t_cols, at
  // most 2^31 / 256 tokens), not 64-bit pointers: the F32 expand's two sets of y registers
  // need the 8 registers that saves to stay within the launch bounds' 168 without spilling.
  const int t_vec = (tid & 15) * 4;
  unsigned t_row[SG_T_VECS];
  bool t_keep[SG_T_VECS];
#pragma unroll
  for (int i = 0; i < SG_T_VECS; ++i) {
    const int row = (tid >> 4) + 8 * i;
    t_keep[i] = row < chunk.rows;
    t_row[i] = static_cast<unsigned>(token_at(token_order, chunk.begin + (t_keep[i] ? row : 0))) *
               static_cast<unsigned>(t_cols);
  }
  const int b_vec = (tid & 7) * 8;
  // Issue item `item` (the t tile of its rank chunk with its output tile's B tile) into its
  // stage.
  auto issue = [&](int item) {
    const int o0 = (first_tile + item / r_tiles) * SG_N;
    const int kc = (item % r_tiles) * SG_K;
    const int stage = item % SGMV_EXPAND_STAGES;
    const int t_col = kc + t_vec;
    const int t_bytes = imax(0, imin(4, rank - t_col)) * 4;
    const int t_at = t_bytes ? t_col : kc;
#pragma unroll
    for (int i = 0; i < SG_T_VECS; ++i)
      cp_async16(&t_tile[stage][f32_at((tid >> 4) + 8 * i, t_vec)], t + t_row[i] + t_at,
                 t_keep[i] ? t_bytes : 0);
    const int b_col = kc + b_vec;
    const int b_bytes = imax(0, imin(8, rank - b_col)) * 2;
    const int b_at = b_bytes ? b_col : kc;
#pragma unroll
    for (int i = 0; i < SG_TILE_VECS; ++i) {
      const int out = o0 + (tid >> 3) + 16 * i;
      cp_async16(&b_tile[stage][bf16_at((tid >> 3) + 16 * i, b_vec)],
                 b_rows + static_cast<long long>(imin(out, out_dim - 1)) * max_rank + b_at,
                 out < out_dim ? b_bytes : 0);
    }
  };

  float acc[SG_N / 8][4];
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int s = 0; s < SGMV_EXPAND_STAGES; ++s) {
    if (s < items) issue(s);
    cp_async_commit();
  }
  const int g = lane >> 2;
  const int col = (tid & 7) * 8;
  // The thread's y rows' tokens (clamped into the chunk), looked up once for every output
  // tile; kept as tokens rather than 64-bit row pointers for the registers, as t's rows.
  int y_token[SG_TILE_VECS];
#pragma unroll
  for (int i = 0; i < SG_TILE_VECS; ++i)
    y_token[i] = token_at(token_order, chunk.begin + imin((tid >> 3) + 16 * i, chunk.rows - 1));
  auto y_at = [&](int i, int c) {
    return y + static_cast<long long>(y_token[i]) * y_stride + col0 + c;
  };
  // The thread's y vectors of the output tile at o0 (clamped into the row; only rows of the
  // chunk inside out_dim are stored).
  auto load_tile_y = [&](int o0, Y8 (&into)[SG_TILE_VECS]) {
#pragma unroll
    for (int i = 0; i < SG_TILE_VECS; ++i) into[i] = load_y(y_at(i, imin(o0 + col, out_dim - 8)));
  };
  // Output tile n: its rank chunks' items, then its y read-modify-write from `cur`. Tile n + 1's
  // y vectors are loaded into `next` before tile n's first wait, right behind the copies of
  // tile n + 1's first item (issued at the end of the item before), so they travel with those
  // copies and are in place when tile n + 1's epilogue needs them: a load issued at tile n + 1's
  // own start would cost that epilogue a round trip of its own, as the item's copies arrived
  // during the wait before it. The y of a tile is read before any of this CTA's stores to it
  // (its columns are the tile's, written only in its own epilogue).
  auto run_tile = [&](int n, const Y8 (&cur)[SG_TILE_VECS], Y8 (&next)[SG_TILE_VECS]) {
    const int o0 = (first_tile + n) * SG_N;
    if (n + 1 < tiles) load_tile_y(o0 + SG_N, next);
    for (int kc = 0; kc < r_tiles; ++kc) {
      const int item = n * r_tiles + kc;
      cp_async_wait<SGMV_EXPAND_STAGES - 1>();
      __syncthreads();
      const int stage = item % SGMV_EXPAND_STAGES;
      const int kn = imin(SG_K, rank - kc * SG_K);
      if (warp_active) {
        const float* tt = t_tile[stage];
#pragma unroll
        for (int kk = 0; kk < SG_K; kk += 16) {
          if (kk < kn) {
            // The A fragment from the F32 t tile, rounded to BF16 for the tensor cores.
            const int c = kk + (lane & 3) * 2;
            const int r0 = warp * 16 + g;
            const float2 t00 = *reinterpret_cast<const float2*>(&tt[f32_at(r0, c)]);
            const float2 t10 = *reinterpret_cast<const float2*>(&tt[f32_at(r0 + 8, c)]);
            const float2 t01 = *reinterpret_cast<const float2*>(&tt[f32_at(r0, c + 8)]);
            const float2 t11 = *reinterpret_cast<const float2*>(&tt[f32_at(r0 + 8, c + 8)]);
            unsigned af[4];
            af[0] = pack_bf16x2(t00.x, t00.y);
            af[1] = pack_bf16x2(t10.x, t10.y);
            af[2] = pack_bf16x2(t01.x, t01.y);
            af[3] = pack_bf16x2(t11.x, t11.y);
#pragma unroll
            for (int nt = 0; nt < SG_N / 8; ++nt) {
              unsigned bf[2];
              bf[0] = lds32(&b_tile[stage][bf16_at(nt * 8 + g, c)]);
              bf[1] = lds32(&b_tile[stage][bf16_at(nt * 8 + g, c + 8)]);
              mma_bf16_16816(acc[nt], af, bf);
            }
          }
        }
      }
      __syncthreads();  // every warp is done with the stage
      if (kc == r_tiles - 1) {
        // The output tile is complete. Stage the F32 result in the t half of the stage just
        // read (free until its refill below; the other stage stays in flight) so that the y
        // read-modify-write is done with 16-byte vectors over whole rows rather than the
        // fragments' scattered 8-byte pieces.
        float* staged = t_tile[stage];
#pragma unroll
        for (int nt = 0; nt < SG_N / 8; ++nt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float2 v;
            v.x = acc[nt][2 * h];
            v.y = acc[nt][2 * h + 1];
            *reinterpret_cast<float2*>(&staged[f32_at(warp * 16 + g + h * 8, nt * 8 + (lane & 3) * 2)]) = v;
            acc[nt][2 * h] = acc[nt][2 * h + 1] = 0.f;
          }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < SG_TILE_VECS; ++i) {
          const int row = (tid >> 3) + 16 * i;
          if (row < chunk.rows && o0 + col < out_dim) {
            float delta[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) delta[e] = staged[f32_at(row, col + e)];
            add_store_y(y_at(i, o0 + col), cur[i], delta, scale);
          }
        }
        __syncthreads();  // the staged tile is read before the stage is refilled
      }
      if (item + SGMV_EXPAND_STAGES < items) issue(item + SGMV_EXPAND_STAGES);
      cp_async_commit();
    }
  };
  // Two sets of y registers, taken in turn by tiles two apart: the loop is unrolled by two
  // tiles so that each set stays in its registers (a copy from one set to the other would wait
  // for the load in flight).
  Y8 y_even[SG_TILE_VECS], y_odd[SG_TILE_VECS];
  load_tile_y(first_tile * SG_N, y_even);
  for (int n = 0; n < tiles; n += 2) {
    run_tile(n, y_even, y_odd);
    if (n + 1 < tiles) run_tile(n + 1, y_odd, y_even);
  }
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, SGMV_EXPAND_MIN_CTAS)
sgmv_expand_bf16(const float* __restrict__ t, const int* __restrict__ chunks,
                 const int* __restrict__ token_order, const ptr_t* __restrict__ b_table,
                 const float* __restrict__ scale_table, const int* __restrict__ ranks,
                 int max_loras, bf16_t* __restrict__ y, long long y_stride, int num_tokens,
                 int out_dim, int max_rank, int t_cols, int out_tiles,
                 const int* __restrict__ slice_cols) {
  sgmv_expand_body(t, chunks, token_order, b_table, scale_table, ranks, max_loras, y, y_stride,
                   num_tokens, out_dim, max_rank, t_cols, out_tiles, slice_cols);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, SGMV_EXPAND_MIN_CTAS)
sgmv_expand_f32(const float* __restrict__ t, const int* __restrict__ chunks,
                const int* __restrict__ token_order, const ptr_t* __restrict__ b_table,
                const float* __restrict__ scale_table, const int* __restrict__ ranks,
                int max_loras, float* __restrict__ y, long long y_stride, int num_tokens,
                int out_dim, int max_rank, int t_cols, int out_tiles,
                const int* __restrict__ slice_cols) {
  sgmv_expand_body(t, chunks, token_order, b_table, scale_table, ranks, max_loras, y, y_stride,
                   num_tokens, out_dim, max_rank, t_cols, out_tiles, slice_cols);
}
