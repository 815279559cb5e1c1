// quack_jax's XLA FFI target: launch one kernel of a cubin on the stream XLA gives.
//
// Attributes (all static, set by quack_jax at lowering time):
//   cubin       u8[]    the cubin image
//   cubin_hash  i64     a digest of the cubin and kernel name; with the CUDA context it keys
//                       the module cache
//   kernel      string  the kernel's symbol
//   grid, block, cluster  i64[3]  launch shape; cluster {1, 1, 1} launches without a cluster
//   smem        i64     dynamic shared memory in bytes
//   scalars     i32[]   32-bit scalar parameters (ints, or the bits of float32s)
//   poison      i64     nonzero: fill the outputs with 0xff bytes (NaN in every float
//                       dtype) before the launch, so tests catch elements a kernel misses;
//                       an output that aliases an input (written in place) is not filled
// Kernel parameters, in order: one pointer per input buffer, one per output buffer, then
// the scalars.
//
// The library also exports QuackJaxMaxActiveClusters, the occupancy query that sizes the
// persistent grids at lowering time, and QuackJaxCapturedLaunches (for tests).
//
// The CUDA driver is opened at run time (dlopen of libcuda.so.1), so the library builds
// without the CUDA toolkit and loads on machines without a GPU.
//
// Why one generic target, with the cubin as an attribute:
// docs/decisions/002-one-ffi-launcher-target.md. The kernels' parameters:
// docs/decisions/001-kernel-abi.md. The manylinux build:
// docs/decisions/020-manylinux-launcher.md.

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The few CUDA driver API declarations we use, written out for the ABI of CUDA 12+.
using CUresult = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUdeviceptr = unsigned long long;
using CUdevice = int;

constexpr CUresult kCudaSuccess = 0;
constexpr int kFuncAttrMaxDynamicSharedBytes = 8;
constexpr int kFuncAttrNonPortableClusterSizeAllowed = 14;
constexpr int kLaunchAttrClusterDimension = 4;
constexpr int kMaxPortableClusterSize = 8;

struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    struct {
      unsigned x, y, z;
    } cluster_dim;
    void* align;
  } value;
};

struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z;
  unsigned block_x, block_y, block_z;
  unsigned shared_bytes;
  CUstream stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};

struct Driver {
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*stream_get_ctx)(CUstream, CUcontext*) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, int, int) = nullptr;
  CUresult (*launch_kernel_ex)(const LaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*memset_d8_async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*stream_is_capturing)(CUstream, int*) = nullptr;
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primary_ctx_release)(CUdevice) = nullptr;
  CUresult (*module_unload)(CUmodule) = nullptr;
  CUresult (*occupancy_max_active_clusters)(int*, CUfunction, const LaunchConfig*) = nullptr;
  std::string error;  // why the driver is unusable, empty when it is usable
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (fn == nullptr && error.empty()) error = std::string("libcuda.so.1 lacks ") + name;
  return fn != nullptr;
}

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      d.error = std::string("cannot open libcuda.so.1: ") + (why ? why : "unknown error");
      return d;
    }
    Resolve(lib, "cuGetErrorName", d.get_error_name, d.error);
    Resolve(lib, "cuGetErrorString", d.get_error_string, d.error);
    Resolve(lib, "cuStreamGetCtx", d.stream_get_ctx, d.error);
    Resolve(lib, "cuCtxPushCurrent_v2", d.ctx_push, d.error);
    Resolve(lib, "cuCtxPopCurrent_v2", d.ctx_pop, d.error);
    Resolve(lib, "cuModuleLoadData", d.module_load_data, d.error);
    Resolve(lib, "cuModuleGetFunction", d.module_get_function, d.error);
    Resolve(lib, "cuFuncSetAttribute", d.func_set_attribute, d.error);
    Resolve(lib, "cuLaunchKernelEx", d.launch_kernel_ex, d.error);
    Resolve(lib, "cuMemsetD8Async", d.memset_d8_async, d.error);
    Resolve(lib, "cuStreamIsCapturing", d.stream_is_capturing, d.error);
    Resolve(lib, "cuInit", d.init, d.error);
    Resolve(lib, "cuDeviceGet", d.device_get, d.error);
    Resolve(lib, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain, d.error);
    Resolve(lib, "cuDevicePrimaryCtxRelease_v2", d.primary_ctx_release, d.error);
    Resolve(lib, "cuModuleUnload", d.module_unload, d.error);
    Resolve(lib, "cuOccupancyMaxActiveClusters", d.occupancy_max_active_clusters, d.error);
    return d;
  }();
  return driver;
}

