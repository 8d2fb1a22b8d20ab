// Compiled by the finite_math_refused test with -ffinite-math-only: troll must refuse it with its
// own message (include/troll/config.hpp) instead of building code whose checks fold away.
#include <troll/projection.hpp>

int main() { return 0; }
