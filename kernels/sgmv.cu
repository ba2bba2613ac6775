// sgmv.cu: prefill LoRA delta (SGMV: runs of tokens that share a pool slot), on tensor cores.
//
// Segments: seg_starts i32 [S + 1] (non-decreasing), seg_slots i32 [S]; tokens
// [seg_starts[i], seg_starts[i + 1]) use slot seg_slots[i]. Tokens outside every segment, and
// segments whose slot is -1, out of the table, has a 0 pointer or rank 0, are skipped exactly as
// in bgmv.cu. With s, r, A_s, B_s as there:
//
//   sgmv_shrink:  t[z, b, j] = sum_{k in split z} x[b, k] * A_s[j, k]     j < r
//                 t[z, b, j] = 0                                          j >= r, or token skipped
//   sgmv_expand:  y[b, o] += scale_table[s] * sum_{j < r} (sum_z t[z, b, j]) * B_s[o, j]
//                 y[b, :] untouched (bit for bit) when the token is skipped
//
// Buffers and alignment as in bgmv.cu (t F32 [num_splits, T, max_rank]; y BF16 or F32); also
// out_dim is a multiple of 8. Products run on mma.sync m16n8k16 (BF16 in, F32 accumulate), so
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
//   sgmv_shrink:    grid (ceil(max_rank / 64), ceil(T / 64), num_splits), block 128 (4 warps x
//                   16 tokens); K is read in 64-wide tiles double-buffered through registers.
//   sgmv_expand_*:  grid (ceil(out_dim / 64), ceil(T / 64)), block 128; a 64 token x 64 output
//                   tile, staged through shared memory so the y read-modify-write is 16-byte
//                   coalesced.
//
// Compile alone:
//   nvcc -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Werror -c -o /dev/null kernels/sgmv.cu
#include "lora_common.cuh"

#define SG_M 64  // tokens per CTA: 4 warps x 16 rows (the mma M)
#define SG_N 64  // rank columns (shrink) or output columns (expand) per CTA: 8 mma n8 tiles
#define SG_K 64  // K elements per shared-memory tile
// Padded shared row (elements): 144 bytes = 36 words, so the 32 lanes' fragment reads (rows g,
// word q) land on 32 distinct banks.
#define SG_LD (SG_K + 8)

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

// One 64 x 64 BF16 tile = 512 vectors of 16 bytes = 4 per thread; row = v / 8, column vector
// v % 8. Rows outside [row_lo, row_hi) and columns at or past k_end load as zeros.
__device__ __forceinline__ void load_tile(uint4 (&regs)[4], const bf16_t* __restrict__ base,
                                          long long row_stride, int row_lo, int row_hi, int k,
                                          int k_end, int tid) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int v = tid + i * METRALE_THREADS;
    const int row = v >> 3;
    const int col = k + (v & 7) * 8;
    regs[i] = (row >= row_lo && row < row_hi && col < k_end)
                  ? load16(base + static_cast<long long>(row) * row_stride + col)
                  : zero16();
  }
}

__device__ __forceinline__ void store_tile(bf16_t (*tile)[SG_LD], const uint4 (&regs)[4], int tid) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
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

