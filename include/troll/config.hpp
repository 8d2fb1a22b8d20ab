// troll/config.hpp — version, ABI namespace and the host/device annotation.
// Every other troll header includes this one first.
#pragma once

#define TROLL_VERSION_MAJOR 0
#define TROLL_VERSION_MINOR 1
#define TROLL_VERSION_PATCH 0
#define TROLL_VERSION (TROLL_VERSION_MAJOR * 10000 + TROLL_VERSION_MINOR * 100 + TROLL_VERSION_PATCH)

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
