// host_shim.h: runs the kernels in kernels/*.cu on a CPU, unchanged, for the host harness
// (metrale_cli/ops/host_harness.py, whose build_command force-includes it ahead of the sources).
//
// Model: a launch interleaves its CTAs (launch: up to kResident resident, switching where one
// of them reaches an atomic, a fence, an __ldcg or a plain access of memory other CTAs write,
// in a seeded schedule that every failure names), and runs on guarded copies of its buffers
// (Buffer); the threads of a CTA are
// cooperative fibers (started by makecontext, switched by _setjmp/_longjmp) that switch only at
// barriers, so __syncthreads, warp shuffles and the warp-wide mma emulation have their CUDA
// meaning. The shim is meant to be as strict as the hardware, so that a kernel that may fail on
// a GPU fails here every time:
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
// with NaN bytes (0xff) at issue, and the copy lands (Landing) at that wait, at issue or at a
// random point between; a launch with copies runs under two landings and fails when its results
// differ (host_launch.h), and a store to a destination while its copy is in flight fails it as
// a race naming the storing warp and the copy. A copy whose source or destination is not
// 16-byte aligned, or whose source size is outside 0..16, fails the launch.
// Not supported: other atomics, cooperative groups, other inline PTX, CUDA headers.
#pragma once
#define METRALE_HOST_SHIM 1

// The fibers switch stacks by _longjmp (see Fiber); a fortified build (Ubuntu's g++ defines
// _FORTIFY_SOURCE at -O1 and above) would check each jump against the current stack and abort
// on a jump to another one. This header comes first in the build, ahead of any libc header.
#undef _FORTIFY_SOURCE

#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One CTA runs at a time, so a function-static array is exactly "one copy per CTA". The
// section gathers them all, so that each CTA's start can poison them in one fill and a CTA
// switch can move them in and out in one copy each (enter, leave). g++ ignores the attribute on
// a template's statics, which -fno-weak makes common symbols: the build's linker script places
// those in the section too and defines __start_/__stop_ around it
// (host_harness.SHARED_SECTION_SCRIPT).
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

// kGlobal: at a point where other CTAs may run (an atomic, a fence, a load of another CTA's
// data): the CTA yields to the launch's scheduler there.
enum class Wait { kNone, kBlock, kWarp, kGlobal, kDone };
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
// them up to 16 bytes; the thread and call site that issued it, for a race's message.
struct AsyncCopy {
  void* dst;
  unsigned char bytes[16];
  int src_bytes;
  unsigned group;
  int thread;
  const char* file;
  int line;
};

// When a launch's cp.async copies land (kernels/README.md, "The host shim"): at the wait that
// completes them, at issue, or at a seeded random point between (each of the issuing thread's
// switch points, cp.async calls and waits lands each of its copies with probability 1/4). On a
// GPU a copy may land any time from its issue to its wait; a correct kernel's results are the
// same bits in all three, and a launch that issues copies runs in two of them
// (host_launch.h, launch_two_landings) and fails when they differ.
enum class Landing { kAtWait, kAtIssue, kRandom };
constexpr int kLandings = 3;

inline const char* landing_name(Landing l) {
  switch (l) {
    case Landing::kAtWait: return "cp.async landing at its wait";
    case Landing::kAtIssue: return "cp.async landing at issue";
    case Landing::kRandom: return "cp.async landing at random points";
  }
  return "?";
}

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

