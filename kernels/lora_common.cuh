// lora_common.cuh: helpers shared by bgmv.cu and sgmv.cu.
//
// Everything here stays inside the CUDA subset that kernels/host_shim.h can run on a CPU (see
// kernels/README.md): no CUDA headers at all, so NVRTC (CuPy RawModule) needs no include path
// and the host build needs nothing the shim does not define.
//
// BF16 is carried as its raw 16 bits (bf16_t) rather than __nv_bfloat16: CuPy has no bf16 dtype
// (its arrays are uint16 views), NVRTC then needs no cuda_bf16.h, and the conversions below are
// bit-exact on the GPU and in the host harness alike.
#pragma once

typedef unsigned short bf16_t;     // raw BF16 bits
typedef unsigned long long ptr_t;  // a device (or, in the host harness, host) address; 0 = none

#include "lora_config.h"

#define METRALE_WARPS (METRALE_THREADS / 32)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}

// Round to nearest even, as torch's float -> bfloat16 cast does; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

// A 32-bit word holds two BF16 values, the lower-indexed one in the low half (little endian).
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  return static_cast<unsigned>(f32_to_bf16(lo)) | (static_cast<unsigned>(f32_to_bf16(hi)) << 16);
}

// 16-byte vector loads of data that no thread writes during the kernel (x, weights, t): every
// kernel streams them as 8 BF16 per load, the widest single global access and what it takes to
// reach HBM bandwidth. On the GPU it is `ld.global.nc.v4` (LDG.E.128.CONSTANT): the weights'
// addresses come from u64 tables, and a plain dereference of such an integer-made pointer would
// compile to a generic LD.E.128 instead of a global load through the read-only path.
#ifdef METRALE_HOST_SHIM
__device__ __forceinline__ uint4 load16(const void* p) {
  ::metrale_shim::check_access(p, 16, "load16");  // bounds-checked (host_shim.h)
  return *reinterpret_cast<const uint4*>(p);
}
#else
__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
#endif

__device__ __forceinline__ uint4 zero16() {
  uint4 z;
  z.x = z.y = z.z = z.w = 0u;
  return z;
}

// The loaded vector where `keep`, else zeros: how the kernels mask a load whose address was
// clamped into bounds. The load itself is unconditional, so ptxas can issue every load of a
// pass back to back instead of branching around each one.
__device__ __forceinline__ uint4 keep16(bool keep, uint4 v) {
  uint4 r;
  r.x = keep ? v.x : 0u;
  r.y = keep ? v.y : 0u;
  r.z = keep ? v.z : 0u;
  r.w = keep ? v.w : 0u;
  return r;
}

__device__ __forceinline__ float dot2(unsigned a, unsigned b) {
  return bf16_lo(a) * bf16_lo(b) + bf16_hi(a) * bf16_hi(b);
}

// Dot product of 8 BF16 pairs, accumulated in F32.
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  return (dot2(a.x, b.x) + dot2(a.y, b.y)) + (dot2(a.z, b.z) + dot2(a.w, b.w));
}

