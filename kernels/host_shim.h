// host_shim.h: runs the kernels in kernels/*.cu on a CPU, unchanged, for the host harness
// (metrale_cli/ops/host_harness.py, whose build_command force-includes it ahead of the sources).
//
// Model: a launch runs its CTAs one after another; the threads of a CTA are cooperative fibers
// (ucontext) that switch only at barriers, so __syncthreads, warp shuffles and the warp-wide
// mma emulation have their CUDA meaning. The shim is meant to be as strict as the hardware, so
// that a kernel that may fail on a GPU fails here every time:
// - Warps run one at a time: a warp runs (its collectives releasing within the warp) until each
//   of its live threads waits at a __syncthreads or has exited, then the next warp runs; the
//   warp order is forward, reversed or rotated from CTA to CTA. Nothing orders two warps but a
//   __syncthreads, so a missing one shows.
// - A warp collective (shuffle, mma) releases when every lane named in its mask has arrived at
//   the same collective (kind and call site) with the same mask; a lane of the mask that has
//   exited, a lane at a different collective or mask, a shuffle from a lane outside the mask,
//   or a __syncthreads reached at different call sites fails the launch (all undefined on a
//   GPU), as does a barrier that can never release (a deadlock), instead of hanging.
// - Because CTAs never overlap, `__shared__` can be a function-static variable; every one sits
//   in one linker section, filled with NaN bytes (0xff) at each CTA's start, so shared memory
//   that is read before it is written reads NaN rather than zeros or the last CTA's data.
//
// The CUDA subset supported, and therefore the subset the kernels stay within:
//   __global__ __device__ __host__ __forceinline__ __launch_bounds__ __align__ __restrict__
//   static __shared__ arrays (no `extern __shared__`), threadIdx blockIdx blockDim gridDim,
//   uint3 dim3 uint4 float4 float2, __syncthreads, __shfl_xor_sync / __shfl_sync on types of up
//   to 8 bytes, __uint_as_float, __float_as_uint, atomicAdd on float and unsigned, __stcg /
//   __ldcg on float and __threadfence (with the store visibility below), and mma_bf16_16816,
//   cp_async16 / cp_async_commit / cp_async_wait (lora_common.cuh).
// cp.async keeps its PTX meaning: a copy is issued into the thread's open group, commit closes
// the group, and wait<N> completes every committed group but the N newest. The source bytes
// are read at issue (the hardware may read them any time until the wait). The destination is
// undefined from issue until the wait that completes it, and the shim makes it so: it is filled
// with NaN bytes (0xff) at issue and written only at that wait. A kernel that reads a stage
// before waiting for it, or overwrites one that another warp still reads, gets NaN. A copy
// whose source or destination is not 16-byte aligned, or whose source size is outside 0..16,
// fails the launch.
// Not supported: other atomics, cooperative groups, other inline PTX, CUDA headers.
#pragma once
#define METRALE_HOST_SHIM 1

#include <ucontext.h>

#include <algorithm>
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
// One CTA runs at a time, so a function-static array is exactly "one copy per CTA". The
// section gathers them all, so that each CTA's start can poison them in one fill (the linker
// defines __start_/__stop_ symbols around a section whose name is an identifier).
#define __shared__ static __attribute__((section("metrale_shared")))

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

// Every __shared__ array of the kernels (one section; the build has at least one).
extern "C" char __start_metrale_shared[];
extern "C" char __stop_metrale_shared[];

namespace metrale_shim {

// Each fiber's stack; kernels keep only small register-like locals.
constexpr size_t kStackBytes = 128 * 1024;
// 8 words per lane per exchange: the mma emulation's 4 + 2 fragment registers, or one shuffle.
constexpr int kExchangeWords = 8;
constexpr unsigned kFullMask = 0xffffffffu;

enum class Wait { kNone, kBlock, kWarp, kDone };
enum class Collective { kShuffleXor, kShuffleIdx, kMma };

inline const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kShuffleXor: return "__shfl_xor_sync";
    case Collective::kShuffleIdx: return "__shfl_sync";
    case Collective::kMma: return "mma_bf16_16816";
  }
  return "?";
}

// One cp.async in flight: its source bytes (read at issue), landing at `dst` with zeros after
// them up to 16 bytes.
struct AsyncCopy {
  void* dst;
  unsigned char bytes[16];
  int src_bytes;
  unsigned group;
};