// A kernel thread. It starts on its own stack from `context` (makecontext), and after that
// switches with the scheduler by _setjmp/_longjmp (`resume`, Launch::scheduler): swapcontext
// saves and restores the signal mask, two system calls a switch, which with its register saves
// were nearly half the harness's CPU time (perf). Not for glibc's x86 shadow stacks (CET, opt-in
// through a tunable), which swapcontext handles and a _longjmp to another stack does not.
struct Fiber {
  ucontext_t context;
  jmp_buf resume;
  bool started;
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

// A resident CTA that is not running: the state the running one keeps in Launch (swapped in
// and out whole: the fibers never move, so their contexts stay valid), and its shared memory.
struct Cta {
  uint3 block_idx{0, 0, 0};
  int linear = 0;
  std::vector<Fiber> fibers;
  int current = 0;
  int block_live = 0;
  std::vector<uint32_t> published, snapshots;
  std::vector<int> order;  // its warps' order
  std::vector<char> shared;
  char* stacks = nullptr;  // its slot's fiber stacks
  size_t admitted = 0;     // its place in the admission order
  long long held = -1;     // depth-first: when it was held at an atomic (-1: not held)
};

struct Launch {
  dim3 grid, block;
  uint3 block_idx;
  int linear = 0;
  std::vector<int> order;
  std::function<void()> body;
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  jmp_buf scheduler;  // where a thread's switch lands: the scheduler's run_warp
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
  Landing landing = Landing::kAtWait;
  uint64_t landing_state = 0;  // the random landing's draws (splitmix64, as Rng)
  bool copied = false;         // whether any thread issued a cp.async
};

static Launch* g_launch = nullptr;
// True while a kernel thread runs: a fault then is the kernel's (on_fault).
static bool g_in_kernel = false;

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

// --- buffers: every array a launch passes, between poisoned guard regions ----------------------
// The launch runs on copies (host_launch.h, guard_buffers): each sits in its own mapping that
// ends where the copy ends (rounded up to 16 bytes), with an inaccessible page after it and a
// poisoned page (0xff) and an inaccessible one before it. A plain load or store past the end
// faults at once and fails the launch naming the buffer, the element and the thread (the
// SIGSEGV handler below); one into the poisoned page or the tail's padding is caught when the
// CTA next yields (check_guards); the shim's own loads and stores (load16, cp_async16, __ldcg,
// __stcg, the atomics) are checked before they touch memory.
struct Buffer {
  std::string name;
  char* data = nullptr;     // the copy the kernel sees
  size_t bytes = 0;         // its size
  size_t itemsize = 1;      // the element size the index is counted in
  char* mapping = nullptr;  // the whole mapping: guard, poison page, data pages, guard
  size_t mapped = 0;
  char* original = nullptr;  // the caller's array, copied back after the launch
  bool owner = true;        // false: an alias inside an earlier buffer's copy
  // Written by several CTAs of the launch (split-K's partials and tickets): its data pages are
  // inaccessible during a CTA's turn, so a plain load or store there is a point where another
  // CTA may run (contended_access).
  bool contended = false;
  bool sealed = false;  // its data pages are inaccessible now
};
static std::vector<Buffer> g_buffers;
// Read once, at load (check_guards asks at every CTA switch), into a plain static: a function's
// static would be a common symbol under -fno-weak and land in the poisoned shared section.
static const size_t g_page_bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
inline size_t page_bytes() { return g_page_bytes; }

// The poisoned bytes of buffer b lie in [poison_begin, poison_end), around its data: the page
// before it (and the start of its first page), and its tail padding.
inline char* poison_begin(const Buffer& b) { return b.mapping + page_bytes(); }
inline char* poison_end(const Buffer& b) { return b.mapping + b.mapped - page_bytes(); }

// "name[index]" for an address in or beside a buffer (its guard regions), else the address.
inline std::string describe(const void* address) {
  const char* p = static_cast<const char*>(address);
  for (const Buffer& b : g_buffers) {
    const long long offset = p - b.data;
    const long long reach = static_cast<long long>(2 * page_bytes());
    if (offset < -reach || offset >= static_cast<long long>(b.bytes) + reach) continue;
    const long long size = static_cast<long long>(b.bytes / b.itemsize);
    const long long index = offset >= 0 ? offset / static_cast<long long>(b.itemsize)
                                        : -((-offset + b.itemsize - 1) / b.itemsize);
    return b.name + "[" + std::to_string(index) + "] (" + b.name + " has " +
           std::to_string(size) + (index < 0 || index >= size ? "; out of bounds)" : ")");
  }
  char text[40];
  std::snprintf(text, sizeof text, "address %p", address);
  return text;
}

// Whether [p, p + bytes) reaches outside the buffer it starts in or beside: the buffer, or
// nullptr when it is in bounds (or in no buffer of the launch: a weight through a table).
inline const Buffer* out_of_bounds(const void* address, size_t bytes) {
  const char* p = static_cast<const char*>(address);
  for (const Buffer& b : g_buffers) {
    const char* lo = b.owner ? b.mapping : b.data;
    const char* hi = b.owner ? b.mapping + b.mapped : b.data + b.bytes;
    if (p + bytes <= lo || p >= hi) continue;
    if (p >= b.data && p + bytes <= b.data + b.bytes) return nullptr;
    return &b;
  }
  return nullptr;
}

// --- plain accesses to memory other CTAs write: points where another CTA may run -------------
// A contended buffer's data pages are sealed (PROT_NONE) while a CTA runs. A plain load or store
// of the kernel there faults; the fault handler makes it a point where other CTAs may run
// (contended_access), then unseals the pages and single-steps the access (the trap flag), and
// the trap seals them again: every plain access of such memory is preceded by a CTA switch,
// so a read-modify-write that is not atomic (a ticket drawn by a plain load and store) loses
// updates here as on a GPU. The shim's own accesses (its atomics, __ldcg, the fence's stores)
// unseal the buffer (touch) for the rest of the CTA's turn. x86-64 only (the trap flag); on
// other machines the buffers stay open and plain accesses never switch.
inline char* data_pages(const Buffer& b) { return b.mapping + 2 * page_bytes(); }
inline char* data_end(const Buffer& b) { return b.mapping + b.mapped - page_bytes(); }

inline void seal(Buffer& b, bool sealed) {
  if (b.sealed == sealed) return;
  mprotect(data_pages(b), data_end(b) - data_pages(b), sealed ? PROT_NONE : PROT_READ | PROT_WRITE);
  b.sealed = sealed;
}

// Seals (at the start of a CTA's turn) or opens (at its end: the guards' check reads the poison
// beside the data) every contended buffer.
inline void seal_contended(bool sealed) {
#if defined(__x86_64__)
  for (Buffer& b : g_buffers)
    if (b.contended && b.owner) seal(b, sealed);
#else
  (void)sealed;
#endif
}

// The contended buffer whose sealed data pages hold `address`, or nullptr.
inline Buffer* sealed_at(const void* address) {
  const char* p = static_cast<const char*>(address);
  for (Buffer& b : g_buffers)
    if (b.sealed && p >= data_pages(b) && p < data_end(b)) return &b;
  return nullptr;
}

// The shim is about to access `address` itself: its buffer opens for the rest of the turn.
inline void touch(const void* address) {
  if (Buffer* b = sealed_at(address)) seal(*b, false);
}

// The first byte in [p, end) that is not poison (0xff), or end. Eight bytes at a time: it runs
// over every buffer's poison at each CTA switch.
inline const char* first_unpoisoned(const char* p, const char* end) {
  for (; p < end && reinterpret_cast<uintptr_t>(p) % 8 != 0; ++p)
    if (static_cast<unsigned char>(*p) != 0xffu) return p;
  for (uint64_t word; p + 8 <= end; p += 8) {
    std::memcpy(&word, p, 8);
    if (word != ~uint64_t{0}) break;
  }
  for (; p < end; ++p)
    if (static_cast<unsigned char>(*p) != 0xffu) return p;
  return end;
}

// The first poisoned byte a plain store overwrote, as "name[index]"; empty when none.
inline std::string check_guards() {
  for (const Buffer& b : g_buffers) {
    if (!b.owner) continue;
    const char* p = first_unpoisoned(poison_begin(b), b.data);
    if (p == b.data) p = first_unpoisoned(b.data + b.bytes, poison_end(b));
    if (p != poison_end(b)) return describe(p);
  }
  return {};
}

// Fails the launch from inside a thread with `error`, the whole message: the scheduler never
// resumes the thread.
[[noreturn]] inline void abandon(const std::string& error) {
  Launch& L = *g_launch;
  L.error = error;
  self().wait = Wait::kDone;
  _longjmp(L.scheduler, 1);  // a failed launch is abandoned: the thread is never resumed
}

// Fails the launch from inside a thread, naming its CTA and thread.
[[noreturn]] inline void fail(const std::string& message) {
  const Fiber& f = self();
  abandon(block_name(*g_launch) + " thread " + std::to_string(f.warp * 32 + f.lane) + ": " +
          message);
}

// A load or store of the shim's own (load16, cp_async16, __ldcg, __stcg, the atomics) outside the
// buffer it starts in or beside fails the launch before it touches memory.
inline void check_access(const void* address, size_t bytes, const char* what) {
  if (out_of_bounds(address, bytes) != nullptr)
    fail(std::string(what) + " of " + std::to_string(bytes) + " bytes at " + describe(address) +
         " reaches past its buffer");
}

// --- cp.async landing --------------------------------------------------------------------------

// Where an address lies in the __shared__ section, for a message.
inline std::string shared_at(const void* address) {
  return "shared byte " +
         std::to_string(static_cast<const char*>(address) - __start_metrale_shared);
}

inline std::string copy_name(const AsyncCopy& c) {
  return "thread " + std::to_string(c.thread) + "'s cp_async16 at " + c.file + ":" +
         std::to_string(c.line);
}

// Whether copy c's destination still holds the NaN bytes its issue wrote: nothing stored there
// while it was in flight.
inline bool destination_intact(const AsyncCopy& c) {
  const char* dst = static_cast<const char*>(c.dst);
  return first_unpoisoned(dst, dst + 16) == dst + 16;
}

// Warp w stored to copy c's destination while c was in flight: a race (on a GPU the copy may
// land before or after the store). Warps run one at a time and the CTA's copies are checked
// after each warp's run (copies_intact), so the store is the last warp's to run, or the running
// one's.
inline std::string store_race(const Launch& L, int w, const AsyncCopy& c) {
  return block_name(L) + ": warp " + std::to_string(w) + " (threads " + std::to_string(32 * w) +
         ".." + std::to_string(32 * w + 31) + ") stored to " + shared_at(c.dst) +
         ", the destination of " + copy_name(c) +
         ", while that copy was in flight (a race: on a GPU the copy may land before or after "
         "the store)";
}

// Lands copy c: its bytes over its destination.
inline void land(const AsyncCopy& c) {
  if (!destination_intact(c)) abandon(store_race(*g_launch, self().warp, c));
  std::memcpy(c.dst, c.bytes, sizeof c.bytes);
}

// The random landing: each copy the running thread has in flight lands with probability 1/4.
inline void land_some() {
  Launch& L = *g_launch;
  if (L.landing != Landing::kRandom) return;
  Fiber& f = self();
  size_t kept = 0;
  for (size_t i = 0; i < f.copies.size(); ++i) {
    uint64_t z = (L.landing_state += 0x9e3779b97f4a7c15ull);  // splitmix64, as Rng
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    if (((z ^ (z >> 31)) & 3u) == 0) {
      land(f.copies[i]);
    } else {
      f.copies[kept++] = f.copies[i];
    }
  }
  f.copies.resize(kept);
}

// After warp w ran: a copy still in flight whose destination no longer holds its issue's NaN was
// stored over by that warp, a race naming both sides.
inline bool copies_intact(const Launch& L, int w, std::string& error) {
  for (const Fiber& f : L.fibers) {
    for (const AsyncCopy& c : f.copies) {
      if (destination_intact(c)) continue;
      error = store_race(L, w, c);
      return false;
    }
  }
  return true;
}

inline void wait_at(Wait kind, const Site& site) {
  Launch& L = *g_launch;
  land_some();
  Fiber& f = self();
  f.wait = kind;
  f.site = site;
  if (_setjmp(f.resume) == 0) _longjmp(L.scheduler, 1);
}

// A point where other CTAs may run: the thread stops here until its CTA's next turn.
// `atomic`: the point is an atomic (a split-K ticket), which the depth-first schedule holds.
inline void global_point(bool atomic = false) {
  Site site;
  site.mask = atomic ? 1u : 0u;
  wait_at(Wait::kGlobal, site);
}

inline void fiber_entry() {
  Launch& L = *g_launch;
  L.body();
  Fiber& f = self();
  f.wait = Wait::kDone;
  --L.block_live;
  _longjmp(L.scheduler, 1);  // the thread's stack is done with; it never returns
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
                                                  // another group releases first (or at a
                                                  // global point: on later)
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
      g_in_kernel = true;
      if (_setjmp(L.scheduler) == 0) {
        Fiber& f = L.fibers[i];
        if (f.started) _longjmp(f.resume, 1);
        f.started = true;
        setcontext(&f.context);
      }
      g_in_kernel = false;
      if (!L.error.empty()) {
        error = L.error;
        return false;
      }
    }
    const int released = release_collectives(L, w, error);
    if (released < 0) return false;
    if (released > 0) continue;
    for (int i = first; i < last; ++i)
      if (L.fibers[i].wait == Wait::kGlobal) return true;  // runs on at the CTA's next turn
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

// Makes the CTA held in L (its fibers sized and numbered) ready to start at its entry.
inline void start_block(Launch& L, char* stacks) {
  const int n = static_cast<int>(L.fibers.size());
  L.block_live = n;
  L.current = 0;
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    f.wait = Wait::kNone;
    f.leader = 0;
    f.copies.clear();
    f.committed = 0;
    f.started = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks + static_cast<size_t>(i) * kStackBytes;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;  // fiber_entry never returns
    makecontext(&f.context, fiber_entry, 0);
  }
}

