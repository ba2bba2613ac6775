// sgmv.cu: prefill LoRA delta (SGMV: runs of tokens that share a pool slot), on tensor cores.
//
// Segments: seg_starts i32 [S + 1] (non-decreasing), seg_slots i32 [S]; tokens
// [seg_starts[i], seg_starts[i + 1]) use slot seg_slots[i]. Tokens outside every segment, and
// segments whose slot is -1, out of the table, has a 0 pointer or rank 0, are skipped exactly as
// in bgmv.cu. With s, r, A_s, B_s as there:
//
//   sgmv_shrink:  t[b, j] (+)= sum_{k in split z} x[b, k] * A_s[j, k]      j < r
//                 t[b, j] = 0                                             j >= r, or token skipped
//   sgmv_expand:  y[b, o] += scale_table[s] * sum_{j < r} t[b, j] * B_s[o, j]
//                 y[b, :] untouched (bit for bit) when the token is skipped
//
// Buffers and alignment as in bgmv.cu (t F32 [T, t_cols], split-K added into it by F32 atomics
// and zeroed before such a launch; y BF16 or F32).
//
// token_order (i32 [T], or null for the identity) lets the decode path run here: the host sorts a
// batch's tokens by slot (a segment plan, kernels.plan_batch) and the segments then index sorted
// positions, while x, t and y stay in token order (position p is token token_order[p]). Each
// adapter's weight tile is then read once per 64 tokens instead of once per token. Products run on mma.sync m16n8k16 (BF16 in, F32 accumulate), so
// sm_80 or newer. The expand rounds the F32 t to BF16 for the tensor cores (the largest error
// source: relative 2^-9 per t element); the shrink is exact up to F32 summation order.
//
// Tiling: a CTA owns a fixed 64-token window of the batch, not a segment, so no host-side plan is
// needed and skewed segment lengths launch no idle CTAs. It walks the segments overlapping its
// window (binary search for the first), and for each runs one pass in which only that segment's
// rows are loaded (other rows are zero) and only warps whose 16 rows meet the segment issue mma.
// Passes accumulate into the same registers; the tile is written once at the end. The rank loop
// stops at r: shrink skips 8-column mma tiles at or past r and never loads A rows >= r; expand's K
// loop ends at r.
//
// Launch shapes (picked by metrale_cli/kernels.py, which the host harness shares):
//   sgmv_shrink:    grid (ceil(t_cols / 64), ceil(T / 64), num_splits), block 128 (4 warps x
//                   16 tokens); K is read in 64-wide tiles double-buffered through registers.
//   sgmv_expand_*:  grid (ceil(out_dim / 64), ceil(T / 64)), block 128; a 64 token x 64 output
//                   tile, staged through shared memory so the y read-modify-write is 16-byte
//                   coalesced.
// Memory-level parallelism (kernels/README.md): tile loads are unconditional (rows outside the
// segment and columns past K or the rank are clamped into bounds and masked to zero), and every
// load of a tile is issued before the first use: SGMV_SHRINK_LOADS per thread for the next K tile
// while the tensor cores work on this one; in the expand, the B tile and the t tile together,
// the B tile and the t tile together (SGMV_EXPAND_LOADS loads per pass).
//
// Compile alone:
//   nvcc -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Werror -c -o /dev/null kernels/sgmv.cu
#include "lora_common.cuh"

#define SG_M SGMV_TILE  // tokens per CTA: 4 warps x 16 rows (the mma M)
#define SG_N SGMV_TILE  // rank columns (shrink) or output columns (expand) per CTA: 8 n8 tiles
#define SG_K SGMV_TILE  // K elements per shared-memory tile
// Padded shared row (elements): 144 bytes = 36 words, so the 32 lanes' fragment reads (rows g,
// word q) land on 32 distinct banks.
#define SG_LD (SG_K + 8)
// A 64 x 64 BF16 tile is 512 16-byte vectors: 4 per thread, rows tid / 8 + 16 i, column vector
// tid % 8.
#define SG_TILE_VECS 4