// Where a thread waits: a barrier's kind, call site and (warp collectives) mask.
struct Site {
  Collective kind = Collective::kShuffleXor;
  unsigned mask = 0;
  const char* file = "";
  int line = 0;
  bool operator==(const Site& o) const {
    // Equal __builtin_FILE literals are one string in the one translation unit: a pointer
    // compare is the common case.
    return kind == o.kind && mask == o.mask && line == o.line &&
           (file == o.file || std::strcmp(file, o.file) == 0);
  }
};

struct Fiber {
  ucontext_t context;
  uint3 tid;
  int warp;
  int lane;
  Wait wait;
  Site site;
  // The lowest lane of the collective this lane was last released from: its snapshot of the
  // lanes' published values is the one the lane reads.
  int leader;
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
  int block_live = 0;
  int num_warps = 0;
  // Each lane publishes its values here before a collective ([warps][32][kExchangeWords]); at
  // the release they are copied into the snapshot of the collective's lowest lane
  // ([warps][32 leaders][32][kExchangeWords]), which the released lanes read, so a lane that
  // runs on and publishes for its next collective never overwrites what another still reads.
  std::vector<uint32_t> published, snapshots;
  // Set by a fiber that found the launch invalid (cp.async misuse, a shuffle from outside its
  // mask); the scheduler then abandons the launch.
  std::string error;
};

static Launch* g_launch = nullptr;

inline Fiber& self() { return g_launch->fibers[g_launch->current]; }

inline uint32_t* published_slot(const Fiber& f) {
  return g_launch->published.data() +
         (static_cast<size_t>(f.warp) * 32 + f.lane) * kExchangeWords;
}

inline uint32_t* snapshot(const Fiber& f) {
  return g_launch->snapshots.data() +
         (static_cast<size_t>(f.warp) * 32 + f.leader) * 32 * kExchangeWords;
}

inline std::string block_name(const Launch& L) {
  char name[64];
  std::snprintf(name, sizeof name, "block (%u, %u, %u)", L.block_idx.x, L.block_idx.y,
                L.block_idx.z);
  return name;
}

// Fails the launch from inside a thread: the scheduler never resumes it.
[[noreturn]] inline void fail(const std::string& message) {
  Launch& L = *g_launch;
  Fiber& f = self();
  L.error = block_name(L) + " thread " + std::to_string(f.warp * 32 + f.lane) + ": " + message;
  f.wait = Wait::kDone;
  swapcontext(&f.context, &L.scheduler);
  std::abort();  // unreachable: a failed launch is abandoned
}

inline void wait_at(Wait kind, const Site& site) {
  Launch& L = *g_launch;
  Fiber& f = self();
  f.wait = kind;
  f.site = site;
  swapcontext(&f.context, &L.scheduler);
}

inline void fiber_entry() {
  Launch& L = *g_launch;
  L.body();
  Fiber& f = self();
  f.wait = Wait::kDone;
  --L.block_live;
  // Returning resumes uc_link, the scheduler.
}

inline std::string where(const Site& s) {
  return std::string(collective_name(s.kind)) + " at " + s.file + ":" + std::to_string(s.line);
}

// Releases warp w's collectives whose lanes have all arrived; the number released, or -1 with
// a message on a collective that is undefined on a GPU.
inline int release_collectives(Launch& L, int w, std::string& error) {
  const int n = static_cast<int>(L.fibers.size());
  const int first = w * 32;
  int released = 0;
  for (int i = first; i < std::min(n, first + 32); ++i) {
    Fiber& f = L.fibers[i];
    if (f.wait != Wait::kWarp) continue;
    const unsigned mask = f.site.mask;
    char lanes[96];
    if (!((mask >> f.lane) & 1u)) {
      std::snprintf(lanes, sizeof lanes, "lane %d calls a collective whose mask 0x%08x omits it",
                    f.lane, mask);
      error = block_name(L) + " warp " + std::to_string(w) + ": " + lanes + " (" +
              where(f.site) + ")";
      return -1;
    }
    bool ready = true;
    for (int lane = 0; lane < 32; ++lane) {
      if (!((mask >> lane) & 1u)) continue;
      const Fiber* g = first + lane < n ? &L.fibers[first + lane] : nullptr;
      if (g == nullptr || g->wait == Wait::kDone) {
        std::snprintf(lanes, sizeof lanes, "lane %d, named in the mask 0x%08x, has exited",
                      lane, mask);
        error = block_name(L) + " warp " + std::to_string(w) + ": " + lanes + " (" +
                where(f.site) + " by lane " + std::to_string(f.lane) + ")";
        return -1;
      }
      if (g->wait == Wait::kWarp && !(g->site == f.site)) {
        std::snprintf(lanes, sizeof lanes, "lanes %d and %d meet at different collectives",
                      f.lane, lane);
        char masks[48];
        std::snprintf(masks, sizeof masks, " (masks 0x%08x and 0x%08x)", mask, g->site.mask);
        error = block_name(L) + " warp " + std::to_string(w) + ": " + lanes + ": " +
                where(f.site) + " and " + where(g->site) + masks;
        return -1;
      }
      if (g->wait != Wait::kWarp) ready = false;  // at a __syncthreads: a deadlock, unless
                                                  // another group releases first
    }
    if (!ready) continue;
    uint32_t* out = L.snapshots.data() + (static_cast<size_t>(w) * 32 + f.lane) * 32 * kExchangeWords;
    const uint32_t* in = L.published.data() + static_cast<size_t>(w) * 32 * kExchangeWords;
    for (int lane = 0; lane < 32; ++lane) {
      if (!((mask >> lane) & 1u)) continue;
      std::memcpy(out + lane * kExchangeWords, in + lane * kExchangeWords,
                  kExchangeWords * sizeof(uint32_t));
      Fiber& g = L.fibers[first + lane];
      g.leader = f.lane;
      g.wait = Wait::kNone;
    }
    ++released;
  }
  return released;
}

