// tests/test_parallel.cpp — the CPU backend's parallel loop on its worker pool: every index runs
// exactly once, whatever the thread count (more than the hardware has included), an exception
// reaches the caller and leaves the pool usable, a loop inside a loop and loops from several
// caller threads all finish, a process forked after the pool started can exit, a pool whose
// threads cannot start runs its loops alone, and first_bad_row finds the lowest bad row.
#include <doctest/doctest.h>

#include <atomic>
#include <cstddef>
#include <stdexcept>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#endif

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

#if defined(__linux__)
namespace {

/// The exit status of child `pid`, or -1 (the child killed) when it has not ended within 20 s.
int wait_for(pid_t pid) {
  for (int tick = 0; tick < 400; ++tick) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    ::usleep(50000);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

}  // namespace

TEST_CASE("parallel_for: a process forked after the pool started runs its loops alone and exits") {
  check_each_once(3, 1000);  // the pool's workers exist and are parked
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::vector<std::atomic<int>> hits(1000);
    for (auto& h : hits) h.store(0);
    cpu::parallel_for(3, hits.size(), std::size_t(1) << 20, [&](std::size_t i) { hits[i].fetch_add(1); });
    int wrong = 0;
    for (auto& h : hits) wrong += h.load() != 1;
    // exit, not _exit: the static pool's destructor runs in the child (it waited for the
    // parent's threads for ever before the thirty-fifth session)
    std::exit(wrong == 0 ? 0 : 3);
  }
  CHECK(wait_for(pid) == 0);
  check_each_once(3, 1000);  // the parent's pool is untouched
}

// Under the sanitizers a cap on the address space also stops their own allocations.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
TEST_CASE("worker_pool: workers that cannot start leave the loop to the caller and the pool usable") {
  const pid_t pid = ::fork();  // the address-space cap below is the child's alone
  REQUIRE(pid >= 0);
  if (pid == 0) {
    cpu::worker_pool pool;
    std::atomic<int> calls{0};
    auto job = [&] { calls.fetch_add(1); };
    rlimit before{};
    ::getrlimit(RLIMIT_AS, &before);
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    if (pages <= 0) ::_exit(0);  // nothing to cap against: nothing to test
    rlimit capped = before;
    capped.rlim_cur = rlim_t(pages) * rlim_t(::sysconf(_SC_PAGESIZE)) + (rlim_t(1) << 20);  // no room for a stack
    if (::setrlimit(RLIMIT_AS, &capped) != 0) ::_exit(0);
    // Stacks glibc kept from the parent's threads start a few workers; the rest cannot start.
    constexpr unsigned helpers = 64;
    bool ran = true;
    try {
      ran = pool.try_run(helpers, job);
    } catch (...) {
      ::_exit(2);  // the thread's failure escaped (before: std::system_error, and busy for good)
    }
    ::setrlimit(RLIMIT_AS, &before);
    const int first = calls.load();
    if (ran ? !(first >= 1 && first < int(helpers) + 1) : first != 0) ::_exit(3);
    // Not left busy: with room again the next call runs on the caller and every worker.
    if (!pool.try_run(helpers, job) || calls.load() != first + int(helpers) + 1) ::_exit(4);
    ::_exit(0);
  }
  CHECK(wait_for(pid) == 0);
}
#endif
#endif

TEST_CASE("first_bad_row: the lowest bad row, or n") {
  for (unsigned threads : {1u, 2u, 4u}) {
    CHECK(cpu::first_bad_row(threads, 1000, std::size_t(1) << 20, [](std::size_t i) { return i % 97 == 96; }) == 96);
    CHECK(cpu::first_bad_row(threads, 1000, std::size_t(1) << 20, [](std::size_t) { return false; }) == 1000);
  }
}
