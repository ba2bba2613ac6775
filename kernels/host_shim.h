// host_shim.h: runs the kernels in kernels/*.cu on a CPU, unchanged, for the host harness
// (metrale_cli/ops/host_harness.py, whose build_command force-includes it ahead of the sources).
//
// Model: a launch runs its CTAs one after another; the threads of a CTA are cooperative fibers
// (ucontext) that switch only at barriers, so __syncthreads, warp shuffles and the warp-wide
// mma emulation have their CUDA meaning: a barrier releases when every live thread of its scope
// (CTA or warp) has arrived. Because CTAs never overlap, `__shared__` can be a function-static
// variable. A barrier that can never release (threads of one warp or CTA waiting at different
// barriers: divergent __syncthreads or shuffles, undefined on a GPU) fails the launch with a
// message instead of hanging.
//
// The CUDA subset supported, and therefore the subset the kernels stay within:
//   __global__ __device__ __host__ __forceinline__ __launch_bounds__ __align__ __restrict__
//   static __shared__ arrays (no `extern __shared__`), threadIdx blockIdx blockDim gridDim,
//   uint3 dim3 uint4 float4 float2, __syncthreads, __shfl_xor_sync / __shfl_sync on types of up
//   to 8 bytes, __uint_as_float, __float_as_uint, atomicAdd on float and unsigned, __stcg /
//   __ldcg on float and __threadfence (with the store visibility below), and mma_bf16_16816,
//   cp_async16 / cp_async_commit / cp_async_wait (lora_common.cuh).
// cp.async keeps its PTX meaning: a copy is issued into the thread's open group, commit closes
// the group, and wait<N> completes every committed group but the N newest. The destination is
// undefined from issue until the wait that completes it, and the shim makes it so: it is filled
// with NaN bytes (0xff) at issue and written only at that wait. A kernel that reads a stage
// before waiting for it, or overwrites one that another warp still reads, gets NaN.
// Not supported: other atomics, cooperative groups, other inline PTX, CUDA headers.
#pragma once
#define METRALE_HOST_SHIM 1

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One CTA runs at a time, so a function-static array is exactly "one copy per CTA".
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

namespace metrale_shim {

// Each fiber's stack; kernels keep only small register-like locals.
constexpr size_t kStackBytes = 128 * 1024;
// 8 words per lane per exchange: the mma emulation's 4 + 2 fragment registers, or one shuffle.
constexpr int kExchangeWords = 8;

enum class Wait { kNone, kBlock, kWarp, kDone };

// One cp.async in flight: `bytes` of `src` land at `dst`, zeros after them up to `size`.
struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;
  int size;
  unsigned group;
};

struct Fiber {
  ucontext_t context;
  uint3 tid;
  int warp;
  int lane;
  Wait wait;
  // Collective calls alternate between two exchange buffers: a thread that writes buffer p for
  // call n + 1 has passed call n's barrier, so every thread has finished reading call n - 1.
  unsigned phase;
  // This thread's cp.async copies not yet completed, and the groups committed so far (the
  // open group is number `committed`).
  std::vector<AsyncCopy> copies;
  unsigned committed;
};

struct Launch {
  dim3 grid, block;
  uint3 block_idx;
  std::function<void()> body;
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  ucontext_t scheduler;
  int current = 0;
  int block_live = 0, block_arrived = 0;
  std::vector<int> warp_live, warp_arrived;
  std::vector<uint32_t> exchange;  // [2][warps][32][kExchangeWords]
  int num_warps = 0;
};

inline Launch* g_launch = nullptr;

inline Fiber& self() { return g_launch->fibers[g_launch->current]; }

inline uint32_t* exchange_buffer(const Fiber& f) {
  Launch& L = *g_launch;
  return L.exchange.data() +
         (static_cast<size_t>(f.phase) * L.num_warps + f.warp) * 32 * kExchangeWords;
}

inline void wait_at(Wait kind) {
  Launch& L = *g_launch;
  Fiber& f = self();
  f.wait = kind;
  if (kind == Wait::kBlock) {
    ++L.block_arrived;
  } else {
    ++L.warp_arrived[f.warp];
  }
  swapcontext(&f.context, &L.scheduler);
}

inline void fiber_entry() {
  Launch& L = *g_launch;
  L.body();
  Fiber& f = self();
  f.wait = Wait::kDone;
  --L.block_live;
  --L.warp_live[f.warp];
  // Returning resumes uc_link, the scheduler.
}