// Runs warp w until each of its live threads waits at a __syncthreads or has exited; false
// with a message on an invalid collective or one that can never release.
inline bool run_warp(Launch& L, int w, std::string& error) {
  const int n = static_cast<int>(L.fibers.size());
  const int first = w * 32, last = std::min(n, first + 32);
  for (;;) {
    for (int i = first; i < last; ++i) {
      if (L.fibers[i].wait != Wait::kNone) continue;
      L.current = i;
      swapcontext(&L.scheduler, &L.fibers[i].context);
      if (!L.error.empty()) {
        error = L.error;
        return false;
      }
    }
    const int released = release_collectives(L, w, error);
    if (released < 0) return false;
    if (released > 0) continue;
    for (int i = first; i < last; ++i) {
      if (L.fibers[i].wait == Wait::kWarp) {
        error = "deadlock in " + block_name(L) + ": warp " + std::to_string(w) +
                " waits at a collective that some of its lanes never reach (divergent "
                "__syncthreads or warp collective; " + where(L.fibers[i].site) + ")";
        return false;
      }
    }
    return true;
  }
}

// The order the warps of the CTA numbered `linear` run in: forward, reversed or rotated by a
// CTA-dependent amount, so that no test relies on one warp running before another.
inline void warp_order(int linear, int num_warps, std::vector<int>& order) {
  order.resize(num_warps);
  const int rotation = num_warps > 1 ? 1 + (linear / 3) % (num_warps - 1) : 0;
  for (int k = 0; k < num_warps; ++k) {
    switch (linear % 3) {
      case 0: order[k] = k; break;
      case 1: order[k] = num_warps - 1 - k; break;
      default: order[k] = (k + rotation) % num_warps; break;
    }
  }
}

