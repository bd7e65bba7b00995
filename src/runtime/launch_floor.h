// The driver's own cost of one kernel launch on this host: an empty kernel
// whose argument block is the size of the seed chain's (four pointers, one
// size, one stride), launched back to back from C++ with nothing else in
// the loop. The launch bench reports it beside opfuse's call path so that
// the 5 us per fused kernel target can be read against what no launcher
// can go below.
#pragma once
#include <cstdint>
#include <string>

namespace opfuse {

// CUDA C++ of the empty kernel (self-contained, like every generated one).
const std::string& launch_floor_source();

// Launches the empty kernel `launches` times on `stream` of the current
// context's device and returns the host nanoseconds the loop took (no
// synchronisation inside; the caller synchronises between batches). The
// first call compiles the kernel with NVRTC and loads it.
int64_t time_empty_launches(uintptr_t stream, int launches);

}  // namespace opfuse
