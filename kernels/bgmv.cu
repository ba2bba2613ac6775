// bgmv.cu: decode LoRA delta (BGMV: one token per row, any mix of pool slots).
//
// For one (layer, module) entry of the pool, with T tokens, token b tagged with slot s = slots[b]
// (-1 = no adapter), r = min(ranks[s], max_rank) and A_s = a_table[s], B_s = b_table[s]:
//
//   bgmv_shrink:  t[b, j] = sum_k x[b, k] * A_s[j, k]                       j < r
//                 (split-K: split z's partial sum over its K chunk, the splits added in order)
//                 t[b, j] = 0                                             j >= r, or token skipped
//   bgmv_expand:  y[b, o] += scale_table[s] * sum_{j < r} t[b, j] * B_s[o, j]
//                 y[b, :] untouched (bit for bit) when the token is skipped
//
// Fused slices: the projections of a layer that share x (q, k and v; gate and up) run as one
// shrink and one expand launch, grid.z's slice z taking its own table row (a_table, b_table
// u64 [num_slices, max_loras]), its own t plane (t F32 [num_slices, T, t_cols]) and, in the
// expand, its own columns of one y (slice_cols i32 [num_slices + 1], as vLLM's fused qkv
// output). One slice is the plain (layer, module) delta.
//
// A token is skipped when its slot is -1 or out of the table, the slot's pointer is 0 (the slot
// does not adapt this entry) or its rank is 0. With one split the shrink writes every t element
// (no memset, nothing stale for the expand); with split-K (grid.z > 1) each split stores its
// partial in the workspace (`partials`) and draws a ticket (`tickets`, one u32 counter per
// output tile: lora_common.cuh, split_last); the CTA drawing the last ticket sums the partials
// in split order and writes t with plain stores, and resets the counter to 0. So t is never
// zeroed, needs no memset, and holds the same bits in every run. Expand reads only t[b, :r].
//
// Buffers (row major; BF16 as raw uint16 bits; every base address 16-byte aligned):
//   x  BF16 [T, in_dim], row stride x_stride elements       slots  i32 [T]
//   A_s BF16 [max_rank, in_dim], B_s BF16 [out_dim, max_rank]  (rows / cols >= r are zero padding)
//   a_table, b_table u64 [max_loras]; scale_table f32 [max_loras]; ranks i32 [max_loras]
//   t  F32 [T, t_cols] (written once, split-K's by the last split's CTA); t_cols <= max_rank is the
//      widest rank of the batch (the host knows it), and r is clamped to it
//   y  BF16 (bgmv_expand_bf16) or F32 (bgmv_expand_f32) [T, out_dim], row stride y_stride
// in_dim, out_dim, max_rank, t_cols, x_stride and y_stride are multiples of 8 (16-byte vectors);
// max_rank <= METRALE_MAX_RANK.
//
// Launch shapes (planned by metrale_cli/ops/plans.py, which the host harness shares):
//   bgmv_shrink:       grid (T, t_cols / BGMV_SHRINK_ROWS, num_slices x num_splits), block 128; each CTA
//                      computes 4 rank rows of one token over one K chunk of k_chunk elements.
//   bgmv_expand_*:     grid (T, ceil(widest slice / (128 x 8)), num_slices), block 128; a CTA owns 1024
//                      output rows of one token. Each B row's rank prefix is read by a group of
//                      2^k >= ceil(r / 8) consecutive lanes, one 16-byte vector each, so a warp's
//                      load covers 32 / 2^k consecutive rows' prefixes in consecutive 16-byte pieces
//                      (coalesced; one run when r fills max_rank); the group sums its products by
//                      shuffles, the row sums meet in shared memory, and each thread then adds
//                      into one y vector (8 consecutive outputs).
// Memory-level parallelism (kernels/README.md): every load of a pass is unconditional (rows and
// columns past the data are clamped into bounds and their results masked), and a pass issues all
// its loads before the first product: BGMV_SHRINK_LOADS and BGMV_EXPAND_LOADS per thread.
//
// Compile alone:
//   nvcc -arch=sm_90 -std=c++17 -Werror all-warnings -Xcompiler -Wall,-Werror -c -o /dev/null kernels/bgmv.cu
#include "lora_common.cuh"

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, BGMV_SHRINK_MIN_CTAS)
bgmv_shrink(const bf16_t* __restrict__ x, long long x_stride, const int* __restrict__ slots,
            const ptr_t* __restrict__ a_table, const int* __restrict__ ranks, int max_loras,
            float* __restrict__ t, int num_tokens, int in_dim, int max_rank, int t_cols,
            int k_chunk, int num_slices, float* partials, unsigned* tickets) {
  const int b = blockIdx.x;
  const int j0 = blockIdx.y * BGMV_SHRINK_ROWS;
  // grid.z is (slice, split): the fused slices of one x (q, k, v) each have their own A table
  // row and t plane, and share the split count.
  const int splits = gridDim.z / num_slices;
  const int slice = blockIdx.z / splits;
  const int split = blockIdx.z - slice * splits;
  const int tid = threadIdx.x;
  // Splits that start past K (the planner rounds k_chunk up) have nothing to add: they take no
  // ticket, and the last of the `active` ones reduces.
  const int active = imin(splits, (in_dim + k_chunk - 1) / k_chunk);
  const bool split_k = active > 1;
  if (split >= active) return;
  float* t_row = t + (static_cast<long long>(slice) * num_tokens + b) * t_cols;

  const int slot = slots[b];
  const ptr_t a_addr = slot_address(a_table + static_cast<long long>(slice) * max_loras, slot,
                                    max_loras);
  const int listed = slot_rank(ranks, slot, max_loras);
  const int rank = a_addr ? imin(imin(listed, max_rank), t_cols) : 0;
  if (j0 >= rank) {
    // Padding rows and skipped tokens cost one store, not a pass over A: split 0's (the
    // condition holds for every split of the tile, so none takes a ticket).
    if (split == 0 && tid < BGMV_SHRINK_ROWS && j0 + tid < t_cols) t_row[j0 + tid] = 0.f;
    return;
  }
  const int rows = imin(BGMV_SHRINK_ROWS, rank - j0);
  const bf16_t* x_row = x + static_cast<long long>(b) * x_stride;
  // Rows past the rank re-read the last row inside it (always in bounds); their sums are
  // dropped at the end, so no load waits behind a branch.
  const bf16_t* a_row[BGMV_SHRINK_ROWS];
#pragma unroll
  for (int i = 0; i < BGMV_SHRINK_ROWS; ++i)
    a_row[i] = reinterpret_cast<const bf16_t*>(a_addr) +
               static_cast<long long>(j0 + imin(i, rows - 1)) * in_dim;
  const int k_begin = split * k_chunk;
  const int k_end = imin(in_dim, k_begin + k_chunk);
  constexpr int kStep = METRALE_THREADS * 8;

  float acc[BGMV_SHRINK_ROWS];
#pragma unroll
  for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) acc[i] = 0.f;

  // All 4 warps share the rank rows and split the K range: consecutive lanes read consecutive
  // 16-byte vectors, so each warp load is 512 contiguous bytes of one A row. A pass covers
  // BGMV_SHRINK_STEPS steps; a step past k_end re-reads the pass's first (valid) step and is
  // masked.
  for (int k = k_begin + tid * 8; k < k_end; k += BGMV_SHRINK_STEPS * kStep) {
    uint4 xv[BGMV_SHRINK_STEPS];
    uint4 av[BGMV_SHRINK_STEPS][BGMV_SHRINK_ROWS];
#pragma unroll
    for (int s = 0; s < BGMV_SHRINK_STEPS; ++s) {
      const int ks = k + s * kStep < k_end ? k + s * kStep : k;
      xv[s] = load16(x_row + ks);
#pragma unroll
      for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) av[s][i] = load16(a_row[i] + ks);
    }