// Runs one CTA to completion; false (with a message) on a barrier that can never release.
inline bool run_block(Launch& L, std::string& error) {
  const int n = static_cast<int>(L.fibers.size());
  L.block_live = n;
  L.block_arrived = 0;
  for (int w = 0; w < L.num_warps; ++w) {
    L.warp_live[w] = 0;
    L.warp_arrived[w] = 0;
  }
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    f.wait = Wait::kNone;
    f.phase = 0;
    f.copies.clear();
    f.committed = 0;
    ++L.warp_live[f.warp];
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = L.stacks + static_cast<size_t>(i) * kStackBytes;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &L.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  while (L.block_live > 0) {
    bool progressed = false;
    for (int i = 0; i < n; ++i) {
      if (L.fibers[i].wait != Wait::kNone) continue;
      L.current = i;
      swapcontext(&L.scheduler, &L.fibers[i].context);
      progressed = true;
    }
    if (L.block_arrived > 0 && L.block_arrived == L.block_live) {
      for (Fiber& f : L.fibers)
        if (f.wait == Wait::kBlock) f.wait = Wait::kNone;
      L.block_arrived = 0;
      progressed = true;
    }
    for (int w = 0; w < L.num_warps; ++w) {
      if (L.warp_arrived[w] > 0 && L.warp_arrived[w] == L.warp_live[w]) {
        for (Fiber& f : L.fibers)
          if (f.warp == w && f.wait == Wait::kWarp) f.wait = Wait::kNone;
        L.warp_arrived[w] = 0;
        progressed = true;
      }
    }
    if (!progressed) {
      char message[160];
      std::snprintf(message, sizeof message,
                    "deadlock in block (%u, %u, %u): threads wait at barriers that cannot release "
                    "(divergent __syncthreads or warp collective)",
                    L.block_idx.x, L.block_idx.y, L.block_idx.z);
      error = message;
      return false;
    }
  }
  return true;
}

struct PendingStore {
  float* address;
  float value;
  unsigned block;
  int thread;
  bool late;
};
inline std::vector<PendingStore> g_pending;
inline unsigned block_serial() {
  const Launch& L = *g_launch;
  return (L.block_idx.z * L.grid.y + L.block_idx.y) * L.grid.x + L.block_idx.x;
}
// At the end of a launch every store has landed, in program order.
inline void land_pending() {
  for (const PendingStore& p : g_pending) *p.address = p.value;
  g_pending.clear();
}

// Runs `body` (a kernel call with bound arguments) over the grid; 0 on success, else 1 with a
// message in `error` (truncated to error_len).
inline int launch(dim3 grid, dim3 block, std::function<void()> body, char* error, int error_len) {
  Launch L;
  L.grid = grid;
  L.block = block;
  L.body = std::move(body);
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) {
    std::snprintf(error, error_len, "invalid block size %d", n);
    return 1;
  }
  L.num_warps = (n + 31) / 32;
  L.fibers.resize(n);
  L.warp_live.resize(L.num_warps);
  L.warp_arrived.resize(L.num_warps);
  L.exchange.assign(static_cast<size_t>(2) * L.num_warps * 32 * kExchangeWords, 0u);
  L.stacks = static_cast<char*>(std::aligned_alloc(64, static_cast<size_t>(n) * kStackBytes));
  if (L.stacks == nullptr) {
    std::snprintf(error, error_len, "out of memory for %d fiber stacks", n);
    return 1;
  }
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    // Linear thread index x-fastest, as CUDA numbers lanes into warps.
    f.tid = uint3{static_cast<unsigned>(i) % block.x, static_cast<unsigned>(i) / block.x % block.y,
                  static_cast<unsigned>(i) / (block.x * block.y)};
    f.warp = i / 32;
    f.lane = i % 32;
  }
  Launch* previous = g_launch;
  g_launch = &L;
  std::string message;
  bool ok = true;
  for (unsigned z = 0; z < grid.z && ok; ++z)
    for (unsigned y = 0; y < grid.y && ok; ++y)
      for (unsigned x = 0; x < grid.x && ok; ++x) {
        L.block_idx = uint3{x, y, z};
        ok = run_block(L, message);
      }
  land_pending();
  g_launch = previous;
  std::free(L.stacks);
  if (!ok) {
    std::snprintf(error, error_len, "%s", message.c_str());
    return 1;
  }
  return 0;
}

template <typename T>
inline T shuffle_from(T value, int src_lane) {
  static_assert(sizeof(T) <= 8, "the shim shuffles values of up to 8 bytes");
  Fiber& f = self();
  uint32_t* buffer = exchange_buffer(f);
  std::memcpy(buffer + f.lane * kExchangeWords, &value, sizeof(T));
  wait_at(Wait::kWarp);
  const int warp_size = static_cast<int>(g_launch->fibers.size()) - f.warp * 32;
  if (src_lane < 0 || src_lane >= 32 || src_lane >= warp_size) src_lane = f.lane;
  T result;
  std::memcpy(&result, buffer + src_lane * kExchangeWords, sizeof(T));
  f.phase ^= 1u;
  return result;
}

}  // namespace metrale_shim

#define threadIdx (::metrale_shim::self().tid)
#define blockIdx (::metrale_shim::g_launch->block_idx)
#define blockDim (::metrale_shim::g_launch->block)
#define gridDim (::metrale_shim::g_launch->grid)

