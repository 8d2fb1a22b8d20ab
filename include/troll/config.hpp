// troll/config.hpp — version, ABI namespace and the host/device annotation.
// Every other troll header includes this one first.
#pragma once

#define TROLL_VERSION_MAJOR 0
#define TROLL_VERSION_MINOR 1
#define TROLL_VERSION_PATCH 0
#define TROLL_VERSION (TROLL_VERSION_MAJOR * 10000 + TROLL_VERSION_MINOR * 100 + TROLL_VERSION_PATCH)

// troll's contract rests on IEEE infinities and NaNs: −inf is a masked token, and NaN or +inf input
// must be detected and reported. -ffast-math and -ffinite-math-only let the compiler assume that
// neither occurs, so the checks fold away and the masks break (a consumer built with them read
// past a row on valid input); -fassociative-math (in -funsafe-math-optimizations, and left on by
// -ffast-math -fno-finite-math-only) lets it fold the x − x == 0 finiteness tests to true, so NaN
// input is projected and masks come out as −DBL_MAX. Such a translation unit is refused (GCC and
// Clang announce both with a macro; Clang's -fno-honor-nans does not, and is not supported);
// compile the code that includes troll without them (or define TROLL_ALLOW_FINITE_MATH, and with
// it give up every guarantee).
#if ((defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__) || defined(__ASSOCIATIVE_MATH__)) && \
    !defined(TROLL_ALLOW_FINITE_MATH)
#  error "troll needs IEEE infinities and NaNs: compile this file without -ffast-math / -ffinite-math-only / -funsafe-math-optimizations / -fassociative-math (masked tokens are -inf, and bad input is found by its NaN or inf)"
#endif

// Functions callable from host code and from CUDA kernels. Per-row maths is written once with
// this marker, free of std containers, exceptions and allocation.
#if defined(__CUDACC__) || defined(__HIPCC__)
#  define TROLL_HOST_DEVICE __host__ __device__
#else
#  define TROLL_HOST_DEVICE
#endif

// Inline ABI namespace: two troll versions linked into one program never share symbols.
#define TROLL_BEGIN_NAMESPACE \
  namespace troll {           \
  inline namespace v0 {
#define TROLL_END_NAMESPACE \
  }                         \
  }

TROLL_BEGIN_NAMESPACE

/// Library version as {major, minor, patch}.
struct version_info {
  int major, minor, patch;
};
inline constexpr version_info version{TROLL_VERSION_MAJOR, TROLL_VERSION_MINOR, TROLL_VERSION_PATCH};

TROLL_END_NAMESPACE
