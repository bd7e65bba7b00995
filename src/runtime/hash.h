// A stable 128-bit content hash (two FNV-1a lanes) for cache keys. Not
// cryptographic: it names cache entries, and a sidecar checksum guards them.
#pragma once
#include <string>

namespace opfuse {
std::string content_hash(const std::string& data);
}