enum class Step { kYield, kDone, kFailed };

// Runs the CTA held in L until it reaches a point where another CTA may run: one of its threads
// at an atomic, a fence or a global load of another CTA's data (__ldcg); kDone when every
// thread has exited, kFailed (with a message) on an invalid barrier. CTAs switch only there:
// the only cross-CTA traffic the kernels have goes through those points.
inline Step step_block(Launch& L, std::string& error) {
  for (Fiber& f : L.fibers)
    if (f.wait == Wait::kGlobal) f.wait = Wait::kNone;
  for (;;) {
    for (int w : L.order) {
      if (!run_warp(L, w, error)) return Step::kFailed;
      if (L.copied && !copies_intact(L, w, error)) return Step::kFailed;
    }
    bool yielded = false;
    for (const Fiber& f : L.fibers) yielded = yielded || f.wait == Wait::kGlobal;
    if (yielded) return Step::kYield;
    if (L.block_live == 0) return Step::kDone;
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
        return Step::kFailed;
      }
    }
    for (Fiber& f : L.fibers)
      if (f.wait == Wait::kBlock) f.wait = Wait::kNone;
  }
}

// Swaps the resident CTA `c`'s state with L's (so twice is nothing): its threads, exchange
// buffers and warp order. The fibers' storage moves with its vector, never its elements, so
// every saved context stays where it was.
inline void swap_state(Launch& L, Cta& c) {
  std::swap(L.block_idx, c.block_idx);
  std::swap(L.linear, c.linear);
  L.fibers.swap(c.fibers);
  std::swap(L.current, c.current);
  std::swap(L.block_live, c.block_live);
  L.published.swap(c.published);
  L.snapshots.swap(c.snapshots);
  L.order.swap(c.order);
}

