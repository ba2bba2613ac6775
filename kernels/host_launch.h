// host_launch.h: the host harness's translation unit. The shim (host_shim.h) and every kernel
// source are force-included before it; it exports one C entry point that launches a kernel by name the
// way cuLaunchKernel does: grid and block dims, and an array of pointers to the argument values.
// metrale_cli/ops/host_harness.py passes the very argument tuples that metrale_cli/ops/plans.py
// plans for CuPy, so both run the same launch shapes.
//
// Built by metrale_cli/ops/host_harness.py (build_command, the one place the g++ command is
// written; `python -m metrale_cli.ops.host_harness` prints it). The file is a .h so that the wheel's
// package data ships it.
#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>
#include <type_traits>
#include <utility>

// The kernel sources are force-included before this file (one `-include` each), and the table
// below is the list METRALE_HOST_KERNELS, `METRALE_HOST_KERNEL(name),` per kernel: both come
// from the sources themselves (metrale_cli/ops/sources.py reads their extern "C" names), so a
// new kernel needs no entry here.
#ifndef METRALE_HOST_KERNELS
#error "build with metrale_cli/ops/host_harness.py (build_command), which defines METRALE_HOST_KERNELS"
#endif

namespace metrale_shim {

template <typename... Args, size_t... I>
void call_with(void (*kernel)(Args...), void** params, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<Args>*>(params[I])...);
}

struct KernelEntry {
  const char* name;
  int num_params;
  std::function<void()> (*bind)(void** params);
};

template <typename... Args>
constexpr int arity(void (*)(Args...)) {
  return static_cast<int>(sizeof...(Args));
}

#define METRALE_HOST_KERNEL(kernel)                                                      \
  KernelEntry {                                                                          \
    #kernel, arity(kernel), [](void** params) -> std::function<void()> {                 \
      return [params] { call_with(kernel, params, std::make_index_sequence<arity(kernel)>{}); }; \
    }                                                                                    \
  }

static const KernelEntry kKernels[] = {METRALE_HOST_KERNELS};

// Puts each array parameter (sizes[i] > 0 bytes, counted in itemsizes[i]-byte elements) into a
// guarded copy (host_shim.h, Buffer) and points values[i] at it; an array inside an earlier one
// (a view) shares that one's copy. contended[i]: several CTAs write the array (Buffer).
inline void guard_buffers(int num_params, void** params, const char* const* names,
                          const unsigned long long* sizes, const unsigned long long* itemsizes,
                          const unsigned char* contended, std::vector<void*>& values,
                          std::vector<void*>& call) {
  const size_t page = page_bytes();
  g_buffers.clear();
  for (int i = 0; i < num_params; ++i) {
    call[i] = params[i];
    if (sizes[i] == 0) continue;
    char* original = *static_cast<char**>(params[i]);
    if (original == nullptr) continue;
    Buffer b;
    b.name = names[i];
    b.bytes = sizes[i];
    b.itemsize = itemsizes[i] ? itemsizes[i] : 1;
    b.original = original;
    b.contended = contended[i] != 0;
    for (const Buffer& earlier : g_buffers) {
      if (earlier.owner && original >= earlier.original &&
          original + b.bytes <= earlier.original + earlier.bytes) {
        b.owner = false;
        b.data = earlier.data + (original - earlier.original);
        break;
      }
    }
    if (b.owner) {
      const size_t padded = (b.bytes + 15) / 16 * 16;
      const size_t data_pages = (padded + page - 1) / page;
      b.mapped = (data_pages + 3) * page;
      void* mapping = mmap(nullptr, b.mapped, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mapping == MAP_FAILED) continue;  // unguarded: the kernel runs on the caller's array
      b.mapping = static_cast<char*>(mapping);
      mprotect(b.mapping, page, PROT_NONE);
      mprotect(b.mapping + b.mapped - page, page, PROT_NONE);
      std::memset(b.mapping + page, 0xff, b.mapped - 2 * page);
      b.data = b.mapping + b.mapped - page - padded;
      std::memcpy(b.data, original, b.bytes);
    }
    values[i] = b.data;
    call[i] = &values[i];
    g_buffers.push_back(b);
  }
}

// The bytes of every guarded buffer (the owners: an alias lies inside one), in g_buffers' order.
inline std::vector<std::vector<char>> buffer_contents() {
  std::vector<std::vector<char>> contents;
  for (const Buffer& b : g_buffers)
    contents.emplace_back(b.owner ? b.data : nullptr, b.owner ? b.data + b.bytes : nullptr);
  return contents;
}

