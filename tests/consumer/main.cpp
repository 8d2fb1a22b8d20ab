// A consumer of the installed (or vendored) troll: it includes the public header, names a
// policy, prints the version and runs one projection. With TROLL_CONSUMER_EVERY_ENTRY_POINT
// (the find_package mode, i.e. the installed headers) it runs instead a training step written
// once over the policy and the element type (every_entry_point.hpp) under troll::cpu, in double
// and float; tests/test_one_api.cpp runs the
// same step from the source tree, so the other modes only check that the package is found and
// links. With find_package, the package version must match the header.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <troll/projection.hpp>

#ifdef TROLL_CONSUMER_EVERY_ENTRY_POINT
#include "every_entry_point.hpp"
#endif

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
#ifdef TROLL_CONSUMER_EVERY_ENTRY_POINT
  const consumer::step_results step = consumer::run_every_entry_point(policy);
  std::printf("one step over every entry point: TROLL loss %.6f, sparse TROLL loss %.6f\n", step.troll_loss,
              step.sparse_troll_loss);
  if (!std::isfinite(step.troll_loss) || !std::isfinite(step.sparse_troll_loss)) return 1;
  // The same step in float: every entry point instantiated for both element types.
  const consumer::step_results single = consumer::run_every_entry_point<troll::cpu_policy, float>(policy);
  std::printf("the same step in float: TROLL loss %.6f, sparse TROLL loss %.6f\n", single.troll_loss,
              single.sparse_troll_loss);
  if (!std::isfinite(single.troll_loss) || !std::isfinite(single.sparse_troll_loss)) return 1;
#else
  // One row of four tokens moved away from the old one, projected onto KL <= 0.01.
  const float new_logits[4] = {2.0f, 0.0f, -1.0f, 0.5f};
  const float old_logits[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float log_probs[4];
  troll::projection_stats stats[1];
  troll::project(policy, troll::make_batch(new_logits, 1, 4), troll::make_batch(old_logits, 1, 4),
                 0.01, troll::make_batch(log_probs, 1, 4), stats);
  std::printf("one row: %s, KL %.6f -> %.6f\n", troll::status_name(stats[0].status),
              stats[0].kl_before, stats[0].kl_after);
  if (stats[0].status != troll::row_status::projected || !(stats[0].kl_after <= 0.01 * (1 + 1e-6)))
    return 1;
#endif
  return 0;
}