// The first segment whose end lies past token m0 (num_segments if none).
__device__ __forceinline__ int first_segment(const int* __restrict__ seg_starts, int num_segments,
                                             int m0) {
  int lo = 0;
  int hi = num_segments;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (seg_starts[mid + 1] > m0) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// The token at sorted position p.
__device__ __forceinline__ int token_at(const int* __restrict__ order, int p) {
  return order ? order[p] : p;
}

// One thread's share of a 64 x 64 BF16 tile stream: its 4 rows' start pointers and whether
// each row holds data. Rows without data point at a row that does,
// so every load is in bounds and unconditional; the mask zeroes them.
struct TileRows {
  const bf16_t* row[SG_TILE_VECS];
  bool keep[SG_TILE_VECS];
};

// Load the tile at K offset k (columns at or past k_end: clamped to k_end - 8, masked).
__device__ __forceinline__ void load_tile(uint4 (&regs)[SG_TILE_VECS], const TileRows& rows, int k,
                                          int k_end, int tid) {
  const int col = k + (tid & 7) * 8;
  const bool col_ok = col < k_end;
  const int at = col_ok ? col : k_end - 8;
#pragma unroll
  for (int i = 0; i < SG_TILE_VECS; ++i) regs[i] = load16(rows.row[i] + at);
#pragma unroll
  for (int i = 0; i < SG_TILE_VECS; ++i) regs[i] = keep16(col_ok && rows.keep[i], regs[i]);
}

__device__ __forceinline__ void store_tile(bf16_t (*tile)[SG_LD], const uint4 (&regs)[SG_TILE_VECS],
                                           int tid) {
#pragma unroll
  for (int i = 0; i < SG_TILE_VECS; ++i) {
    const int v = tid + i * METRALE_THREADS;
    *reinterpret_cast<uint4*>(&tile[v >> 3][(v & 7) * 8]) = regs[i];
  }
}

// acc[nt] += A_tile[warp rows, kk..kk+15] * B_tile[nt*8.., kk..kk+15]^T for nt < n_tiles.
__device__ __forceinline__ void mma_k16(float (&acc)[SG_N / 8][4], const bf16_t (*a_tile)[SG_LD],
                                        const bf16_t (*b_tile)[SG_LD], int warp, int lane, int kk,
                                        int n_tiles) {
  const int g = lane >> 2;
  const int c = kk + (lane & 3) * 2;
  const int r0 = warp * 16 + g;
  unsigned af[4];
  af[0] = lds32(&a_tile[r0][c]);
  af[1] = lds32(&a_tile[r0 + 8][c]);
  af[2] = lds32(&a_tile[r0][c + 8]);
  af[3] = lds32(&a_tile[r0 + 8][c + 8]);
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) {
    if (nt < n_tiles) {
      unsigned bf[2];
      bf[0] = lds32(&b_tile[nt * 8 + g][c]);
      bf[1] = lds32(&b_tile[nt * 8 + g][c + 8]);
      mma_bf16_16816(acc[nt], af, bf);
    }
  }
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, SGMV_SHRINK_MIN_CTAS)
sgmv_shrink(const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ seg_starts,
            const int* __restrict__ seg_slots, int num_segments,
            const int* __restrict__ token_order, const ptr_t* __restrict__ a_table,
            const int* __restrict__ ranks, int max_loras, float* __restrict__ t, int num_tokens,
            int in_dim, int max_rank, int t_cols, int k_chunk) {
  __shared__ __align__(16) bf16_t x_tile[SG_M][SG_LD];
  __shared__ __align__(16) bf16_t a_tile[SG_N][SG_LD];
  const int n0 = blockIdx.x * SG_N;
  const int m0 = blockIdx.y * SG_M;
  const int split = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int m_end = imin(num_tokens, m0 + SG_M);
  const int k_begin = split * k_chunk;
  const int k_end = imin(in_dim, k_begin + k_chunk);
  const bool accumulate = gridDim.z > 1;
  // An empty trailing split (K does not divide evenly) adds nothing: CTA-uniform, before any
  // barrier.
  if (accumulate && k_begin >= k_end) return;

  float acc[SG_N / 8][4];
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  for (int seg = k_begin < k_end ? first_segment(seg_starts, num_segments, m0) : num_segments;
       seg < num_segments && seg_starts[seg] < m_end; ++seg) {
    // Everything below is CTA-uniform, so skipping a segment never splits a barrier.
    const int lo = imax(seg_starts[seg], m0) - m0;
    const int hi = imin(seg_starts[seg + 1], m_end) - m0;
    const int slot = seg_slots[seg];
    const ptr_t a_addr = slot_address(a_table, slot, max_loras);
    const int listed = slot_rank(ranks, slot, max_loras);
    const int rank = a_addr ? imin(imin(listed, max_rank), t_cols) : 0;
    if (lo >= hi || rank <= n0) continue;
    const int n_valid = imin(SG_N, rank - n0);
    const int n_tiles = (n_valid + 7) >> 3;
    const bool warp_active = warp * 16 < hi && warp * 16 + 16 > lo;
    const bf16_t* a_rows = reinterpret_cast<const bf16_t*>(a_addr) + static_cast<long long>(n0) * in_dim;

    TileRows x_rows, a_src;
#pragma unroll
    for (int i = 0; i < SG_TILE_VECS; ++i) {
      const int row = (tid >> 3) + 16 * i;
      const int token = token_at(token_order, m0 + imin(imax(row, lo), hi - 1));
      x_rows.row[i] = x + static_cast<long long>(token) * x_stride;
      x_rows.keep[i] = row >= lo && row < hi;
      a_src.row[i] = a_rows + static_cast<long long>(imin(row, n_valid - 1)) * in_dim;
      a_src.keep[i] = row < n_valid;
    }

    uint4 x_regs[SG_TILE_VECS];
    uint4 a_regs[SG_TILE_VECS];
    load_tile(x_regs, x_rows, k_begin, k_end, tid);
    load_tile(a_regs, a_src, k_begin, k_end, tid);
    for (int k = k_begin; k < k_end; k += SG_K) {
      __syncthreads();  // every warp is done reading the previous tile
      store_tile(x_tile, x_regs, tid);
      store_tile(a_tile, a_regs, tid);
      __syncthreads();
      // Issue the next tile's loads before the math so they overlap it (past the end: the last
      // tile again, never stored).
      const int k_next = k + SG_K < k_end ? k + SG_K : k;
      load_tile(x_regs, x_rows, k_next, k_end, tid);
      load_tile(a_regs, a_src, k_next, k_end, tid);
      if (warp_active) {
#pragma unroll
        for (int kk = 0; kk < SG_K; kk += 16) mma_k16(acc, x_tile, a_tile, warp, lane, kk, n_tiles);
      }
    }
  }

  // Rows of skipped tokens and columns past the rank hold exact zeros here. One split stores
  // them; split-K adds every partial into the zeroed t (lora_common.cuh, t_store).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int p = m0 + warp * 16 + (lane >> 2) + h * 8;
    if (p >= num_tokens) continue;
    float* out = t + static_cast<long long>(token_at(token_order, p)) * t_cols;
#pragma unroll
    for (int nt = 0; nt < SG_N / 8; ++nt) {
      const int col = n0 + nt * 8 + (lane & 3) * 2;
      if (col < t_cols) {
        t_store(&out[col], acc[nt][2 * h], accumulate);
        t_store(&out[col + 1], acc[nt][2 * h + 1], accumulate);
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

// The t tile: 64 rows x 64 F32 columns = 1024 float4, 8 per thread (rows tid / 16 + 8 i, column
// 4 x (tid % 16)).
#define SG_T_VECS 8

__device__ __forceinline__ float4 load_f4(const float* p) {
  const uint4 u = load16(p);
  float4 f;
  f.x = __uint_as_float(u.x);
  f.y = __uint_as_float(u.y);
  f.z = __uint_as_float(u.z);
  f.w = __uint_as_float(u.w);
  return f;
}

template <typename OutT>
__device__ __forceinline__ void sgmv_expand_body(
    const float* __restrict__ t, const int* __restrict__ seg_starts,
    const int* __restrict__ seg_slots, int num_segments, const int* __restrict__ token_order,
    const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
    const int* __restrict__ ranks, int max_loras, OutT* __restrict__ y, long long y_stride,
    int num_tokens, int out_dim, int max_rank, int t_cols) {
  __shared__ __align__(16) bf16_t t_tile[SG_M][SG_LD];
  __shared__ __align__(16) bf16_t b_tile[SG_N][SG_LD];
  __shared__ __align__(16) float stage[SG_M][SG_N + 4];
  __shared__ float row_scale[SG_M];
  __shared__ int row_active[SG_M];
  const int o0 = blockIdx.x * SG_N;
  const int m0 = blockIdx.y * SG_M;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int m_end = imin(num_tokens, m0 + SG_M);
  const int t_col = (tid & 15) * 4;

  if (tid < SG_M) {
    row_scale[tid] = 0.f;
    row_active[tid] = 0;
  }
  float acc[SG_N / 8][4];
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  for (int seg = first_segment(seg_starts, num_segments, m0);
       seg < num_segments && seg_starts[seg] < m_end; ++seg) {
    const int lo = imax(seg_starts[seg], m0) - m0;
    const int hi = imin(seg_starts[seg + 1], m_end) - m0;
    const int slot = seg_slots[seg];
    const ptr_t b_addr = slot_address(b_table, slot, max_loras);
    const int listed = slot_rank(ranks, slot, max_loras);
    const int rank = b_addr ? imin(imin(listed, max_rank), t_cols) : 0;
    if (lo >= hi || rank <= 0) continue;
    if (tid >= lo && tid < hi) {
      row_active[tid] = 1;
      row_scale[tid] = scale_table[slot];
    }
    const bool warp_active = warp * 16 < hi && warp * 16 + 16 > lo;
    const bf16_t* b_rows = reinterpret_cast<const bf16_t*>(b_addr);
    // This thread's t rows (tokens; rows outside the segment read a row inside it, masked) and B
    // rows (outputs past out_dim read the last one, masked).
    int t_token[SG_T_VECS];
#pragma unroll
    for (int i = 0; i < SG_T_VECS; ++i)
      t_token[i] = token_at(token_order, m0 + imin(imax((tid >> 4) + 8 * i, lo), hi - 1));
    TileRows b_src;
#pragma unroll
    for (int i = 0; i < SG_TILE_VECS; ++i) {
      const int row = (tid >> 3) + 16 * i;
      b_src.row[i] = b_rows + static_cast<long long>(imin(o0 + row, out_dim - 1)) * max_rank;
      b_src.keep[i] = o0 + row < out_dim;
    }

    for (int kc = 0; kc < rank; kc += SG_K) {
      const int kn = imin(SG_K, rank - kc);
      // One pass issues the B tile and the t tile together.
      uint4 w[SG_TILE_VECS];
      load_tile(w, b_src, kc, kc + (kn + 7) / 8 * 8, tid);
      const bool t_col_ok = t_col < kn;
      const int t_at = kc + (t_col_ok ? t_col : 0);
      float4 f[SG_T_VECS];
#pragma unroll
      for (int i = 0; i < SG_T_VECS; ++i)
        f[i] = load_f4(t + static_cast<long long>(t_token[i]) * t_cols + t_at);
      __syncthreads();  // every warp is done reading the previous tiles
#pragma unroll
      for (int i = 0; i < SG_T_VECS; ++i) {
        // Columns at or past the rank are zeroed, not trusted.
        const int row = (tid >> 4) + 8 * i;
        const bool keep = row >= lo && row < hi && t_col_ok;
        const float v[4] = {f[i].x, f[i].y, f[i].z, f[i].w};
        float m[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) m[e] = keep && t_col + e < kn ? v[e] : 0.f;
        unsigned* dst = reinterpret_cast<unsigned*>(&t_tile[row][t_col]);
        dst[0] = pack_bf16x2(m[0], m[1]);
        dst[1] = pack_bf16x2(m[2], m[3]);
      }
      // B columns at or past the rank are zeroed rather than trusted to be zero padding.
      const int keep_cols = kn - (tid & 7) * 8;
#pragma unroll
      for (int i = 0; i < SG_TILE_VECS; ++i) {
        if (keep_cols < 8) {
          unsigned* u = reinterpret_cast<unsigned*>(&w[i]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (2 * e >= keep_cols) {
              u[e] = 0u;
            } else if (2 * e + 1 >= keep_cols) {
              u[e] &= 0xffffu;
            }
          }
        }
      }
      store_tile(b_tile, w, tid);
      __syncthreads();
      // Unrolled with a guard (kn <= 64), so that the rank-chunk loop is the innermost loop the
      // SASS check reads, its B and t loads together.
      if (warp_active) {
#pragma unroll
        for (int kk = 0; kk < SG_K; kk += 16) {
          if (kk < kn) mma_k16(acc, t_tile, b_tile, warp, lane, kk, SG_N / 8);
        }
      }
    }
  }

  // Stage the F32 tile in shared memory so that the y read-modify-write is done with 16-byte
  // vectors over whole rows rather than the fragments' scattered 8-byte pieces.
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) {
    const int col = nt * 8 + (lane & 3) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + (lane >> 2) + h * 8;
      stage[row][col] = acc[nt][2 * h];
      stage[row][col + 1] = acc[nt][2 * h + 1];
    }
  }
  __syncthreads();
  // Every y vector of the thread is loaded before the first is written back (clamped into the
  // batch and the row; only active rows inside it are stored).
  OutT* y_at[SG_TILE_VECS];
  Y8 old[SG_TILE_VECS];
#pragma unroll
  for (int i = 0; i < SG_TILE_VECS; ++i) {
    const int row = (tid >> 3) + 16 * i;
    const int p = imin(m0 + row, num_tokens - 1);
    y_at[i] = y + static_cast<long long>(token_at(token_order, p)) * y_stride +
              imin(o0 + (tid & 7) * 8, out_dim - 8);
    old[i] = load_y(y_at[i]);
  }
#pragma unroll
  for (int i = 0; i < SG_TILE_VECS; ++i) {
    const int row = (tid >> 3) + 16 * i;
    const int col = (tid & 7) * 8;
    if (row_active[row] && m0 + row < num_tokens && o0 + col < out_dim)
      add_store_y(y_at[i], old[i], &stage[row][col], row_scale[row]);
  }
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, SGMV_EXPAND_MIN_CTAS)
sgmv_expand_bf16(const float* __restrict__ t, const int* __restrict__ seg_starts,
                 const int* __restrict__ seg_slots, int num_segments,
                 const int* __restrict__ token_order, const ptr_t* __restrict__ b_table,
                 const float* __restrict__ scale_table, const int* __restrict__ ranks,
                 int max_loras, bf16_t* __restrict__ y, long long y_stride, int num_tokens,
                 int out_dim, int max_rank, int t_cols) {
  sgmv_expand_body(t, seg_starts, seg_slots, num_segments, token_order, b_table,
                   scale_table, ranks, max_loras, y, y_stride, num_tokens, out_dim, max_rank,
                   t_cols);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, SGMV_EXPAND_MIN_CTAS)
sgmv_expand_f32(const float* __restrict__ t, const int* __restrict__ seg_starts,
                const int* __restrict__ seg_slots, int num_segments,
                const int* __restrict__ token_order, const ptr_t* __restrict__ b_table,
                const float* __restrict__ scale_table, const int* __restrict__ ranks,
                int max_loras, float* __restrict__ y, long long y_stride, int num_tokens,
                int out_dim, int max_rank, int t_cols) {
  sgmv_expand_body(t, seg_starts, seg_slots, num_segments, token_order, b_table,
                   scale_table, ranks, max_loras, y, y_stride, num_tokens, out_dim, max_rank,
                   t_cols);
}