inline size_t shared_section_bytes() {
  return static_cast<size_t>(__stop_metrale_shared - __start_metrale_shared);
}

// CTA `c` runs: its state in L, its shared memory in the section the kernels address. What the
// section held is nobody's: the CTA that ran before took its own out (leave).
inline void enter(Launch& L, Cta& c) {
  swap_state(L, c);
  std::memcpy(__start_metrale_shared, c.shared.data(), shared_section_bytes());
}

// CTA `c` stops (at a point where another may run, or at its end): its state and shared memory
// back in `c`.
inline void leave(Launch& L, Cta& c) {
  swap_state(L, c);
  std::memcpy(c.shared.data(), __start_metrale_shared, shared_section_bytes());
}

struct PendingStore {
  float* address;
  float value;
  unsigned block;
  int thread;
  bool late;
};
// static, not inline: an inline variable would be a common symbol under -fno-weak, which the
// build's linker script puts with the __shared__ arrays (host_harness.SHARED_SECTION_SCRIPT).
static std::vector<PendingStore> g_pending;
// Which CTA (serial) last read each address by __ldcg in this launch: a __stcg by another CTA
// after that read is a race (nothing made the read wait for the store).
static std::unordered_map<const float*, unsigned> g_reads;
inline unsigned block_serial() {
  const Launch& L = *g_launch;
  return (L.block_idx.z * L.grid.y + L.block_idx.y) * L.grid.x + L.block_idx.x;
}
// At the end of a launch every store has landed, in program order.
inline void land_pending() {
  for (const PendingStore& p : g_pending) *p.address = p.value;
  g_pending.clear();
  g_reads.clear();
}