extern "C" __global__ void __launch_bounds__(METRALE_THREADS)
sgmv_shrink(const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ seg_starts,
            const int* __restrict__ seg_slots, int num_segments, const ptr_t* __restrict__ a_table,
            const int* __restrict__ ranks, int max_loras, float* __restrict__ t, int num_tokens,
            int in_dim, int max_rank, int k_chunk) {
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
  const bf16_t* x_window = x + static_cast<long long>(m0) * x_stride;

  float acc[SG_N / 8][4];
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  for (int seg = first_segment(seg_starts, num_segments, m0);
       seg < num_segments && seg_starts[seg] < m_end; ++seg) {
    // Everything below is CTA-uniform, so skipping a segment never splits a barrier.
    const int lo = imax(seg_starts[seg], m0) - m0;
    const int hi = imin(seg_starts[seg + 1], m_end) - m0;
    const int slot = seg_slots[seg];
    const ptr_t a_addr = slot_address(a_table, slot, max_loras);
    const int rank = a_addr ? imin(ranks[slot], max_rank) : 0;
    if (lo >= hi || rank <= n0) continue;
    const int n_valid = imin(SG_N, rank - n0);
    const int n_tiles = (n_valid + 7) >> 3;
    const bool warp_active = warp * 16 < hi && warp * 16 + 16 > lo;
    const bf16_t* a_rows = reinterpret_cast<const bf16_t*>(a_addr) + static_cast<long long>(n0) * in_dim;

    uint4 x_regs[4];
    uint4 a_regs[4];
    load_tile(x_regs, x_window, x_stride, lo, hi, k_begin, k_end, tid);
    load_tile(a_regs, a_rows, in_dim, 0, n_valid, k_begin, k_end, tid);
    for (int k = k_begin; k < k_end; k += SG_K) {
      __syncthreads();  // every warp is done reading the previous tile
      store_tile(x_tile, x_regs, tid);
      store_tile(a_tile, a_regs, tid);
      __syncthreads();
      // Issue the next tile's global loads before the math so they overlap it.
      if (k + SG_K < k_end) {
        load_tile(x_regs, x_window, x_stride, lo, hi, k + SG_K, k_end, tid);
        load_tile(a_regs, a_rows, in_dim, 0, n_valid, k + SG_K, k_end, tid);
      }
      if (warp_active) {
#pragma unroll
        for (int kk = 0; kk < SG_K; kk += 16) mma_k16(acc, x_tile, a_tile, warp, lane, kk, n_tiles);
      }
    }
  }

  // Rows of skipped tokens and columns past the rank hold exact zeros here.
  float* t_split = t + static_cast<long long>(split) * num_tokens * max_rank;
#pragma unroll
  for (int nt = 0; nt < SG_N / 8; ++nt) {
    const int col = n0 + nt * 8 + (lane & 3) * 2;
    if (col >= max_rank) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + warp * 16 + (lane >> 2) + h * 8;
      if (row < num_tokens) {
        float* out = t_split + static_cast<long long>(row) * max_rank + col;
        out[0] = acc[nt][2 * h];
        out[1] = acc[nt][2 * h + 1];
      }
    }
  }
}

// y row update for 8 consecutive outputs (one 16-byte BF16 vector, or two F32 float4).
__device__ __forceinline__ void add_row8(bf16_t* y, const float* delta, float scale) {
  uint4 v = *reinterpret_cast<const uint4*>(y);
  unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = pack_bf16x2(bf16_lo(w[i]) + scale * delta[2 * i], bf16_hi(w[i]) + scale * delta[2 * i + 1]);
  *reinterpret_cast<uint4*>(y) = v;
}

__device__ __forceinline__ void add_row8(float* y, const float* delta, float scale) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float4 v = reinterpret_cast<const float4*>(y)[h];
    v.x += scale * delta[4 * h];
    v.y += scale * delta[4 * h + 1];
    v.z += scale * delta[4 * h + 2];
    v.w += scale * delta[4 * h + 3];
    reinterpret_cast<float4*>(y)[h] = v;
  }
}