inline void restore_buffers(const std::vector<std::vector<char>>& contents) {
  for (size_t i = 0; i < g_buffers.size(); ++i)
    if (g_buffers[i].owner) std::memcpy(g_buffers[i].data, contents[i].data(), contents[i].size());
}

// The first element of a guarded buffer that differs from `contents`, as "name[index]"; empty
// when none does.
inline std::string first_difference(const std::vector<std::vector<char>>& contents) {
  for (size_t i = 0; i < g_buffers.size(); ++i) {
    const Buffer& b = g_buffers[i];
    if (!b.owner) continue;
    const auto at = std::mismatch(contents[i].begin(), contents[i].end(), b.data);
    if (at.first != contents[i].end())
      return describe(b.data + (at.first - contents[i].begin()));
  }
  return {};
}

// Runs the kernel with its cp.async copies landing as the seed's Landing says (seed % 3) and, if
// it issued any, again from the same inputs under the same CTA schedule with the next landing
// ((seed + 1) % 3: consecutive seeds compare every pair); a result that differs between the two
// fails the launch (a stage read before its copies landed, or refilled while another warp reads
// it, whatever the values). Twice, not thrice: the SGMV tests' time is the quick tier's.
inline int launch_two_landings(dim3 grid, dim3 block, const std::function<void()>& body,
                                uint64_t seed, char* error, int error_len) {
  const auto inputs = buffer_contents();
  const Landing first = static_cast<Landing>(seed % kLandings);
  bool copied = false;
  int status = launch(grid, block, body, seed, first, &copied, error, error_len);
  if (status != 0 || !copied) return status;
  const auto results = buffer_contents();
  {
    const Landing other = static_cast<Landing>((seed + 1) % kLandings);
    restore_buffers(inputs);
    status = launch(grid, block, body, seed, other, &copied, error, error_len);
    const std::string differs = status == 0 ? first_difference(results) : std::string();
    if (!differs.empty()) {
      std::snprintf(error, error_len,
                    "%s differs between %s and %s: when the copies land changed the result (a "
                    "stage read before its wait, or refilled while another warp reads it) [%s CTA "
                    "schedule, seed %llu]",
                    differs.c_str(), landing_name(first), landing_name(other),
                    schedule_name(static_cast<Schedule>(seed % 4)),
                    static_cast<unsigned long long>(seed));
      status = 1;
    }
  }
  return status;
}

// Copies every guarded buffer back to the caller's array and unmaps it.
inline void release_buffers() {
  for (const Buffer& b : g_buffers) {
    if (!b.owner) continue;
    std::memcpy(b.original, b.data, b.bytes);
    munmap(b.mapping, b.mapped);
  }
  g_buffers.clear();
}

}  // namespace metrale_shim

// dims: grid x, y, z, block x, y, z. Returns 0, or 1 with a message in `error`.
// names, sizes, itemsizes: each parameter's name, and for an array its size in bytes and its
// element size (0 for a value); contended: whether several CTAs write it (1) or not (0); seed:
// the CTA schedule and cp.async landing (host_shim.h, launch).
extern "C" __attribute__((visibility("default"))) int metrale_host_launch(
    const char* name, const unsigned* dims, void** params, int num_params,
    const char* const* names, const unsigned long long* sizes,
    const unsigned long long* itemsizes, const unsigned char* contended,
    unsigned long long seed, char* error, int error_len) {
  for (const metrale_shim::KernelEntry& entry : metrale_shim::kKernels) {
    if (std::strcmp(entry.name, name) != 0) continue;
    if (entry.num_params != num_params) {
      std::snprintf(error, error_len, "%s takes %d arguments, got %d", name, entry.num_params,
                    num_params);
      return 1;
    }
    std::vector<void*> values(num_params), call(num_params);
    metrale_shim::guard_buffers(num_params, params, names, sizes, itemsizes, contended, values,
                                call);
    const int status = metrale_shim::launch_two_landings(
        dim3(dims[0], dims[1], dims[2]), dim3(dims[3], dims[4], dims[5]), entry.bind(call.data()),
        seed, error, error_len);
    metrale_shim::release_buffers();
    return status;
  }
  std::snprintf(error, error_len, "no kernel named %s in the host build", name);
  return 1;
}
