// troll/detail/cpu/eigen.hpp — how the CPU backend includes Eigen. GCC 12's AVX-512 intrinsic
// headers write `__m512d __Y = __Y;` in _mm512_undefined_pd and friends, which GCC 12 itself then
// reports as -Wuninitialized / -Wmaybe-uninitialized at every inlined use (GCC bug 105593, fixed
// in GCC 13), so -march=native on an AVX-512 CPU could not build warning-free. A diagnostic
// pragma applies to the source lines it covers: the intrinsic headers are first read here, inside
// the push / pop, so only their lines are exempt; troll's own code keeps every warning.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <Eigen/Core>
#pragma GCC diagnostic pop
#else
#include <Eigen/Core>
#endif

// The packet kernels that run once per packet of a hot loop (the exponentials): always inlined.
// GCC's size heuristics otherwise leave some of their uses out of line once a header calls them
// from enough places, and a call per packet costs the loop its registers (measured: the dense
// VJP 10% slower when GCC stopped inlining exp_in_range into it).
#if defined(__GNUC__) || defined(__clang__)
#define TROLL_PACKET_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define TROLL_PACKET_INLINE __forceinline
#else
#define TROLL_PACKET_INLINE inline
#endif
