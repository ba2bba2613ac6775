// bgmv.cu: decode LoRA delta (BGMV: one token per row, any mix of pool slots).
//
// For one (layer, module) entry of the pool, with T tokens, token b tagged with slot s = slots[b]
// (-1 = no adapter), r = min(ranks[s], max_rank) and A_s = a_table[s], B_s = b_table[s]:
//
//   bgmv_shrink:  t[z, b, j] = sum_{k in split z} x[b, k] * A_s[j, k]     j < r
//                 t[z, b, j] = 0                                          j >= r, or token skipped
//   bgmv_expand:  y[b, o] += scale_table[s] * sum_{j < r} (sum_z t[z, b, j]) * B_s[o, j]
//                 y[b, :] untouched (bit for bit) when the token is skipped
//
// A token is skipped when its slot is -1 or out of the table, the slot's pointer is 0 (the slot
// does not adapt this entry) or its rank is 0. Shrink writes every t element, so t never needs a
// memset and expand never reads stale values; expand reads only t[:, b, :r].
//
// Buffers (row major; BF16 as raw uint16 bits; every base address 16-byte aligned):
//   x  BF16 [T, in_dim], row stride x_stride elements       slots  i32 [T]
//   A_s BF16 [max_rank, in_dim], B_s BF16 [out_dim, max_rank]  (rows / cols >= r are zero padding)
//   a_table, b_table u64 [max_loras]; scale_table f32 [max_loras]; ranks i32 [max_loras]
//   t  F32 [num_splits, T, max_rank] (split-K partial sums; expand adds the splits)
//   y  BF16 (bgmv_expand_bf16) or F32 (bgmv_expand_f32) [T, out_dim], row stride y_stride
// in_dim, max_rank, x_stride and y_stride are multiples of 8 (16-byte vectors); max_rank <= 256.
//
// Launch shapes (picked by metrale_cli/kernels.py, which the host harness shares):
//   bgmv_shrink:       grid (T, max_rank / 4, num_splits), block 128; each CTA computes 4 rank
//                      rows of one token over one K chunk of k_chunk elements.
//   bgmv_expand_*:     grid (T, ceil(out_dim / rows_per_cta)), block 128; rows_per_cta % 64 == 0.
//
// Compile alone:
//   nvcc -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Werror -c -o /dev/null kernels/bgmv.cu
#include "lora_common.cuh"

// Rank rows per shrink CTA: each lane loads one 16-byte x vector and reuses it for 4 A rows, so 4
// independent A loads are in flight per x load; more rows would shrink the grid at small T.
#define BGMV_SHRINK_ROWS 4
// The largest max_rank the expand's shared t row holds (1 KiB of F32).
#define BGMV_MAX_RANK 256

extern "C" __global__ void __launch_bounds__(METRALE_THREADS)
bgmv_shrink(const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ slots,
            const ptr_t* __restrict__ a_table, const int* __restrict__ ranks, int max_loras,
            float* __restrict__ t, int num_tokens, int in_dim, int max_rank, int k_chunk) {
  const int b = blockIdx.x;
  const int j0 = blockIdx.y * BGMV_SHRINK_ROWS;
  const int split = blockIdx.z;
  const int tid = threadIdx.x;
  float* t_row = t + (static_cast<long long>(split) * num_tokens + b) * max_rank;

  const int slot = slots[b];
  const ptr_t a_addr = slot_address(a_table, slot, max_loras);
  const int rank = a_addr ? imin(ranks[slot], max_rank) : 0;
  if (j0 >= rank) {
    // Padding rows and skipped tokens cost one store, not a pass over A.
    if (tid < BGMV_SHRINK_ROWS && j0 + tid < max_rank) t_row[j0 + tid] = 0.f;
    return;
  }
  const int rows = imin(BGMV_SHRINK_ROWS, rank - j0);
  const bf16_t* x_row = x + static_cast<long long>(b) * x_stride;
  const bf16_t* a_rows = reinterpret_cast<const bf16_t*>(a_addr) + static_cast<long long>(j0) * in_dim;
  const int k_begin = split * k_chunk;
  const int k_end = imin(in_dim, k_begin + k_chunk);

  float acc[BGMV_SHRINK_ROWS];
#pragma unroll
  for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) acc[i] = 0.f;

  // All 4 warps share the rank rows and split the K range: consecutive lanes read consecutive
  // 16-byte vectors, so each warp load is 512 contiguous bytes of one A row.