std::string CudaMessage(CUresult status, std::string_view kernel, std::string_view what) {
  const Driver& d = GetDriver();
  const char* name = "CUDA_ERROR_UNKNOWN";
  const char* text = "unknown error";
  d.get_error_name(status, &name);
  d.get_error_string(status, &text);
  return std::string("quack_jax kernel ") + std::string(kernel) + ": " + std::string(what) +
         " failed with " + name + " (" + text + ")";
}

ffi::Error CudaError(CUresult status, std::string_view kernel, std::string_view what) {
  return ffi::Error::Internal(CudaMessage(status, kernel, what));
}

// Functions loaded so far, per (CUDA context, cubin digest). Modules stay loaded for the
// life of the process.
struct Loaded {
  CUfunction function = nullptr;
  int64_t smem_limit = 0;  // dynamic shared memory the function is allowed so far
  bool non_portable_cluster = false;
};

// Launches recorded into a CUDA graph (XLA command buffers) rather than run directly.
std::atomic<int64_t> captured_launches{0};
constexpr int kStreamCaptureActive = 1;

std::mutex cache_mutex;
std::map<std::pair<CUcontext, int64_t>, Loaded> cache;

struct Kernel {
  std::string_view name;
  ffi::Span<const uint8_t> cubin;
  int64_t cubin_hash;
  int64_t smem;
  int64_t cluster_size;
};

// Sets `function` to the function of `k` in the context of `stream`, loading and
// configuring it on first use.
ffi::Error GetFunction(CUstream stream, const Kernel& k, CUfunction& function) {
  const Driver& d = GetDriver();
  if (!d.error.empty()) {
    return ffi::Error::Internal("quack_jax kernel " + std::string(k.name) + ": " + d.error);
  }
  CUcontext ctx = nullptr;
  if (CUresult s = d.stream_get_ctx(stream, &ctx); s != kCudaSuccess) {
    return CudaError(s, k.name, "cuStreamGetCtx");
  }
  std::lock_guard<std::mutex> lock(cache_mutex);
  Loaded& entry = cache[{ctx, k.cubin_hash}];
  bool needs_smem = k.smem > entry.smem_limit;
  bool needs_cluster = k.cluster_size > kMaxPortableClusterSize && !entry.non_portable_cluster;
  function = entry.function;
  if (function != nullptr && !needs_smem && !needs_cluster) return ffi::Error::Success();

  if (CUresult s = d.ctx_push(ctx); s != kCudaSuccess) return CudaError(s, k.name, "cuCtxPushCurrent");
  auto configure = [&]() -> ffi::Error {
    if (entry.function == nullptr) {
      CUmodule module = nullptr;
      if (CUresult s = d.module_load_data(&module, k.cubin.begin()); s != kCudaSuccess) {
        return CudaError(s, k.name, "cuModuleLoadData");
      }
      std::string symbol(k.name);
      if (CUresult s = d.module_get_function(&entry.function, module, symbol.c_str());
          s != kCudaSuccess) {
        return CudaError(s, k.name, "cuModuleGetFunction");
      }
    }
    if (needs_smem) {
      CUresult s = d.func_set_attribute(entry.function, kFuncAttrMaxDynamicSharedBytes,
                                        static_cast<int>(k.smem));
      if (s != kCudaSuccess) return CudaError(s, k.name, "raising the shared memory limit");
      entry.smem_limit = k.smem;
    }
    if (needs_cluster) {
      CUresult s = d.func_set_attribute(entry.function, kFuncAttrNonPortableClusterSizeAllowed, 1);
      if (s != kCudaSuccess) return CudaError(s, k.name, "allowing a non-portable cluster");
      entry.non_portable_cluster = true;
    }
    return ffi::Error::Success();
  };
  ffi::Error status = configure();
  CUcontext popped = nullptr;
  d.ctx_pop(&popped);
  function = entry.function;
  return status;
}

ffi::Error CheckShape(std::string_view kernel, std::string_view name, ffi::Span<const int64_t> v) {
  if (v.size() != 3) {
    return ffi::Error::InvalidArgument("quack_jax kernel " + std::string(kernel) + ": " +
                                       std::string(name) + " must have 3 dimensions");
  }
  for (int64_t x : v) {
    if (x < 1 || x > 0x7fffffff) {
      return ffi::Error::InvalidArgument("quack_jax kernel " + std::string(kernel) + ": " +
                                         std::string(name) + " out of range");
    }
  }
  return ffi::Error::Success();
}

