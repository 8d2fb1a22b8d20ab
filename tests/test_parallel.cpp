// tests/test_parallel.cpp — the CPU backend's parallel loop on its worker pool: every index runs
// exactly once, whatever the thread count (more than the hardware has included), an exception
// reaches the caller and leaves the pool usable, a loop inside a loop and loops from several
// caller threads all finish, and first_bad_row finds the lowest bad row.
#include <doctest/doctest.h>

#include <atomic>
#include <cstddef>
#include <stdexcept>
#include <thread>
#include <vector>

#include "troll/detail/cpu/parallel.hpp"

namespace cpu = troll::detail::cpu;

namespace {

/// Runs parallel_for over n items and checks each ran exactly once.
void check_each_once(unsigned threads, std::size_t n) {
  std::vector<std::atomic<int>> hits(n);
  for (auto& h : hits) h.store(0);
  cpu::parallel_for(threads, n, std::size_t(1) << 20, [&](std::size_t i) { hits[i].fetch_add(1); });
  for (std::size_t i = 0; i < n; ++i) REQUIRE(hits[i].load() == 1);
}

}  // namespace

TEST_CASE("parallel_for: every index once, for any thread count and many small calls") {
  for (unsigned threads : {0u, 1u, 2u, 3u, 8u})
    for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(2), std::size_t(7), std::size_t(1000)})
      check_each_once(threads, n);
  for (int call = 0; call < 2000; ++call) check_each_once(2, 5);  // the pool is reused, not restarted
}

TEST_CASE("parallel_for: an exception reaches the caller and the pool stays usable") {
  for (int round = 0; round < 20; ++round) {
    CHECK_THROWS_AS(cpu::parallel_for(4, 100, std::size_t(1) << 20,
                                      [&](std::size_t i) {
                                        if (i == 37) throw std::runtime_error("row 37");
                                      }),
                    std::runtime_error);
    check_each_once(4, 100);
  }
}

TEST_CASE("parallel_for: nested loops and concurrent callers finish") {
  std::atomic<long> total{0};
  cpu::parallel_for(4, 8, std::size_t(1) << 20, [&](std::size_t) {
    cpu::parallel_for(4, 8, std::size_t(1) << 20, [&](std::size_t) { total.fetch_add(1); });
  });
  CHECK(total.load() == 64);
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int call = 0; call < 200; ++call) {
        std::atomic<int> sum{0};
        cpu::parallel_for(3, 16, std::size_t(1) << 20, [&](std::size_t i) { sum.fetch_add(int(i)); });
        if (sum.load() != 120) failures.fetch_add(1);
      }
    });
  for (auto& t : callers) t.join();
  CHECK(failures.load() == 0);
}

TEST_CASE("first_bad_row: the lowest bad row, or n") {
  for (unsigned threads : {1u, 2u, 4u}) {
    CHECK(cpu::first_bad_row(threads, 1000, std::size_t(1) << 20, [](std::size_t i) { return i % 97 == 96; }) == 96);
    CHECK(cpu::first_bad_row(threads, 1000, std::size_t(1) << 20, [](std::size_t) { return false; }) == 1000);
  }
}
