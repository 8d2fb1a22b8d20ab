// troll/detail/cpu/parallel.hpp — a minimal parallel loop over rows for the CPU backend.
// Threads are started per call (no pool, no global state); small batches run inline.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "../../config.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// Calls body(i) for i in [0, n). `work_per_item` (≈ elements touched) decides whether threads
/// pay off; `threads == 0` uses every hardware thread. Rows are handed out in small chunks so
/// uneven rows balance. An exception from body is rethrown in the caller after all threads join.
template <class Body>
void parallel_for(unsigned threads, std::size_t n, std::size_t work_per_item, Body&& body) {
  constexpr std::size_t min_work_per_thread = std::size_t(1) << 16;
  // hardware_concurrency() reads /sys on every call; ask once per process.
  static const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  const unsigned hw = threads != 0 ? threads : hardware;
  const std::size_t total = n * std::max<std::size_t>(work_per_item, 1);
  const std::size_t useful = std::max<std::size_t>(1, total / min_work_per_thread);
  const unsigned count = static_cast<unsigned>(std::min<std::size_t>({hw, n, useful}));
  if (count <= 1) {
    for (std::size_t i = 0; i < n; ++i) body(i);
    return;
  }
  const std::size_t chunk = std::max<std::size_t>(1, n / (std::size_t(count) * 8));
  std::atomic<std::size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto worker = [&] {
    try {
      for (;;) {
        const std::size_t begin = next.fetch_add(chunk);
        if (begin >= n) return;
        const std::size_t end = std::min(n, begin + chunk);
        for (std::size_t i = begin; i < end; ++i) body(i);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next.store(n);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(count - 1);
  for (unsigned k = 1; k < count; ++k) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
}

/// Runs check(i) → bool (true = row i is bad) over all rows in parallel and returns the smallest
/// bad row, or n when every row is fine. Deterministic whatever the thread count.
template <class Check>
std::size_t first_bad_row(unsigned threads, std::size_t n, std::size_t work_per_item, Check&& check) {
  std::atomic<std::size_t> first{n};
  parallel_for(threads, n, work_per_item, [&](std::size_t i) {
    if (i >= first.load(std::memory_order_relaxed)) return;
    if (check(i)) {
      std::size_t seen = first.load();
      while (i < seen && !first.compare_exchange_weak(seen, i)) {
      }
    }
  });
  return first.load();
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
