// cubin_load_floor: the physical floor of a warm kernel load, measured with the CUDA driver API.
//
// Why this exists: cute-diskcache turns a multi-second CuTe-DSL compile into a file read plus a
// module load. The load can never be cheaper than the driver's own cuModuleLoadData on the same
// cubin, so the bench reports our warm hit against this number. The program also prints each
// kernel's registers and shared memory, which is the quickest way to see that a reloaded cubin is
// the kernel you meant (same resource usage, same names).
//
// Usage: cubin_load_floor [-n N] [--device D] file.cubin [file2.cubin ...] [-- fn_name ...]
//   -n N        load+unload each cubin N times (default 200) and report the median
//   --device D  CUDA device ordinal (default 0)
//   -- names    function names to look up when the driver cannot enumerate functions
//               (cuModuleEnumerateFunctions needs CUDA 12.4+)
//
// libcuda is opened with dlopen and every entry point is resolved through cuGetProcAddress, so
// the program builds with nothing but cuda.h and a C++17 compiler, and a machine without a driver
// gets a clean error instead of a link failure. A cubin the device cannot run (an sm_120 cubin on
// an sm_90 GPU, for example) is reported as FAIL with the driver's error name; the exit status is
// then 2, so a script can tell "every cubin loaded" from "some were refused".

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

// Driver entry points, resolved at run time.
struct Driver {
  CUresult (*Init)(unsigned int) = nullptr;
  CUresult (*DriverGetVersion)(int*) = nullptr;
  CUresult (*DeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*DeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*DeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*CtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleUnload)(CUmodule) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*ModuleGetFunctionCount)(unsigned int*, CUmodule) = nullptr;                 // 12.4+
  CUresult (*ModuleEnumerateFunctions)(CUfunction*, unsigned int, CUmodule) = nullptr;   // 12.4+
  CUresult (*FuncGetName)(const char**, CUfunction) = nullptr;                           // 12.3+
  CUresult (*FuncGetAttribute)(int*, CUfunction_attribute, CUfunction) = nullptr;
  CUresult (*GetErrorName)(CUresult, const char**) = nullptr;
};

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

template <typename T>
bool resolve(void* lib, GetProcAddressFn gpa, const char* name, T& out) {
  void* p = nullptr;
  if (gpa != nullptr) {
    CUdriverProcAddressQueryResult status{};
    if (gpa(name, &p, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS) p = nullptr;
  }
  if (p == nullptr) p = dlsym(lib, name);
  out = reinterpret_cast<T>(p);
  return p != nullptr;
}

bool load_driver(Driver& d, std::string& why) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    why = std::string("cannot dlopen libcuda.so.1: ") + dlerror();
    return false;
  }
  auto gpa = reinterpret_cast<GetProcAddressFn>(dlsym(lib, "cuGetProcAddress_v2"));
  bool ok = resolve(lib, gpa, "cuInit", d.Init) && resolve(lib, gpa, "cuDriverGetVersion", d.DriverGetVersion) &&
            resolve(lib, gpa, "cuDeviceGet", d.DeviceGet) && resolve(lib, gpa, "cuDeviceGetName", d.DeviceGetName) &&
            resolve(lib, gpa, "cuDeviceGetAttribute", d.DeviceGetAttribute) &&
            resolve(lib, gpa, "cuDevicePrimaryCtxRetain", d.DevicePrimaryCtxRetain) &&
            resolve(lib, gpa, "cuCtxSetCurrent", d.CtxSetCurrent) && resolve(lib, gpa, "cuModuleLoadData", d.ModuleLoadData) &&
            resolve(lib, gpa, "cuModuleUnload", d.ModuleUnload) && resolve(lib, gpa, "cuModuleGetFunction", d.ModuleGetFunction) &&
            resolve(lib, gpa, "cuFuncGetAttribute", d.FuncGetAttribute) && resolve(lib, gpa, "cuGetErrorName", d.GetErrorName);
  if (!ok) {
    why = "libcuda.so.1 lacks a required entry point";
    return false;
  }
  // Optional: only used when present.
  resolve(lib, gpa, "cuModuleGetFunctionCount", d.ModuleGetFunctionCount);
  resolve(lib, gpa, "cuModuleEnumerateFunctions", d.ModuleEnumerateFunctions);
  resolve(lib, gpa, "cuFuncGetName", d.FuncGetName);
  return true;
}

const Driver* g_drv = nullptr;

std::string err_name(CUresult r) {
  const char* s = nullptr;
  if (g_drv != nullptr && g_drv->GetErrorName(r, &s) == CUDA_SUCCESS && s != nullptr) return s;
  return "CUresult " + std::to_string(static_cast<int>(r));
}