// Dot product of 8 F32 values (from shared memory) with 8 BF16 values.
__device__ __forceinline__ float dot8_f32(const float* t, uint4 w) {
  return (t[0] * bf16_lo(w.x) + t[1] * bf16_hi(w.x)) + (t[2] * bf16_lo(w.y) + t[3] * bf16_hi(w.y)) +
         (t[4] * bf16_lo(w.z) + t[5] * bf16_hi(w.z)) + (t[6] * bf16_lo(w.w) + t[7] * bf16_hi(w.w));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The slot's weight address, or 0 when the token has no adapter (-1), the slot id is out of the
// table, or the slot does not adapt this (layer, module) entry.
__device__ __forceinline__ ptr_t slot_address(const ptr_t* table, int slot, int max_loras) {
  return (slot >= 0 && slot < max_loras) ? table[slot] : 0ull;
}

// Split-K's serial reduction (the "semaphore" design), without atomics on t and without a
// zeroed t: every K split of an output tile stores its partial tile into `partials` (at L2,
// st.global.cg), fences, and takes a ticket from the tile's counter; the CTA drawing the last
// ticket reads the partials in split order (so the sum, and its last bits, is the same in
// every run), writes t itself and resets the counter to 0. The counters are thus zero between
// launches with no memset: they are zeroed once, when the workspace is allocated. Returns true
// in the last CTA (after which its reads of the partials see every split's). CTA-uniform:
// every thread of the CTA calls it, after its own partial stores. `ticket` is a shared word
// the CTA lends (the SGMV shrink's pipeline stages fill its static shared memory, so it lends
// a word of a stage, done with by then).
__device__ __forceinline__ bool split_last(unsigned* tickets, long long tile, int splits,
                                           unsigned* ticket) {
  __threadfence();  // this thread's partial stores are visible device-wide before the ticket
  __syncthreads();  // ... and every thread's, before thread 0 takes it
  if (threadIdx.x == 0) *ticket = atomicAdd(&tickets[tile], 1u);
  __syncthreads();
  const bool last = *ticket == static_cast<unsigned>(splits - 1);
  if (last) {
    if (threadIdx.x == 0) tickets[tile] = 0u;  // every split has drawn: no one reads it again
    __threadfence();                            // the partials' reads come after the ticket
  }
  return last;
}

// The slot's rank, 0 for a slot id outside the table. Read beside the slot's table entry, not
// behind it: `table[slot] ? ranks[slot] : 0` would make the rank wait for the address, one
// more dependent round trip before the weight stream.
__device__ __forceinline__ int slot_rank(const int* ranks, int slot, int max_loras) {
  return (slot >= 0 && slot < max_loras) ? ranks[slot] : 0;
}

// y element load / store for both output dtypes (BF16 bits or F32).
__device__ __forceinline__ float load_out(const bf16_t* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ float load_out(const float* p) { return *p; }
__device__ __forceinline__ void store_out(bf16_t* p, float v) { *p = f32_to_bf16(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// y vector (8 consecutive outputs) load / store for both output dtypes.
// y is read and written by the same thread, so it takes plain (coherent) loads, not load16.
__device__ __forceinline__ void load_y8(const bf16_t* p, float (&v)[8]) {
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = bf16_lo(u[i]);
    v[2 * i + 1] = bf16_hi(u[i]);
  }
}
__device__ __forceinline__ void load_y8(const float* p, float (&v)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(p)[0];
  const float4 hi = reinterpret_cast<const float4*>(p)[1];
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
  v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}
__device__ __forceinline__ void store_y8(bf16_t* p, const float (&v)[8]) {
  uint4 w;
  w.x = pack_bf16x2(v[0], v[1]);
  w.y = pack_bf16x2(v[2], v[3]);
  w.z = pack_bf16x2(v[4], v[5]);
  w.w = pack_bf16x2(v[6], v[7]);
  *reinterpret_cast<uint4*>(p) = w;
}
__device__ __forceinline__ void store_y8(float* p, const float (&v)[8]) {
  float4 lo, hi;
  lo.x = v[0], lo.y = v[1], lo.z = v[2], lo.w = v[3];
  hi.x = v[4], hi.y = v[5], hi.z = v[6], hi.w = v[7];
  reinterpret_cast<float4*>(p)[0] = lo;
  reinterpret_cast<float4*>(p)[1] = hi;
}

// d += a * b for one warp: a 16x16 BF16 A fragment (row major), a 16x8 BF16 B fragment (column
// major) and a 16x8 F32 accumulator, in the register layout of PTX mma.m16n8k16 (PTX ISA,
// "Matrix Fragments for mma.m16n8k16"); with g = lane / 4 and q = lane % 4:
//   a[0]: A[g][2q..2q+1]    a[1]: A[g+8][2q..2q+1]    a[2]: A[g][2q+8..]    a[3]: A[g+8][2q+8..]
//   b[0]: B[2q..2q+1][g]    b[1]: B[2q+8..2q+9][g]
//   d[0..1]: D[g][2q..2q+1] d[2..3]: D[g+8][2q..2q+1]
// The host shim supplies a warp-collective emulation with this exact layout, so the harness runs
// the same fragment indexing that the tensor cores see.
#ifndef METRALE_HOST_SHIM
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4],
                                               const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

__device__ __forceinline__ unsigned lds32(const bf16_t* p) {
  return *reinterpret_cast<const unsigned*>(p);
}

// Asynchronous global -> shared copies (sm_80's cp.async, LDGSTS in SASS), what the SGMV
// pipelines stream through: a copy needs no register, so a thread can have several K tiles in
// flight while the tensor cores work on an earlier one, and no conversion can sit between the
// loads (NVRTC interleaved register loads with their conversions). cp_async16 copies the first
// `src_bytes` (0..16) of 16 bytes at `src` into shared `dst` and zero-fills the rest: how the
// SGMV kernels mask rows outside a chunk and columns past the rank or K without moving them
// (src must still be a valid, 16-byte aligned address). It goes through L2 only (.cg): a tile
// is read once per CTA. cp_async_commit closes the thread's open group of copies;
// cp_async_wait<N> waits until at most N committed groups are in flight. The copies are
// visible to other threads after the wait and a __syncthreads. The host shim emulates all three
// with these semantics (host_shim.h).
#ifndef METRALE_HOST_SHIM
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  unsigned shared_address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
      : "=r"(shared_address)
      : "l"(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}
#endif
