// tests/support/backend.hpp — the tiny memory helper that lets one test body run on every
// backend: backend<Policy>::policy() and backend<Policy>::buffer<E> (get(), download()). The CPU's
// is here; the CUDA one (device_array underneath) is in cuda_support.cuh.
#pragma once

#include <cstddef>
#include <vector>

#include <troll/execution.hpp>

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
    E* get() { return host_.data(); }
    std::vector<E> download() const { return host_; }

   private:
    std::vector<E> host_;
  };
};

}  // namespace troll_test
