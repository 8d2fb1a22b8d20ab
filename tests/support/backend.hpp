// tests/support/backend.hpp — the tiny memory helper that lets one test body run on every
// backend: backend<Policy>::policy() and backend<Policy>::buffer<E> (get(), download()). The CPU's
// is here; the CUDA one (device_array underneath) is in cuda_support.cuh. workspace_policy<Backend,
// Op> is a backend's policy carrying the scratch troll::workspace_bytes asks for.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <troll/execution.hpp>
#include <troll/workspace.hpp>

namespace troll_test {

template <class Policy>
struct backend;

template <>
struct backend<troll::cpu_policy> {
  static troll::cpu_policy policy() { return troll::cpu; }
  template <class E>
  class buffer {
   public:
    explicit buffer(std::size_t n) : host_(n) {}
    explicit buffer(const std::vector<E>& host) : host_(host) {}
    // Takes a temporary's storage (no copy; also keeps GCC 12's -Wfree-nonheap-object false
    // positive off the copy-then-free of vector temporaries in the unity test builds).
    explicit buffer(std::vector<E>&& host) : host_(std::move(host)) {}
    E* get() { return host_.data(); }
    std::vector<E> download() const { return host_; }

   private:
    std::vector<E> host_;
  };
};

/// Backend::policy() with a workspace of the size Op needs for `rows` rows of `cols` (for the
/// Gaussian entry points `cols` is d), held in the backend's memory for this object's lifetime.
template <class Backend, class Op>
class workspace_policy {
 public:
  workspace_policy(std::size_t rows, std::size_t cols)
      : bytes_(troll::workspace_bytes(Backend::policy(), Op{}, rows, cols)), memory_(bytes_ / sizeof(double) + 1) {}
  auto get() { return Backend::policy().with_workspace(memory_.get(), bytes_); }

 private:
  std::size_t bytes_;
  typename Backend::template buffer<double> memory_;
};

}  // namespace troll_test