#pragma unroll
    for (int s = 0; s < BGMV_SHRINK_STEPS; ++s) {
      const bool valid = k + s * kStep < k_end;
#pragma unroll
      for (int i = 0; i < BGMV_SHRINK_ROWS; ++i) {
        const float d = dot8(xv[s], av[s][i]);
        acc[i] += valid ? d : 0.f;
      }
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
  float sum = 0.f;
  __syncthreads();
  if (tid < BGMV_SHRINK_ROWS) {
#pragma unroll
    for (int w = 0; w < METRALE_WARPS; ++w) sum += partial[w][tid];
    if (tid >= rows) sum = 0.f;
  }
  if (split_k) {
    // The tile: (token, 4 rank rows, slice); each split's 4 partials side by side.
    const long long tiles = static_cast<long long>(gridDim.x) * gridDim.y * num_slices;
    const long long tile = (static_cast<long long>(slice) * gridDim.y + blockIdx.y) * gridDim.x + b;
    if (tid < BGMV_SHRINK_ROWS) __stcg(&partials[(split * tiles + tile) * BGMV_SHRINK_ROWS + tid], sum);
    __shared__ unsigned ticket;
    if (!split_last(tickets, tile, active, &ticket)) return;
    // The splits' partials in one round trip (splits x 4 <= the CTA's threads: one load a
    // thread), then summed in split order from shared memory.
    static_assert(METRALE_MAX_SPLITS * BGMV_SHRINK_ROWS <= METRALE_THREADS,
                  "one partial per thread");
    __shared__ float gathered[METRALE_MAX_SPLITS * BGMV_SHRINK_ROWS];
    const int z = tid / BGMV_SHRINK_ROWS;
    if (z < active)
      gathered[tid] = __ldcg(&partials[(z * tiles + tile) * BGMV_SHRINK_ROWS +
                                       tid % BGMV_SHRINK_ROWS]);
    __syncthreads();
    if (tid < BGMV_SHRINK_ROWS) {
      sum = 0.f;
      for (int s = 0; s < active; ++s) sum += gathered[s * BGMV_SHRINK_ROWS + tid];
    }
  }
  if (tid < BGMV_SHRINK_ROWS && j0 + tid < t_cols) t_row[j0 + tid] = sum;
}

