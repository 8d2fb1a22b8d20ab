// A consumer of the installed (or vendored) troll: it includes the public header, names a
// policy and prints the version. With find_package, the package version must match the header.
#include <cstdio>
#include <cstring>
#include <troll/projection.hpp>

int main() {
  constexpr troll::cpu_policy policy = troll::cpu;
  char version[32];
  std::snprintf(version, sizeof version, "%d.%d.%d", troll::version.major, troll::version.minor,
                troll::version.patch);
  std::printf("troll %s, cpu policy threads=%u\n", version, policy.threads);
#ifdef TROLL_CONSUMER_EXPECT_VERSION
  if (std::strcmp(version, TROLL_CONSUMER_EXPECT_VERSION) != 0) {
    std::printf("package version %s does not match the header's %s\n",
                TROLL_CONSUMER_EXPECT_VERSION, version);
    return 1;
  }
#endif
  return 0;
}
