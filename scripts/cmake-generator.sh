# Sourced by scripts/test.sh, scripts/arch-test.sh and scripts/gpu-verify.sh (not run on its own).
# troll_generator_for DIR prints "-G Ninja" where ninja is installed (scripts/install-deps.sh
# adds it) and DIR is new or was configured with Ninja; otherwise nothing, so that a build
# directory made earlier with another generator keeps it (CMake refuses to switch). Ninja keeps
# every core busy across targets, where the Makefiles build several --target names one after
# another and idle between them (the release build: 1,105 s against 1,177 s on the 2-core VM;
# arch-test's one-file targets: ~5 min of CI with Makefiles).
troll_generator_for() {
  if command -v ninja >/dev/null 2>&1 &&
     { [ ! -f "$1/CMakeCache.txt" ] || grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$1/CMakeCache.txt"; }; then
    echo "-G Ninja"
  fi
}
