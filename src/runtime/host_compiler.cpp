#include "runtime/host_compiler.h"

#include <dlfcn.h>
#include <elf.h>
#include <cstring>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include "runtime/compile_cache.h"
#include "runtime/hash.h"

extern char** environ;

namespace opfuse {
namespace {

// Runs argv, returns its exit status; stdout and stderr go to `log_path`.
int run_process(const std::vector<std::string>& argv, const std::string& log_path) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string capture(const std::vector<std::string>& argv) {
  char tmpl[] = "/tmp/opfuse-probe-XXXXXX";
  int fd = mkstemp(tmpl);
  if (fd < 0) return "";
  close(fd);
  int rc = run_process(argv, tmpl);
  bool ok = false;
  std::string s = read_file(tmpl, &ok);
  std::remove(tmpl);
  return rc == 0 ? s : "";
}

}  // namespace

const HostCompiler& host_compiler() {
  static const HostCompiler hc = [] {
    HostCompiler c;
    const char* cxx = std::getenv("OPFUSE_CXX");
    c.command = cxx && *cxx ? cxx : "c++";
    // -fwrapv: integer overflow wraps as in PyTorch; -fno-math-errno lets
    // sqrt and friends vectorise without changing results; -fno-trapping-math
    // lets selects (relu, max) become vector blends (no FP traps are used).
    c.flags = {"-std=c++17", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno", "-fno-trapping-math", "-w"};
    // Generated kernels compute half types in float, so AVX512-FP16's half
    // arithmetic buys nothing; and GCC (12 to 14.3 at least) emits masked
    // scalar `vmovsh` forms that the assembler rejects ("unsupported masking
    // for `vmovsh'") for some float16 kernels on CPUs that have it (IR fuzz
    // seed 3303, graph 170). Without it GCC converts with F16C instead,
    // packed (vcvtph2ps/vcvtps2ph). Only where -march=native turns it on:
    // a compiler that defines the macro knows the flag.
    std::string native_macros = capture({c.command, "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"});
    if (native_macros.find("__AVX512FP16__") != std::string::npos) c.flags.push_back("-mno-avx512fp16");
    std::string version = capture({c.command, "--version"});
    if (version.empty()) version = "unknown";
    bool ok = false;
    std::string cpu = read_file("/proc/cpuinfo", &ok);
    std::string model;
    if (auto p = cpu.find("model name"); p != std::string::npos) model = cpu.substr(p, cpu.find('\n', p) - p);
    if (auto p = cpu.find("flags"); p != std::string::npos) model += cpu.substr(p, cpu.find('\n', p) - p);
    c.identity = version + "|" + content_hash(model);
    return c;
  }();
  return hc;
}

void compile_shared_object(const std::string& source, const std::string& out_path) {
  const HostCompiler& hc = host_compiler();
  std::string src_path = out_path + ".cpp";
  {
    std::ofstream f(src_path);
    f << source;
    if (!f) throw std::runtime_error("cannot write " + src_path);
  }
  std::vector<std::string> argv = {hc.command};
  argv.insert(argv.end(), hc.flags.begin(), hc.flags.end());
  argv.insert(argv.end(), {src_path, "-o", out_path, "-lmvec", "-lm"});
  std::string log_path = out_path + ".log";
  int rc = run_process(argv, log_path);
  bool ok = false;
  std::string log = read_file(log_path, &ok);
  std::remove(log_path.c_str());
  std::remove(src_path.c_str());
  if (rc != 0) {
    if (rc == -1 && log.empty()) log = "could not run '" + hc.command + "'";
    throw std::runtime_error("host compiler failed (exit " + std::to_string(rc) + "):\n" + log.substr(0, 4000));
  }
}

void* LoadedLibrary::symbol(const std::string& name) const {
  void* p = dlsym(handle, name.c_str());
  if (!p) throw std::runtime_error("symbol " + name + " missing from compiled library");
  return p;
}

namespace {
// dlopen maps a shared object's segments; one cut short kills the process
// with SIGBUS on first touch. Every segment and the section table must lie
// inside the file before it is loaded.
void check_elf_complete(const std::string& path) {
  bool ok = false;
  std::string bytes = read_file(path, &ok);
  auto fail = [&](const char* why) { throw std::runtime_error("cannot load " + path + ": " + why); };
  if (!ok || bytes.size() < sizeof(Elf64_Ehdr)) fail("not a complete ELF file");
  Elf64_Ehdr eh;
  std::memcpy(&eh, bytes.data(), sizeof eh);
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64) fail("not a 64-bit ELF file");
  uint64_t size = bytes.size();
  if (eh.e_phoff + uint64_t(eh.e_phnum) * eh.e_phentsize > size) fail("program headers past the end of the file");
  if (eh.e_shoff + uint64_t(eh.e_shnum) * eh.e_shentsize > size) fail("section headers past the end of the file");
  for (int i = 0; i < eh.e_phnum; ++i) {
    Elf64_Phdr ph;
    std::memcpy(&ph, bytes.data() + eh.e_phoff + uint64_t(i) * eh.e_phentsize, sizeof ph);
    if (ph.p_offset + ph.p_filesz > size) fail("a segment extends past the end of the file (truncated)");
  }
}
}  // namespace

LoadedLibrary load_library(const std::string& path) {
  check_elf_complete(path);
  LoadedLibrary lib;
  lib.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib.handle) {
    const char* e = dlerror();
    throw std::runtime_error(std::string("cannot load ") + path + ": " + (e ? e : "unknown error"));
  }
  return lib;
}

}  // namespace opfuse