inline std::string block_of(unsigned serial) {
  const Launch& L = *g_launch;
  char name[64];
  std::snprintf(name, sizeof name, "block (%u, %u, %u)", serial % L.grid.x,
                serial / L.grid.x % L.grid.y, serial / (L.grid.x * L.grid.y));
  return name;
}

// How a launch orders its CTAs (kernels/README.md, "The host shim"): resident CTAs (at most
// kResident, admitted in the schedule's order as others finish) run by turns, each until its
// next point where another CTA may run (step_block). Round-robin admits in grid order and runs
// the residents in turn; reversed admits from the grid's end; random admits in a shuffled order
// and picks the next CTA at random; depth-first runs the earliest admitted CTA until it reaches
// an atomic, holds it there and runs the next, and when every resident CTA is held releases the
// one held last first (so the CTA that draws split-K's last ticket is the one that ran first,
// before any other split stored). A launch's seed chooses the schedule (seed % 4) and the
// random one's draws, and every failure message names it.
constexpr int kResident = 32;
enum class Schedule { kRoundRobin, kReversed, kRandom, kDepthFirst };

inline const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kRoundRobin: return "round-robin";
    case Schedule::kReversed: return "reversed round-robin";
    case Schedule::kRandom: return "random";
    case Schedule::kDepthFirst: return "depth-first";
  }
  return "?";
}

// splitmix64: a small, seedable generator whose draws are the same on every platform.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }
};

#if defined(__x86_64__)
// The buffer whose pages a single-stepped access opened: the trap after it seals them again.
static Buffer* g_stepping = nullptr;
constexpr greg_t kTrapFlag = 0x100;  // EFLAGS.TF: a debug trap after the next instruction

// A kernel thread's plain load or store of a sealed contended buffer (on_fault): other CTAs may
// run first (the depth-first schedule holds the CTA here, as at an atomic); when this CTA runs
// again its buffers are sealed anew, and the access is let through alone: the buffer opened,
// the trap flag set, so that the access traps as soon as it is done (on_trap). Runs inside the
// SIGSEGV handler, on the thread's stack, which the switch leaves as it is.
inline void contended_access(Buffer& b, ucontext_t* context) {
  global_point(true);
  seal(b, false);
  g_stepping = &b;
  context->uc_mcontext.gregs[REG_EFL] |= kTrapFlag;
}

