// The cache entry format of the hand-written kernels' programs
// (pack_named_cubin / unpack_named_cubin): a round trip, and every damaged
// or foreign entry refused, so the launchers rebuild instead of loading
// garbage.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/nvrtc_named.h"

namespace opfuse {
namespace {

constexpr const char kMagic[] = "opfuse-test-cubin\n";

TEST(NamedCubinCache, RoundTrip) {
  const std::vector<std::string> names = {"_Z3fwdv", "_Z3bwdv", "_Z4convv"};
  const std::string cubin("\x7f" "ELF\0\n\nbinary", 14);
  const std::string bytes = pack_named_cubin(kMagic, names, cubin);
  std::vector<std::string> lowered;
  std::string got;
  ASSERT_TRUE(unpack_named_cubin(bytes, kMagic, names.size(), &lowered, &got));
  EXPECT_EQ(lowered, names);
  EXPECT_EQ(got, cubin);  // newlines and NULs inside the cubin survive
}

TEST(NamedCubinCache, RefusesDamagedOrForeignEntries) {
  const std::string bytes = pack_named_cubin(kMagic, {"_Z1av", "_Z1bv"}, "CUBIN");
  std::vector<std::string> lowered;
  std::string cubin;
  EXPECT_FALSE(unpack_named_cubin(bytes, "opfuse-other-cubin\n", 2, &lowered, &cubin));  // another kind
  EXPECT_FALSE(unpack_named_cubin(bytes.substr(0, 10), kMagic, 2, &lowered, &cubin));     // truncated magic
  EXPECT_FALSE(unpack_named_cubin(pack_named_cubin(kMagic, {"_Z1av", "_Z1bv"}, ""), kMagic, 2, &lowered, &cubin));
  EXPECT_FALSE(unpack_named_cubin(std::string(kMagic) + "_Z1av", kMagic, 2, &lowered, &cubin));  // cut in a name
  EXPECT_FALSE(unpack_named_cubin(std::string(kMagic) + "\nCUBIN", kMagic, 1, &lowered, &cubin));  // empty name
  EXPECT_FALSE(unpack_named_cubin("", kMagic, 1, &lowered, &cubin));
}

}  // namespace
}  // namespace opfuse