ffi::Error ReadKernel(std::string_view kernel, ffi::Span<const uint8_t> cubin,
                      int64_t cubin_hash, ffi::Span<const int64_t> grid,
                      ffi::Span<const int64_t> block, ffi::Span<const int64_t> cluster,
                      int64_t smem, Kernel& k) {
  if (ffi::Error e = CheckShape(kernel, "grid", grid); e.failure()) return e;
  if (ffi::Error e = CheckShape(kernel, "block", block); e.failure()) return e;
  if (ffi::Error e = CheckShape(kernel, "cluster", cluster); e.failure()) return e;
  if (cubin.size() == 0 || smem < 0) {
    return ffi::Error::InvalidArgument("quack_jax kernel " + std::string(kernel) +
                                       ": empty cubin or negative shared memory");
  }
  k = Kernel{kernel, cubin, cubin_hash, smem, cluster[0] * cluster[1] * cluster[2]};
  return ffi::Error::Success();
}

// Initialize stage: runs before execution and outside command-buffer capture, so module
// loading never happens while XLA records a CUDA graph.
ffi::Error Initialize(CUstream stream, ffi::RemainingArgs, ffi::RemainingRets,
                      ffi::Span<const uint8_t> cubin, int64_t cubin_hash,
                      std::string_view kernel, ffi::Span<const int64_t> grid,
                      ffi::Span<const int64_t> block, ffi::Span<const int64_t> cluster,
                      int64_t smem, ffi::Span<const int32_t>, int64_t) {
  Kernel k;
  if (ffi::Error e = ReadKernel(kernel, cubin, cubin_hash, grid, block, cluster, smem, k);
      e.failure()) {
    return e;
  }
  CUfunction function = nullptr;
  return GetFunction(stream, k, function);
}

