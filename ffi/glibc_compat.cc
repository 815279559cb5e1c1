// Keeps libquack_jax_ffi.so loadable on glibc 2.17 when it is built against a newer glibc
// (x86_64 wheels, manylinux_2_17; see setup.py).
//
// setup.py links libstdc++ statically and passes -Wl,--wrap=SYMBOL for each symbol below,
// so the launcher's and libstdc++'s references to SYMBOL land on __wrap_SYMBOL here. Each
// calls the symbol's oldest x86_64 version (GLIBC_2.2.5, which glibc keeps for old
// binaries) instead of the one a newer glibc makes the default (GLIBC_2.34 for the libdl
// and libpthread functions, which moved into libc there).

#include <dlfcn.h>
#include <pthread.h>

#define OLDEST(name) __asm__(".symver " #name "_2_2_5, " #name "@GLIBC_2.2.5")

OLDEST(dlopen);
OLDEST(dlsym);
OLDEST(dlerror);
OLDEST(pthread_once);

extern "C" {

void* dlopen_2_2_5(const char* file, int mode);
void* dlsym_2_2_5(void* handle, const char* name);
char* dlerror_2_2_5();
int pthread_once_2_2_5(pthread_once_t* once, void (*init)());

void* __wrap_dlopen(const char* file, int mode) { return dlopen_2_2_5(file, mode); }
void* __wrap_dlsym(void* handle, const char* name) { return dlsym_2_2_5(handle, name); }
char* __wrap_dlerror() { return dlerror_2_2_5(); }
int __wrap_pthread_once(pthread_once_t* once, void (*init)()) {
  return pthread_once_2_2_5(once, init);
}

// glibc 2.32's flag that lets libstdc++ skip atomic reference counts in single-threaded
// processes; older glibc lacks it. Zero: always count atomically, which is always correct.
char __wrap___libc_single_threaded = 0;
}