inline void __syncthreads() { ::metrale_shim::wait_at(::metrale_shim::Wait::kBlock); }

// CTAs run one at a time and a fiber switches only at a barrier, so a read-modify-write is
// never interleaved with another thread's: the GPU's atomicity, and its result up to the order
// of the additions (which the shim fixes: CTAs in grid order, threads in index order).
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

// Split-K's serial reduction (lora_common.cuh, split_last): a store to another CTA's data
// (__stcg) stays with the storing thread until its __threadfence(), and reads (__ldcg) see
// memory, plus the stores of their own CTA. A store still unfenced when its CTA takes a ticket
// (atomicAdd on unsigned) may, on a GPU, land after the ticket and after any read that the
// ticket lets through, so the shim lands it only at the end of the launch: a kernel that
// reduces before its partials are fenced reads stale memory here, as it may on a GPU.
inline void __stcg(float* address, float value) {
  ::metrale_shim::g_pending.push_back(
      {address, value, ::metrale_shim::block_serial(), ::metrale_shim::g_launch->current, false});
}
inline float __ldcg(const float* address) {
  const unsigned block = ::metrale_shim::block_serial();
  for (auto p = ::metrale_shim::g_pending.rbegin(); p != ::metrale_shim::g_pending.rend(); ++p)
    if (p->address == address && p->block == block) return p->value;
  return *address;
}
inline void __threadfence() {
  auto& pending = ::metrale_shim::g_pending;
  const unsigned block = ::metrale_shim::block_serial();
  const int thread = ::metrale_shim::g_launch->current;
  size_t kept = 0;
  for (const ::metrale_shim::PendingStore& p : pending) {
    if (p.block == block && p.thread == thread && !p.late) {
      *p.address = p.value;
    } else {
      pending[kept++] = p;
    }
  }
  pending.resize(kept);
}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  const unsigned block = ::metrale_shim::block_serial();
  for (::metrale_shim::PendingStore& p : ::metrale_shim::g_pending)
    if (p.block == block) p.late = true;
  const unsigned old = *address;
  *address = old + value;
  return old;
}

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask, int width = 32) {
  const int lane = ::metrale_shim::self().lane;
  int src = lane ^ lane_mask;
  if (src / width != lane / width) src = lane;
  return ::metrale_shim::shuffle_from(value, src);
}

template <typename T>
inline T __shfl_sync(unsigned /*mask*/, T value, int src_lane, int width = 32) {
  const int lane = ::metrale_shim::self().lane;
  return ::metrale_shim::shuffle_from(value, (lane / width) * width + src_lane % width);
}

// Warp-collective emulation of mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 (d += a * b) with the
// PTX fragment layout documented in lora_common.cuh: each lane publishes its fragment registers,
// then computes its own four outputs from the whole warp's A and B.
inline void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  using namespace ::metrale_shim;
  Fiber& f = self();
  uint32_t* buffer = exchange_buffer(f);
  uint32_t* mine = buffer + f.lane * kExchangeWords;
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  wait_at(Wait::kWarp);
  auto half = [](uint32_t word, int k) {
    return __uint_as_float((k & 1) ? (word & 0xffff0000u) : (word << 16));
  };
  auto a_at = [&](int row, int k) {
    const int lane = (row & 7) * 4 + ((k & 7) >> 1);
    return half(buffer[lane * kExchangeWords + (row >> 3) + ((k >> 3) << 1)], k);
  };
  auto b_at = [&](int k, int col) {
    const int lane = col * 4 + ((k & 7) >> 1);
    return half(buffer[lane * kExchangeWords + 4 + (k >> 3)], k);
  };
  const int g = f.lane >> 2;
  const int q = f.lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >> 1) * 8;
    const int col = 2 * q + (e & 1);
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
    d[e] += sum;
  }
  f.phase ^= 1u;
}

// cp.async.cg.shared.global with a source size (lora_common.cuh documents the GPU side): the
// copy goes into the open group; its 16 destination bytes hold NaN until a wait completes it.
inline void cp_async16(void* dst, const void* src, int src_bytes) {
  using namespace ::metrale_shim;
  Fiber& f = self();
  std::memset(dst, 0xff, 16);
  f.copies.push_back(AsyncCopy{dst, src, src_bytes, 16, f.committed});
}

inline void cp_async_commit() { ++::metrale_shim::self().committed; }

// Completes every committed group but the `pending` newest; copies issued after the last commit
// are in no committed group and stay in flight, as in PTX.
template <int pending>
inline void cp_async_wait() {
  using namespace ::metrale_shim;
  Fiber& f = self();
  std::vector<AsyncCopy> left;
  for (const AsyncCopy& c : f.copies) {
    if (c.group + pending < f.committed) {
      std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
      std::memset(static_cast<char*>(c.dst) + c.bytes, 0, static_cast<size_t>(c.size - c.bytes));
    } else {
      left.push_back(c);
    }
  }
  f.copies.swap(left);
}
