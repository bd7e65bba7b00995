// Transparent huge pages for the large buffers a CPU run writes.
//
// A fresh 64 MB output from PyTorch's CPU allocator is a new mapping whose
// first write faults once per 4 KB page; on the development VM those 16K
// faults cost more than the kernel (softmax over 4096x4096 float32: ~45 of
// ~55 ms). Advising the mapping's 2 MB-aligned interior to use huge pages
// before the kernel writes it makes that 32 faults. PyTorch can do the same
// for all its allocations with THP_MEM_ALLOC_ENABLE=1; this does it for the
// buffers opfuse writes, whatever the process's setting.
#pragma once
#include <cstddef>

namespace opfuse {

// Buffers smaller than this are never advised (two huge pages).
inline constexpr size_t kHugePagesMinBytes = size_t{4} << 20;

// False when OPFUSE_HUGE_PAGES=0.
bool huge_pages_enabled();

// Advice only: a no-op where the OS has no transparent huge pages, for
// buffers under kHugePagesMinBytes, or when OPFUSE_HUGE_PAGES=0.
void advise_huge_pages(void* p, size_t bytes);

}  // namespace opfuse