// The single-stepped access is done: its buffer sealed again, the trap flag cleared.
inline void on_trap(int, siginfo_t*, void* context) {
  static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_EFL] &= ~kTrapFlag;
  if (g_stepping != nullptr) seal(*g_stepping, true);
  g_stepping = nullptr;
}
#endif

// A kernel thread's fault (a plain load or store into a guard page, or a wild address) fails
// the launch with the buffer, element and thread named, instead of killing the process; the
// thread is abandoned. A fault outside a kernel thread keeps the default action.
inline void on_fault(int signal_number, siginfo_t* info, void* context) {
  Launch* L = g_launch;
  if (L == nullptr || !g_in_kernel) {
    ::signal(signal_number, SIG_DFL);
    return;  // the access faults again, now with the default action
  }
#if defined(__x86_64__)
  if (Buffer* b = signal_number == SIGSEGV ? sealed_at(info->si_addr) : nullptr) {
    contended_access(*b, static_cast<ucontext_t*>(context));
    return;  // the access runs now, alone, and traps (on_trap)
  }
#endif
  const char* access = "an access to ";
#if defined(__x86_64__)
  const greg_t code = static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_ERR];
  access = (code & 2) ? "a store to " : "a load of ";
#else
  (void)context;
#endif
  Fiber& f = self();
  L->error = block_name(*L) + " thread " + std::to_string(f.warp * 32 + f.lane) + ": " + access +
             describe(info->si_addr) + " faulted";
  f.wait = Wait::kDone;
  g_in_kernel = false;
  // The signal is blocked while its handler runs, and the jump out of the handler does not
  // restore the mask: unblocked here, so that the next launch's faults reach the handler too.
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, signal_number);
  pthread_sigmask(SIG_UNBLOCK, &handled, nullptr);
  _longjmp(L->scheduler, 1);
}


// The fiber stacks, kept from one launch to the next (launches never overlap: see launch).
// Fresh stacks at every launch were faulted in page by page, about a million minor faults over
// the host-harness test files. What a launch leaves on them is never read: a thread's stack
// starts at makecontext. The pages it touched stay with the process (a 256-thread block: about
// 64 MiB of 32 resident CTAs).
static char* g_stacks = nullptr;
static size_t g_stacks_bytes = 0;

// `bytes` (> 0) of fiber stacks: the kept ones, grown to fit; null when memory is out.
inline char* take_stacks(size_t bytes) {
  if (bytes > g_stacks_bytes) {
    std::free(g_stacks);
    g_stacks = static_cast<char*>(std::aligned_alloc(64, bytes));
    g_stacks_bytes = g_stacks == nullptr ? 0 : bytes;
  }
  return g_stacks;
}

// Runs `body` (a kernel call with bound arguments) over the grid under the schedule `seed`
// chooses, its cp.async copies landing as `landing` says; 0 on success, else 1 with a message
// in `error` (truncated to error_len). `copied`: whether any thread issued a cp.async.
inline int launch(dim3 grid, dim3 block, std::function<void()> body, uint64_t seed,
                  Landing landing, bool* copied, char* error, int error_len) {
  Launch L;
  L.grid = grid;
  L.block = block;
  L.body = std::move(body);
  L.landing = landing;
  L.landing_state = seed ^ 0x6c616e64696e6773ull;
  *copied = false;
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) {
    std::snprintf(error, error_len, "invalid block size %d", n);
    return 1;
  }
  if (g_launch != nullptr) {
    // The launch state, the shared section and the stacks are the process's: one launch at a
    // time (host_harness.py's lock), and a kernel launches none.
    std::snprintf(error, error_len, "a launch is already running in this process");
    return 1;
  }
  L.num_warps = (n + 31) / 32;
  const size_t total = static_cast<size_t>(grid.x) * grid.y * grid.z;
  if (total == 0) return 0;  // an empty grid runs nothing
  const int resident = static_cast<int>(std::min<size_t>(kResident, total));
  const size_t slot_bytes = static_cast<size_t>(n) * kStackBytes;
  L.stacks = take_stacks(slot_bytes * resident);
  if (L.stacks == nullptr) {
    std::snprintf(error, error_len, "out of memory for %d x %d fiber stacks", resident, n);
    return 1;
  }
  const Schedule schedule = static_cast<Schedule>(seed % 4);
  Rng rng{seed};
  std::vector<size_t> admission(total);
  for (size_t i = 0; i < total; ++i)
    admission[i] = schedule == Schedule::kReversed ? total - 1 - i : i;
  if (schedule == Schedule::kRandom)
    for (size_t i = total; i > 1; --i) std::swap(admission[i - 1], admission[rng.below(i)]);

  const size_t shared_bytes = shared_section_bytes();
  std::vector<Cta> slots(resident);
  std::vector<int> free_slots, running;
  for (int i = resident - 1; i >= 0; --i) {
    Cta& c = slots[i];
    c.stacks = L.stacks + slot_bytes * i;
    c.fibers.resize(n);
    for (int t = 0; t < n; ++t) {
      Fiber& f = c.fibers[t];
      // Linear thread index x-fastest, as CUDA numbers lanes into warps.
      f.tid = uint3{static_cast<unsigned>(t) % block.x, static_cast<unsigned>(t) / block.x % block.y,
                    static_cast<unsigned>(t) / (block.x * block.y)};
      f.warp = t / 32;
      f.lane = t % 32;
    }
    c.published.assign(static_cast<size_t>(L.num_warps) * 32 * kExchangeWords, 0u);
    c.snapshots.assign(static_cast<size_t>(L.num_warps) * 32 * 32 * kExchangeWords, 0u);
    c.shared.resize(shared_bytes);
    free_slots.push_back(i);
  }
  g_launch = &L;
  struct sigaction handler {}, previous_segv {}, previous_bus {};
  handler.sa_sigaction = on_fault;
  // SA_NODEFER: a contended access switches fibers from inside the handler (contended_access),
  // and the other threads' faults must still reach it.
  handler.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&handler.sa_mask);
  sigaction(SIGSEGV, &handler, &previous_segv);
  sigaction(SIGBUS, &handler, &previous_bus);