// Runs one CTA to completion; false (with a message) on an invalid barrier.
inline bool run_block(Launch& L, int linear, std::string& error) {
  const int n = static_cast<int>(L.fibers.size());
  // Uninitialised shared memory: NaN as float, all ones as an integer.
  std::memset(__start_metrale_shared, 0xff,
              static_cast<size_t>(__stop_metrale_shared - __start_metrale_shared));
  L.block_live = n;
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    f.wait = Wait::kNone;
    f.leader = 0;
    f.copies.clear();
    f.committed = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = L.stacks + static_cast<size_t>(i) * kStackBytes;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &L.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  std::vector<int> order;
  warp_order(linear, L.num_warps, order);
  while (L.block_live > 0) {
    for (int w : order)
      if (!run_warp(L, w, error)) return false;
    // Every live thread now waits at a __syncthreads: it releases if they all wait at one.
    const Fiber* first = nullptr;
    for (Fiber& f : L.fibers) {
      if (f.wait != Wait::kBlock) continue;
      if (first == nullptr) {
        first = &f;
      } else if (!(f.site == first->site)) {
        error = block_name(L) + ": threads " + std::to_string(first->warp * 32 + first->lane) +
                " and " + std::to_string(f.warp * 32 + f.lane) +
                " wait at different __syncthreads (" + first->site.file + ":" +
                std::to_string(first->site.line) + " and " + f.site.file + ":" +
                std::to_string(f.site.line) + "): divergent, undefined on a GPU";
        return false;
      }
    }
    for (Fiber& f : L.fibers)
      if (f.wait == Wait::kBlock) f.wait = Wait::kNone;
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
  L.published.assign(static_cast<size_t>(L.num_warps) * 32 * kExchangeWords, 0u);
  L.snapshots.assign(static_cast<size_t>(L.num_warps) * 32 * 32 * kExchangeWords, 0u);
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
  int linear = 0;
  for (unsigned z = 0; z < grid.z && ok; ++z)
    for (unsigned y = 0; y < grid.y && ok; ++y)
      for (unsigned x = 0; x < grid.x && ok; ++x) {
        L.block_idx = uint3{x, y, z};
        ok = run_block(L, linear++, message);
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
inline T shuffle_from(T value, int src_lane, unsigned mask, Collective kind, const char* file,
                      int line) {
  static_assert(sizeof(T) <= 8, "the shim shuffles values of up to 8 bytes");
  Fiber& f = self();
  std::memcpy(published_slot(f), &value, sizeof(T));
  wait_at(Wait::kWarp, Site{kind, mask, file, line});
  // A lane outside the mask may be elsewhere in the kernel, or exited: its value is undefined.
  if (src_lane < 0 || src_lane >= 32 || !((mask >> src_lane) & 1u))
    fail(std::string(collective_name(kind)) + " at " + file + ":" + std::to_string(line) +
         " reads lane " + std::to_string(src_lane) + ", outside its mask");
  T result;
  std::memcpy(&result, snapshot(f) + src_lane * kExchangeWords, sizeof(T));
  return result;
}

}  // namespace metrale_shim

#define threadIdx (::metrale_shim::self().tid)
#define blockIdx (::metrale_shim::g_launch->block_idx)
#define blockDim (::metrale_shim::g_launch->block)
#define gridDim (::metrale_shim::g_launch->grid)

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::metrale_shim::wait_at(::metrale_shim::Wait::kBlock,
                          ::metrale_shim::Site{::metrale_shim::Collective::kShuffleXor, 0, file,
                                               line});
}

// CTAs run one at a time and a fiber switches only at a barrier, so a read-modify-write is
// never interleaved with another thread's: the GPU's atomicity, and its result up to the order
// of the additions (which the shim fixes: CTAs in grid order, warps in the CTA's warp order).
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
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = ::metrale_shim::self().lane;
  int src = lane ^ lane_mask;
  if (src / width != lane / width) src = lane;
  return ::metrale_shim::shuffle_from(value, src, mask, ::metrale_shim::Collective::kShuffleXor,
                                      file, line);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = ::metrale_shim::self().lane;
  return ::metrale_shim::shuffle_from(value, (lane / width) * width + src_lane % width, mask,
                                      ::metrale_shim::Collective::kShuffleIdx, file, line);
}

// Warp-collective emulation of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (d += a * b)
// with the PTX fragment layout documented in lora_common.cuh: each lane publishes its fragment
// registers, then computes its own four outputs from the whole warp's A and B. `.aligned`: all
// 32 lanes execute the same mma (one call site).
inline void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace ::metrale_shim;
  Fiber& f = self();
  uint32_t* mine = published_slot(f);
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  wait_at(Wait::kWarp, Site{Collective::kMma, kFullMask, file, line});
  const uint32_t* buffer = snapshot(f);
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
}

// cp.async.cg.shared.global with a source size (lora_common.cuh documents the GPU side): the
// copy goes into the open group with its source bytes read now; its 16 destination bytes hold
// NaN until a wait completes it. Both addresses must be 16-byte aligned and the source size in
// 0..16, or the instruction is undefined (a misaligned address faults).
inline void cp_async16(void* dst, const void* src, int src_bytes) {
  using namespace ::metrale_shim;
  Fiber& f = self();
  char problem[128];
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    std::snprintf(problem, sizeof problem,
                  "cp_async16 with an address not 16-byte aligned (dst %p, src %p)", dst, src);
    fail(problem);
  }
  if (src_bytes < 0 || src_bytes > 16) {
    std::snprintf(problem, sizeof problem, "cp_async16 with a source size of %d bytes (0..16)",
                  src_bytes);
    fail(problem);
  }
  AsyncCopy copy{dst, {}, src_bytes, f.committed};
  std::memcpy(copy.bytes, src, static_cast<size_t>(src_bytes));
  std::memset(copy.bytes + src_bytes, 0, static_cast<size_t>(16 - src_bytes));
  std::memset(dst, 0xff, 16);
  f.copies.push_back(copy);
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
      std::memcpy(c.dst, c.bytes, sizeof c.bytes);
    } else {
      left.push_back(c);
    }
  }
  f.copies.swap(left);
}
