/* LD_PRELOAD helper for device runs without gdb: on SIGSEGV, SIGBUS or
 * SIGABRT print the native stack (glibc's backtrace) to stderr, then die
 * with the same signal. Build: gcc -shared -fPIC -o segv_backtrace.so
 * segv_backtrace.c; resolve the "lib.so(+0x...)" frames with addr2line -f
 * -C -e lib.so 0x... (the library built with -g). */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  const char* msg = "\n== segv_backtrace: native stack ==\n";
  (void)!write(2, msg, strlen(msg));
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, on_signal);
  signal(SIGBUS, on_signal);
  signal(SIGABRT, on_signal);
}
