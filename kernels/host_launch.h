// host_launch.h: the host harness's translation unit. The shim (host_shim.h) and every kernel
// source are force-included before it; it exports one C entry point that launches a kernel by name the
// way cuLaunchKernel does: grid and block dims, and an array of pointers to the argument values.
// metrale_cli/ops/host_harness.py passes the very argument tuples that metrale_cli/ops/plans.py
// plans for CuPy, so both run the same launch shapes.
//
// Built by metrale_cli/ops/host_harness.py (build_command, the one place the g++ command is
// written; `python -m metrale_cli.ops.host_harness` prints it). The file is a .h so that the wheel's
// package data ships it.
#include <cstddef>
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

}  // namespace metrale_shim

// dims: grid x, y, z, block x, y, z. Returns 0, or 1 with a message in `error`.
extern "C" __attribute__((visibility("default"))) int metrale_host_launch(const char* name, const unsigned* dims, void** params,
                                   int num_params, char* error, int error_len) {
  for (const metrale_shim::KernelEntry& entry : metrale_shim::kKernels) {
    if (std::strcmp(entry.name, name) != 0) continue;
    if (entry.num_params != num_params) {
      std::snprintf(error, error_len, "%s takes %d arguments, got %d", name, entry.num_params,
                    num_params);
      return 1;
    }
    return metrale_shim::launch(dim3(dims[0], dims[1], dims[2]), dim3(dims[3], dims[4], dims[5]),
                                entry.bind(params), error, error_len);
  }
  std::snprintf(error, error_len, "no kernel named %s in the host build", name);
  return 1;
}