// Sums each lane's BGMV_EXPAND_STEPS values over the groups of 2^kLog consecutive lanes, halving
// the values at every step: the lane whose offset bit is set sends its even values and keeps its
// odd ones, its partner the reverse. After the kLog steps lane j of a group holds the group's
// sums of values 2^kLog * i + j (or, past STEPS lanes, value j % STEPS): STEPS - 1 shuffles in
// all for 16 values over up to 16 lanes, where one butterfly per value would take 16 x kLog.
template <int kLog>
__device__ __forceinline__ void group_sums(float (&v)[BGMV_EXPAND_STEPS], int lane) {
#pragma unroll
  for (int step = 0; step < kLog; ++step) {
    const int offset = 1 << step;
    const bool upper = (lane & offset) != 0;
    const int held = BGMV_EXPAND_STEPS >> step;  // values each lane holds before this step
    if (held > 1) {
#pragma unroll
      for (int i = 0; i < BGMV_EXPAND_STEPS / 2; ++i) {
        if (i < held / 2) {
          const float send = upper ? v[2 * i] : v[2 * i + 1];
          const float keep = upper ? v[2 * i + 1] : v[2 * i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
      }
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
    }
  }
}

// One CTA's rows of B against the token's t: rows [0, rows) of b_rows (row pitch max_rank), each
// row's rank prefix of `vecs` 16-byte vectors read by a group of 2^kLog >= vecs consecutive lanes,
// lane j reading vector j (a lane past vecs re-reads the last vector, and its t values `tv` are
// zeros, so that no select or branch sits between a load and its product). A warp load
// thus covers 32 / 2^kLog consecutive rows' prefixes, consecutive lanes on consecutive 16-byte
// pieces (one contiguous run when the rank fills max_rank). A pass issues BGMV_EXPAND_STEPS
// such loads per thread, each a different row, before the first product (rows past the CTA's
// re-read its last and are never stored); the groups then sum their lanes' products
// (group_sums) and each row's sum lands in acc_s.
template <int kLog>
__device__ __forceinline__ void expand_rows(const bf16_t* __restrict__ b_rows, long long max_rank,
                                            int rows, int vecs, const float (&tv)[8],
                                            float* __restrict__ acc_s, int tid) {
  constexpr int kLanes = 1 << kLog;
  constexpr int kGroups = 32 / kLanes;                      // rows per warp load
  constexpr int kStride = METRALE_WARPS * kGroups;          // rows between a thread's loads
  constexpr int kPass = BGMV_EXPAND_STEPS * kStride;        // rows per pass of the CTA
  const int lane = tid & 31;
  const bf16_t* b_col = b_rows + imin(lane & (kLanes - 1), vecs - 1) * 8;
  const int first = (tid >> 5) * kGroups + (lane >> kLog);  // this thread's row in a pass
  for (int r0 = 0; r0 < rows; r0 += kPass) {
    uint4 w[BGMV_EXPAND_STEPS];
#pragma unroll
    for (int s = 0; s < BGMV_EXPAND_STEPS; ++s)
      w[s] = load16(b_col + static_cast<long long>(imin(r0 + first + s * kStride, rows - 1)) *
                                max_rank);
    float v[BGMV_EXPAND_STEPS];
#pragma unroll
    for (int s = 0; s < BGMV_EXPAND_STEPS; ++s) v[s] = dot8_f32(tv, w[s]);
    group_sums<kLog>(v, lane);
    // Lane j now holds the sums of its group's values kLanes * i + j; with more lanes than
    // values, lanes j and j + STEPS hold the same one and the first stores it.
    const int j = lane & (kLanes - 1);
#pragma unroll
    for (int i = 0; i < (kLanes < BGMV_EXPAND_STEPS ? BGMV_EXPAND_STEPS / kLanes : 1); ++i) {
      const int s = kLanes * i + j;
      const int row = r0 + first + s * kStride;
      if (s < BGMV_EXPAND_STEPS && row < rows) acc_s[row] = v[i];
    }
  }
}

template <typename OutT>
__device__ __forceinline__ void bgmv_expand_body(
    const float* __restrict__ t, const int* __restrict__ slots, const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
    const int* __restrict__ ranks, int max_loras, OutT* __restrict__ y, long long y_stride,
    int num_tokens, int out_dim, int max_rank, int t_cols, const int* __restrict__ slice_cols) {
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  // grid.z is the fused slice: its B table row, its t plane, and its columns of y
  // (slice_cols[z] up to slice_cols[z + 1]; null for one slice: all out_dim columns). The
  // column bounds are read beside the slot, not behind it.
  const int slice = blockIdx.z;
  const int col0 = slice_cols ? slice_cols[slice] : 0;
  const int slice_out = slice_cols ? slice_cols[slice + 1] - col0 : out_dim;
  t += static_cast<long long>(slice) * num_tokens * t_cols;
  const int slot = slots[b];
  const ptr_t b_addr = slot_address(b_table + static_cast<long long>(slice) * max_loras, slot,
                                    max_loras);
  const int listed = slot_rank(ranks, slot, max_loras);
  const int rank = b_addr ? imin(imin(listed, max_rank), t_cols) : 0;
  constexpr int kCtaRows = METRALE_THREADS * BGMV_EXPAND_ROWS;
  const int o0 = blockIdx.y * kCtaRows;
  // CTA-uniform, before any barrier: a skipped token's y stays bit-identical, and a narrower
  // fused slice's spare CTAs stop here.
  if (rank <= 0 || o0 >= slice_out) return;
  const float scale = scale_table[slot];
  const int vecs = (rank + 7) >> 3;
  const int rows = imin(kCtaRows, slice_out - o0);

  // This thread's y vector (8 consecutive outputs), issued first so that it lands while the B
  // passes run; slice widths are multiples of 8, so a thread's 8 outputs all exist or none.
  const int o = tid * BGMV_EXPAND_ROWS;
  OutT* y_out = y + static_cast<long long>(b) * y_stride + col0 + o0 + imin(o, rows - 8);
  float yv[BGMV_EXPAND_ROWS];
  load_y8(y_out, yv);
  // The 8 t values this thread's lane multiplies (its vector j of every row: j is fixed by the
  // lane), zero past the rank, so that the last vector's padding columns meet zeros, and zero
  // for a lane past the rank's vectors; min(j, vecs - 1) * 8 + 8 <= t_cols keeps the read
  // inside the t row.
  const int lanes_log = vecs <= 1 ? 0 : vecs <= 2 ? 1 : vecs <= 4 ? 2 : vecs <= 8 ? 3
                        : vecs <= 16 ? 4 : 5;
  const int j = (tid & 31) & ((1 << lanes_log) - 1);
  const int tj = imin(j, vecs - 1) * 8;
  const float* t_row = t + static_cast<long long>(b) * t_cols + tj;
  const uint4 t_lo = load16(t_row);
  const uint4 t_hi = load16(t_row + 4);
  const unsigned tu[8] = {t_lo.x, t_lo.y, t_lo.z, t_lo.w, t_hi.x, t_hi.y, t_hi.z, t_hi.w};
  float tv[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) tv[e] = j < vecs && tj + e < rank ? __uint_as_float(tu[e]) : 0.f;

  __shared__ __align__(16) float acc_s[kCtaRows];
  const bf16_t* b_rows = reinterpret_cast<const bf16_t*>(b_addr) + static_cast<long long>(o0) * max_rank;
  switch (lanes_log) {
    case 0: expand_rows<0>(b_rows, max_rank, rows, vecs, tv, acc_s, tid); break;
    case 1: expand_rows<1>(b_rows, max_rank, rows, vecs, tv, acc_s, tid); break;
    case 2: expand_rows<2>(b_rows, max_rank, rows, vecs, tv, acc_s, tid); break;
    case 3: expand_rows<3>(b_rows, max_rank, rows, vecs, tv, acc_s, tid); break;
    case 4: expand_rows<4>(b_rows, max_rank, rows, vecs, tv, acc_s, tid); break;
    default: expand_rows<5>(b_rows, max_rank, rows, vecs, tv, acc_s, tid); break;
  }
  __syncthreads();
  if (o >= rows) return;
#pragma unroll
  for (int i = 0; i < BGMV_EXPAND_ROWS; ++i) yv[i] += scale * acc_s[o + i];
  store_y8(y_out, yv);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, BGMV_EXPAND_MIN_CTAS)
bgmv_expand_bf16(const float* __restrict__ t, const int* __restrict__ slots,
                 const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
                 const int* __restrict__ ranks, int max_loras, bf16_t* __restrict__ y,
                 long long y_stride, int num_tokens, int out_dim, int max_rank, int t_cols,
                 const int* __restrict__ slice_cols) {
  bgmv_expand_body(t, slots, b_table, scale_table, ranks, max_loras, y, y_stride,
                   num_tokens, out_dim, max_rank, t_cols, slice_cols);
}

extern "C" __global__ void __launch_bounds__(METRALE_THREADS, BGMV_EXPAND_MIN_CTAS)
bgmv_expand_f32(const float* __restrict__ t, const int* __restrict__ slots,
                const ptr_t* __restrict__ b_table, const float* __restrict__ scale_table,
                const int* __restrict__ ranks, int max_loras, float* __restrict__ y,
                long long y_stride, int num_tokens, int out_dim, int max_rank, int t_cols,
                const int* __restrict__ slice_cols) {
  bgmv_expand_body(t, slots, b_table, scale_table, ranks, max_loras, y, y_stride,
                   num_tokens, out_dim, max_rank, t_cols, slice_cols);
}