#if defined(__x86_64__)
  struct sigaction trap {}, previous_trap {};
  trap.sa_sigaction = on_trap;
  trap.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&trap.sa_mask);
  sigaction(SIGTRAP, &trap, &previous_trap);
#endif
  std::string message;
  size_t admitted = 0, cursor = 0;
  long long holds = 0;
  while (message.empty() && (admitted < total || !running.empty())) {
    while (admitted < total && !free_slots.empty()) {
      const int i = free_slots.back();
      free_slots.pop_back();
      Cta& c = slots[i];
      const size_t linear = admission[admitted++];
      c.linear = static_cast<int>(linear);
      c.admitted = admitted;
      c.held = -1;
      c.block_idx = uint3{static_cast<unsigned>(linear % grid.x),
                          static_cast<unsigned>(linear / grid.x % grid.y),
                          static_cast<unsigned>(linear / (static_cast<size_t>(grid.x) * grid.y))};
      warp_order(c.linear, L.num_warps, c.order);
      // Uninitialised shared memory: NaN as float, all ones as an integer.
      std::fill(c.shared.begin(), c.shared.end(), static_cast<char>(0xff));
      swap_state(L, c);  // its shared memory stays in c until it runs
      start_block(L, c.stacks);
      swap_state(L, c);
      running.push_back(i);
    }
    size_t pick = schedule == Schedule::kRandom ? rng.below(running.size())
                                                 : cursor % running.size();
    if (schedule == Schedule::kDepthFirst) {
      // The earliest admitted CTA not held; if every one is held, the one held last.
      size_t best = running.size();
      for (size_t r = 0; r < running.size(); ++r) {
        const Cta& candidate = slots[running[r]];
        if (candidate.held < 0 &&
            (best == running.size() || candidate.admitted < slots[running[best]].admitted))
          best = r;
      }
      if (best == running.size()) {
        best = 0;
        for (size_t r = 1; r < running.size(); ++r)
          if (slots[running[r]].held > slots[running[best]].held) best = r;
        slots[running[best]].held = -1;
      }
      pick = best;
    }
    Cta& c = slots[running[pick]];
    enter(L, c);
    seal_contended(true);
    const Step step = step_block(L, message);
    seal_contended(false);
    bool at_atomic = false;
    for (const Fiber& f : L.fibers) at_atomic = at_atomic || (f.wait == Wait::kGlobal && f.site.mask);
    if (step != Step::kFailed) {
      const std::string stored = check_guards();
      if (!stored.empty())
        message = block_name(L) + ": a store to " + stored + " overwrote its guard's poison";
    }
    leave(L, c);
    if (step == Step::kDone) {
      free_slots.push_back(running[pick]);
      running.erase(running.begin() + static_cast<long>(pick));
      cursor = pick;  // the next resident's turn
    } else {
      cursor = pick + 1;
      if (at_atomic) c.held = holds++;
    }
  }
  land_pending();
  sigaction(SIGSEGV, &previous_segv, nullptr);
  sigaction(SIGBUS, &previous_bus, nullptr);