ffi::Error Execute(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Span<const uint8_t> cubin, int64_t cubin_hash,
                   std::string_view kernel, ffi::Span<const int64_t> grid,
                   ffi::Span<const int64_t> block, ffi::Span<const int64_t> cluster, int64_t smem,
                   ffi::Span<const int32_t> scalars, int64_t poison) {
  Kernel k;
  if (ffi::Error e = ReadKernel(kernel, cubin, cubin_hash, grid, block, cluster, smem, k);
      e.failure()) {
    return e;
  }
  CUfunction function = nullptr;
  if (ffi::Error e = GetFunction(stream, k, function); e.failure()) return e;

  std::vector<void*> pointers;
  pointers.reserve(args.size() + rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    pointers.push_back(buffer->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    void* data = (*buffer)->untyped_data();
    bool in_place = std::find(pointers.begin(), pointers.begin() + args.size(), data) !=
                    pointers.begin() + args.size();
    if (poison && !in_place) {
      CUresult s = GetDriver().memset_d8_async(reinterpret_cast<CUdeviceptr>(data), 0xff,
                                               (*buffer)->size_bytes(), stream);
      if (s != kCudaSuccess) return CudaError(s, kernel, "poisoning an output");
    }
    pointers.push_back(data);
  }
  std::vector<int32_t> words(scalars.begin(), scalars.end());
  std::vector<void*> params;
  params.reserve(pointers.size() + words.size());
  for (void*& p : pointers) params.push_back(&p);
  for (int32_t& w : words) params.push_back(&w);

  LaunchAttribute attr{};
  attr.id = kLaunchAttrClusterDimension;
  attr.value.cluster_dim = {static_cast<unsigned>(cluster[0]), static_cast<unsigned>(cluster[1]),
                            static_cast<unsigned>(cluster[2])};
  LaunchConfig config{};
  config.grid_x = static_cast<unsigned>(grid[0]);
  config.grid_y = static_cast<unsigned>(grid[1]);
  config.grid_z = static_cast<unsigned>(grid[2]);
  config.block_x = static_cast<unsigned>(block[0]);
  config.block_y = static_cast<unsigned>(block[1]);
  config.block_z = static_cast<unsigned>(block[2]);
  config.shared_bytes = static_cast<unsigned>(smem);
  config.stream = stream;
  config.attrs = k.cluster_size > 1 ? &attr : nullptr;
  config.num_attrs = k.cluster_size > 1 ? 1 : 0;
  const Driver& d = GetDriver();
  if (CUresult s = d.launch_kernel_ex(&config, function, params.data(), nullptr); s != kCudaSuccess) {
    return CudaError(s, kernel, "cuLaunchKernelEx");
  }
  int capture = 0;
  if (d.stream_is_capturing(stream, &capture) == kCudaSuccess && capture == kStreamCaptureActive) {
    captured_launches.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

template <ffi::ExecutionStage stage>
auto Bind() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<CUstream>>()
      .RemainingArgs()
      .RemainingRets()
      .template Attr<ffi::Span<const uint8_t>>("cubin")
      .template Attr<int64_t>("cubin_hash")
      .template Attr<std::string_view>("kernel")
      .template Attr<ffi::Span<const int64_t>>("grid")
      .template Attr<ffi::Span<const int64_t>>("block")
      .template Attr<ffi::Span<const int64_t>>("cluster")
      .template Attr<int64_t>("smem")
      .template Attr<ffi::Span<const int32_t>>("scalars")
      .template Attr<int64_t>("poison");
}

}  // namespace

// The two stages of the target and a counter, exported for ctypes (the rest is hidden).
#define QUACK_JAX_EXPORT extern "C" __attribute__((visibility("default")))
QUACK_JAX_EXPORT XLA_FFI_Error* QuackJaxLaunchInitialize(XLA_FFI_CallFrame* call_frame);
QUACK_JAX_EXPORT XLA_FFI_Error* QuackJaxLaunch(XLA_FFI_CallFrame* call_frame);

// How many launches so far were recorded into CUDA graphs (XLA command buffers).
QUACK_JAX_EXPORT int64_t QuackJaxCapturedLaunches() { return captured_launches.load(); }

// Sets `count` to how many clusters of (1, cluster_n, 1) CTAs of `threads` threads and
// `smem` bytes of dynamic shared memory the kernel `symbol` of `cubin` runs at once on
// the CUDA device `ordinal` (cuOccupancyMaxActiveClusters: it knows how the device's SMs
// are grouped, which a count of SMs does not). Returns 0, or 1 with the reason in `error`.
QUACK_JAX_EXPORT int QuackJaxMaxActiveClusters(const void* cubin, const char* symbol, int smem,
                                               int threads, int cluster_n, int ordinal,
                                               int* count, char* error, size_t error_size) {
  const Driver& d = GetDriver();
  std::string message;
  if (!d.error.empty()) message = "quack_jax kernel " + std::string(symbol) + ": " + d.error;
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  CUmodule module = nullptr;
  auto check = [&](CUresult s, const char* what) {
    if (s != kCudaSuccess && message.empty()) message = CudaMessage(s, symbol, what);
    return message.empty();
  };
  bool retained = message.empty() && check(d.init(0), "cuInit") &&
                  check(d.device_get(&device, ordinal), "cuDeviceGet") &&
                  check(d.primary_ctx_retain(&ctx, device), "cuDevicePrimaryCtxRetain");
  if (retained && check(d.ctx_push(ctx), "cuCtxPushCurrent")) {
    CUfunction function = nullptr;
    LaunchAttribute attr{};
    attr.id = kLaunchAttrClusterDimension;
    attr.value.cluster_dim = {1, static_cast<unsigned>(cluster_n), 1};
    LaunchConfig config{};
    config.grid_x = 1;
    config.grid_y = static_cast<unsigned>(cluster_n);
    config.grid_z = 1;
    config.block_x = static_cast<unsigned>(threads);
    config.block_y = 1;
    config.block_z = 1;
    config.shared_bytes = static_cast<unsigned>(smem);
    config.attrs = &attr;
    config.num_attrs = 1;
    check(d.module_load_data(&module, cubin), "cuModuleLoadData") &&
        check(d.module_get_function(&function, module, symbol), "cuModuleGetFunction") &&
        check(d.func_set_attribute(function, kFuncAttrMaxDynamicSharedBytes, smem),
              "raising the shared memory limit") &&
        check(d.func_set_attribute(function, kFuncAttrNonPortableClusterSizeAllowed, 1),
              "allowing a non-portable cluster") &&
        check(d.occupancy_max_active_clusters(count, function, &config),
              "cuOccupancyMaxActiveClusters");
    if (module != nullptr) d.module_unload(module);
    CUcontext popped = nullptr;
    d.ctx_pop(&popped);
  }
  if (retained) d.primary_ctx_release(device);
  if (message.empty()) return 0;
  snprintf(error, error_size, "%s", message.c_str());
  return 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuackJaxLaunchInitialize, Initialize,
                              Bind<ffi::ExecutionStage::kInitialize>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuackJaxLaunch, Execute, Bind<ffi::ExecutionStage::kExecute>(),
                              {ffi::Traits::kCmdBufferCompatible});