double now_us() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::micro>(clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int func_attr(const Driver& d, CUfunction f, CUfunction_attribute a) {
  int v = -1;
  if (d.FuncGetAttribute(&v, a, f) != CUDA_SUCCESS) return -1;
  return v;
}

void print_function(const Driver& d, CUfunction f, const std::string& name) {
  std::printf("  function %s\n", name.c_str());
  std::printf("    registers=%d static_smem=%d max_dynamic_smem=%d local_bytes=%d const_bytes=%d max_threads=%d sass=%d ptx=%d\n",
              func_attr(d, f, CU_FUNC_ATTRIBUTE_NUM_REGS), func_attr(d, f, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
              func_attr(d, f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), func_attr(d, f, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
              func_attr(d, f, CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES), func_attr(d, f, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
              func_attr(d, f, CU_FUNC_ATTRIBUTE_BINARY_VERSION), func_attr(d, f, CU_FUNC_ATTRIBUTE_PTX_VERSION));
}

// Returns true when the cubin loaded. Prints one block per cubin.
bool measure(const Driver& d, const std::string& path, int reps, const std::vector<std::string>& names) {
  double t0 = now_us();
  std::ifstream in(path, std::ios::binary);
  std::vector<char> image((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  double read_us = now_us() - t0;
  if (!in.good() && !in.eof()) {
    std::printf("cubin %s\n  FAIL read error\n", path.c_str());
    return false;
  }
  std::printf("cubin %s bytes=%zu file_read_us=%.1f\n", path.c_str(), image.size(), read_us);

  CUmodule mod = nullptr;
  CUresult r = d.ModuleLoadData(&mod, image.data());
  if (r != CUDA_SUCCESS) {
    std::printf("  FAIL cuModuleLoadData -> %s (%d)\n", err_name(r).c_str(), static_cast<int>(r));
    return false;
  }
  d.ModuleUnload(mod);

  std::vector<double> load_us, load_get_us;
  for (int i = 0; i < reps; ++i) {
    double a = now_us();
    d.ModuleLoadData(&mod, image.data());
    double b = now_us();
    d.ModuleUnload(mod);
    load_us.push_back(b - a);
  }

  // Load once more and keep it for function inspection.
  d.ModuleLoadData(&mod, image.data());
  std::vector<std::pair<CUfunction, std::string>> funcs;
  unsigned int count = 0;
  if (d.ModuleGetFunctionCount != nullptr && d.ModuleEnumerateFunctions != nullptr &&
      d.ModuleGetFunctionCount(&count, mod) == CUDA_SUCCESS && count > 0) {
    std::vector<CUfunction> fs(count);
    if (d.ModuleEnumerateFunctions(fs.data(), count, mod) == CUDA_SUCCESS) {
      for (CUfunction f : fs) {
        const char* n = nullptr;
        std::string name = (d.FuncGetName != nullptr && d.FuncGetName(&n, f) == CUDA_SUCCESS && n) ? n : "?";
        funcs.emplace_back(f, name);
      }
    }
  }
  if (funcs.empty()) {
    for (const auto& n : names) {
      CUfunction f = nullptr;
      if (d.ModuleGetFunction(&f, mod, n.c_str()) == CUDA_SUCCESS) funcs.emplace_back(f, n);
    }
  }
  d.ModuleUnload(mod);

  // Load + resolve every function: what a first launch needs before it can run.
  for (int i = 0; i < reps; ++i) {
    double a = now_us();
    d.ModuleLoadData(&mod, image.data());
    for (const auto& fn : funcs) {
      CUfunction f = nullptr;
      d.ModuleGetFunction(&f, mod, fn.second.c_str());
    }
    double b = now_us();
    d.ModuleUnload(mod);
    load_get_us.push_back(b - a);
  }
  std::sort(load_us.begin(), load_us.end());
  std::printf("  load_us median=%.1f min=%.1f p90=%.1f reps=%d  load_and_get_functions_us median=%.1f\n", median(load_us),
              load_us.front(), load_us[static_cast<size_t>(0.9 * (load_us.size() - 1))], reps, median(load_get_us));

  d.ModuleLoadData(&mod, image.data());
  std::printf("  functions=%zu\n", funcs.size());
  for (const auto& fn : funcs) {
    CUfunction f = nullptr;
    if (d.ModuleGetFunction(&f, mod, fn.second.c_str()) == CUDA_SUCCESS) print_function(d, f, fn.second);
  }
  d.ModuleUnload(mod);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 200, device = 0;
  std::vector<std::string> files, names;
  bool in_names = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (in_names) {
      names.push_back(a);
    } else if (a == "--") {
      in_names = true;
    } else if (a == "-n" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--device" && i + 1 < argc) {
      device = std::atoi(argv[++i]);
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: %s [-n N] [--device D] file.cubin ... [-- function_name ...]\n", argv[0]);
      return 0;
    } else {
      files.push_back(a);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "no cubin given (try --help)\n");
    return 1;
  }

  static Driver d;
  std::string why;
  if (!load_driver(d, why)) {
    std::fprintf(stderr, "no CUDA driver: %s\n", why.c_str());
    return 3;
  }
  g_drv = &d;
  CUresult r = d.Init(0);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuInit failed: %s\n", err_name(r).c_str());
    return 3;
  }
  CUdevice dev;
  CUcontext ctx;
  if ((r = d.DeviceGet(&dev, device)) != CUDA_SUCCESS || (r = d.DevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS ||
      (r = d.CtxSetCurrent(ctx)) != CUDA_SUCCESS) {
    std::fprintf(stderr, "device %d unusable: %s\n", device, err_name(r).c_str());
    return 3;
  }
  char name[256] = {0};
  d.DeviceGetName(name, sizeof(name) - 1, dev);
  int major = 0, minor = 0, sms = 0, drv = 0;
  d.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  d.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  d.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  d.DriverGetVersion(&drv);
  std::printf("device %d: %s sm_%d%d sms=%d driver_cuda=%d.%d built_with_cuda=%d.%d reps=%d\n", device, name, major, minor, sms,
              drv / 1000, (drv % 1000) / 10, CUDA_VERSION / 1000, (CUDA_VERSION % 1000) / 10, reps);

  int failed = 0;
  for (const auto& f : files) failed += measure(d, f, reps, names) ? 0 : 1;
  std::printf("summary loaded=%zu failed=%d\n", files.size() - failed, failed);
  return failed ? 2 : 0;
}