#if defined(__x86_64__)
  sigaction(SIGTRAP, &previous_trap, nullptr);
#endif
  g_launch = nullptr;
  *copied = L.copied;
  if (!message.empty()) {
    std::snprintf(error, error_len, "%s [%s CTA schedule, %sseed %llu]", message.c_str(),
                  schedule_name(schedule),
                  L.copied ? (std::string(landing_name(landing)) + ", ").c_str() : "",
                  static_cast<unsigned long long>(seed));
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

// A fiber switches only at a barrier or a global point, so a read-modify-write is never
// interleaved with another thread's; the order of the additions follows the CTA schedule.
inline float atomicAdd(float* address, float value) {
  ::metrale_shim::check_access(address, sizeof(float), "atomicAdd");
  ::metrale_shim::global_point(true);
  ::metrale_shim::touch(address);
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
  using namespace ::metrale_shim;
  check_access(address, sizeof(float), "__stcg");
  const auto read = g_reads.find(address);
  if (read != g_reads.end() && read->second != block_serial())
    fail("__stcg to " + describe(address) + ", which " + block_of(read->second) +
         " read (__ldcg) earlier in this launch: nothing orders that read after this store "
         "(a race: the reader sees the value from before it)");
  ::metrale_shim::g_pending.push_back(
      {address, value, ::metrale_shim::block_serial(), ::metrale_shim::g_launch->current, false});
}
inline float __ldcg(const float* address) {
  using namespace ::metrale_shim;
  check_access(address, sizeof(float), "__ldcg");
  global_point();
  const unsigned block = block_serial();
  for (auto p = g_pending.rbegin(); p != g_pending.rend(); ++p) {
    if (p->address != address) continue;
    if (p->block == block) return p->value;
    fail("__ldcg of " + describe(address) + ", which " + block_of(p->block) + " thread " +
         std::to_string(p->thread) + " stored and had not fenced before its ticket (it may land "
         "after this read on a GPU)");
  }
  g_reads[address] = block;
  touch(address);
  return *address;
}
inline void __threadfence() {
  ::metrale_shim::global_point();
  auto& pending = ::metrale_shim::g_pending;
  const unsigned block = ::metrale_shim::block_serial();
  const int thread = ::metrale_shim::g_launch->current;
  size_t kept = 0;
  for (const ::metrale_shim::PendingStore& p : pending) {
    if (p.block == block && p.thread == thread && !p.late) {
      ::metrale_shim::touch(p.address);
      *p.address = p.value;
    } else {
      pending[kept++] = p;
    }
  }
  pending.resize(kept);
}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  ::metrale_shim::check_access(address, sizeof(unsigned), "atomicAdd");
  ::metrale_shim::global_point(true);
  const unsigned block = ::metrale_shim::block_serial();
  for (::metrale_shim::PendingStore& p : ::metrale_shim::g_pending)
    if (p.block == block) p.late = true;
  ::metrale_shim::touch(address);
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
// NaN until it lands (Landing: at issue, at the wait that completes it, or at a random point
// between). Both addresses must be 16-byte aligned and the source size in 0..16, or the
// instruction is undefined (a misaligned address faults).
inline void cp_async16(void* dst, const void* src, int src_bytes,
                       const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace ::metrale_shim;
  land_some();
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
  check_access(src, static_cast<size_t>(src_bytes), "cp_async16");
  AsyncCopy copy{dst, {}, src_bytes, f.committed, f.warp * 32 + f.lane, file, line};
  std::memcpy(copy.bytes, src, static_cast<size_t>(src_bytes));
  std::memset(copy.bytes + src_bytes, 0, static_cast<size_t>(16 - src_bytes));
  g_launch->copied = true;
  if (g_launch->landing == Landing::kAtIssue) {
    std::memcpy(dst, copy.bytes, sizeof copy.bytes);
    return;
  }
  std::memset(dst, 0xff, 16);
  f.copies.push_back(copy);
}

inline void cp_async_commit() {
  ::metrale_shim::land_some();
  ++::metrale_shim::self().committed;
}

// Completes every committed group but the `pending` newest; copies issued after the last commit
// are in no committed group and stay in flight, as in PTX.
template <int pending>
inline void cp_async_wait() {
  using namespace ::metrale_shim;
  land_some();
  Fiber& f = self();
  std::vector<AsyncCopy> left;
  for (const AsyncCopy& c : f.copies) {
    if (c.group + pending < f.committed) {
      land(c);
    } else {
      left.push_back(c);
    }
  }
  f.copies.swap(left);
}