template <typename OutT>
__device__ __forceinline__ void sgmv_expand_body(
    const float* __restrict__ t, int num_splits, const int* __restrict__ seg_starts,
    const int* __restrict__ seg_slots, int num_segments, const ptr_t* __restrict__ b_table,
    const float* __restrict__ scale_table, const int* __restrict__ ranks, int max_loras,
    OutT* __restrict__ y, long long y_stride, int num_tokens, int out_dim, int max_rank) {
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
  const long long split_stride = static_cast<long long>(num_tokens) * max_rank;

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
    const int rank = b_addr ? imin(ranks[slot], max_rank) : 0;
    if (lo >= hi || rank <= 0) continue;
    if (tid >= lo && tid < hi) {
      row_active[tid] = 1;
      row_scale[tid] = scale_table[slot];
    }
    const bool warp_active = warp * 16 < hi && warp * 16 + 16 > lo;
    const bf16_t* b_rows = reinterpret_cast<const bf16_t*>(b_addr) + static_cast<long long>(o0) * max_rank;

    for (int kc = 0; kc < rank; kc += SG_K) {
      const int kn = imin(SG_K, rank - kc);
      __syncthreads();  // every warp is done reading the previous tiles
      // t tile: 64 rows x 64 F32 columns as 1024 float4 = 8 per thread; split partials summed in
      // F32, then rounded once to BF16 for the tensor cores.
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int v = tid + i * METRALE_THREADS;
        const int row = v >> 4;
        const int col = (v & 15) * 4;
        float f[4] = {0.f, 0.f, 0.f, 0.f};
        if (row >= lo && row < hi && col < kn) {
          const float* src = t + static_cast<long long>(m0 + row) * max_rank + kc + col;
          for (int z = 0; z < num_splits; ++z) {
            const float4 p = *reinterpret_cast<const float4*>(src + z * split_stride);
            f[0] += p.x;
            f[1] += p.y;
            f[2] += p.z;
            f[3] += p.w;
          }
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (col + e >= kn) f[e] = 0.f;
        }
        unsigned* dst = reinterpret_cast<unsigned*>(&t_tile[row][col]);
        dst[0] = pack_bf16x2(f[0], f[1]);
        dst[1] = pack_bf16x2(f[2], f[3]);
      }
      // B tile: 64 output rows x 64 rank columns; columns at or past the rank are zeroed rather
      // than trusted to be zero padding.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int v = tid + i * METRALE_THREADS;
        const int row = v >> 3;
        const int col = (v & 7) * 8;
        uint4 w = zero16();
        if (o0 + row < out_dim && col < kn) {
          w = load16(b_rows + static_cast<long long>(row) * max_rank + kc + col);
          const int keep = kn - col;  // elements of this vector inside the rank
          if (keep < 8) {
            unsigned* u = reinterpret_cast<unsigned*>(&w);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (2 * e >= keep) {
                u[e] = 0u;
              } else if (2 * e + 1 >= keep) {
                u[e] &= 0xffffu;
              }
            }
          }
        }
        *reinterpret_cast<uint4*>(&b_tile[row][col]) = w;
      }
      __syncthreads();
      if (warp_active) {
        for (int kk = 0; kk < kn; kk += 16) mma_k16(acc, t_tile, b_tile, warp, lane, kk, SG_N / 8);
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
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int v = tid + i * METRALE_THREADS;
    const int row = v >> 3;
    const int col = (v & 7) * 8;
    if (row_active[row] && m0 + row < num_tokens && o0 + col < out_dim) {
      add_row8(y + static_cast<long long>(m0 + row) * y_stride + o0 + col, &stage[row][col],
               row_scale[row]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS)
sgmv_expand_bf16(const float* __restrict__ t, int num_splits, const int* __restrict__ seg_starts,
                 const int* __restrict__ seg_slots, int num_segments,
                 const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
                 const int* __restrict__ ranks, int max_loras, bf16_t* __restrict__ y,
                 long long y_stride, int num_tokens, int out_dim, int max_rank) {
  sgmv_expand_body(t, num_splits, seg_starts, seg_slots, num_segments, b_table, scale_table, ranks,
                   max_loras, y, y_stride, num_tokens, out_dim, max_rank);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS)
sgmv_expand_f32(const float* __restrict__ t, int num_splits, const int* __restrict__ seg_starts,
                const int* __restrict__ seg_slots, int num_segments,
                const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
                const int* __restrict__ ranks, int max_loras, float* __restrict__ y,
                long long y_stride, int num_tokens, int out_dim, int max_rank) {
  sgmv_expand_body(t, num_splits, seg_starts, seg_slots, num_segments, b_table, scale_table, ranks,
                   max_loras, y, y_stride, num_tokens, out_dim, max_rank);
}
