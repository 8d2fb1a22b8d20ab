// A consumer of the installed (or vendored) troll: it includes the public header, names a
// policy, prints the version and runs a training step written once over the policy
// (every_entry_point.hpp) under troll::cpu. With find_package, the package version must match the
// header.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <troll/projection.hpp>

#include "every_entry_point.hpp"

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
  const consumer::step_results step = consumer::run_every_entry_point(policy);
  std::printf("one step over every entry point: TROLL loss %.6f, sparse TROLL loss %.6f\n", step.troll_loss,
              step.sparse_troll_loss);
  if (!std::isfinite(step.troll_loss) || !std::isfinite(step.sparse_troll_loss)) return 1;
  return 0;
}