#pragma unroll 2
  for (int k = k_begin + tid * 8; k < k_end; k += METRALE_THREADS * 8) {
    const uint4 xv = load16(x_row + k);
#pragma unroll
    for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) {
      if (i < rows) acc[i] += dot8(xv, load16(a_rows + static_cast<long long>(i) * in_dim + k));
    }
  }

  __shared__ float partial[METRALE_WARPS][BGMV_SHRINK_ROWS];
  const int warp = tid >> 5;
  const int lane = tid & 31;
#pragma unroll
  for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) {
    const float v = warp_sum(acc[i]);
    if (lane == 0) partial[warp][i] = v;
  }
  __syncthreads();
  if (tid < BGMV_SHRINK_ROWS && j0 + tid < max_rank) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < METRALE_WARPS; ++w) sum += partial[w][tid];
    t_row[j0 + tid] = tid < rows ? sum : 0.f;
  }
}

template <typename OutT>
__device__ __forceinline__ void bgmv_expand_body(
    const float* __restrict__ t, int num_splits, const int* __restrict__ slots,
    const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
    const int* __restrict__ ranks, int max_loras, OutT* __restrict__ y, long long y_stride,
    int num_tokens, int out_dim, int max_rank, int rows_per_cta) {
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int slot = slots[b];
  const ptr_t b_addr = slot_address(b_table, slot, max_loras);
  const int rank = b_addr ? imin(ranks[slot], max_rank) : 0;
  if (rank <= 0) return;  // CTA-uniform, before any barrier: y stays bit-identical
  const float scale = scale_table[slot];
  const int vecs = (rank + 7) >> 3;

  // The token's t row, split-K partials summed, zero-filled up to the 8-element vector boundary
  // so the last B vector's padding columns multiply zeros.
  __shared__ __align__(16) float t_s[BGMV_MAX_RANK];
  for (int j = tid; j < vecs * 8; j += METRALE_THREADS) {
    float v = 0.f;
    if (j < rank) {
      for (int z = 0; z < num_splits; ++z)
        v += t[(static_cast<long long>(z) * num_tokens + b) * max_rank + j];
    }
    t_s[j] = v;
  }
  __syncthreads();

  // Two lanes per output row: a warp load covers 16 rows x 32 contiguous bytes (at rank 16 a
  // whole B row per lane pair), so every DRAM sector fetched is fully used.
  const bf16_t* b_rows = reinterpret_cast<const bf16_t*>(b_addr);
  OutT* y_row = y + static_cast<long long>(b) * y_stride;
  const int pair = tid >> 1;
  const int half = tid & 1;
  const int o_begin = blockIdx.y * rows_per_cta;
  const int o_end = imin(out_dim, o_begin + rows_per_cta);
  // The loop bound is CTA-uniform so that every lane reaches the shuffle.
  for (int base = o_begin; base < o_end; base += METRALE_THREADS / 2) {
    const int o = base + pair;
    float acc = 0.f;
    if (o < o_end) {
      const bf16_t* b_row = b_rows + static_cast<long long>(o) * max_rank;
      for (int v = half; v < vecs; v += 2) acc += dot8_f32(t_s + v * 8, load16(b_row + v * 8));
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (o < o_end && half == 0) store_out(y_row + o, load_out(y_row + o) + scale * acc);
  }
}

// (128, 8): let ptxas use up to 64 registers; at its default 32 the unrolled B loop spills.
extern "C" __global__ void __launch_bounds__(METRALE_THREADS, 8)
bgmv_expand_bf16(const float* __restrict__ t, int num_splits, const int* __restrict__ slots,
                 const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
                 const int* __restrict__ ranks, int max_loras, bf16_t* __restrict__ y,
                 long long y_stride, int num_tokens, int out_dim, int max_rank, int rows_per_cta) {
  bgmv_expand_body(t, num_splits, slots, b_table, scale_table, ranks, max_loras, y, y_stride,
                   num_tokens, out_dim, max_rank, rows_per_cta);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, 8)
bgmv_expand_f32(const float* __restrict__ t, int num_splits, const int* __restrict__ slots,
                const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
                const int* __restrict__ ranks, int max_loras, float* __restrict__ y,
                long long y_stride, int num_tokens, int out_dim, int max_rank, int rows_per_cta) {
  bgmv_expand_body(t, num_splits, slots, b_table, scale_table, ranks, max_loras, y, y_stride,
                   num_tokens, out_dim, max_rank, rows_per_cta);
}
