// troll/detail/cpu/parallel.hpp — the parallel loop over rows of the CPU backend, on a pool of
// worker threads started once per process (on the first call that wants more than one thread)
// and parked between calls, so that small batches do not pay for starting threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "../../config.hpp"

TROLL_BEGIN_NAMESPACE
namespace detail {
namespace cpu {

/// Parked worker threads that run one job at a time: run(helpers, job) has `helpers` workers
/// call job() while the caller calls it too, and returns when all have returned. One caller at a
/// time: a second caller (another thread, or a job that itself calls parallel_for) gets false
/// from try_run and runs its loop alone, as does a process forked from the one that made the
/// pool, and a call whose first worker cannot be started. Workers are added on demand and joined
/// at exit; a forked child leaves the parent's (which it does not have) alone at its exit.
class worker_pool {
 public:
  static worker_pool& instance() {
    static worker_pool pool;
    return pool;
  }

  worker_pool() = default;
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;
  ~worker_pool() {
    if (forked()) {
      // A child inherits the parent's mutex, condition variables and thread handles but not its
      // threads: destroying a condition variable that still counts their waits blocks for ever,
      // and a joinable std::thread terminates. Left as they are (reachable, for leak checkers);
      // the process is ending.
      [[maybe_unused]] static synchronised* left_behind = nullptr;
      left_behind = sync_.release();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(sync_->mutex);
      stopping_ = true;
    }
    sync_->wake.notify_all();
    for (auto& w : sync_->workers) w.join();
  }

  /// Runs job() on the caller and on up to `helpers` workers; false (nothing run) when the pool
  /// is busy or no worker could be started. job must not throw.
  template <class Job>
  bool try_run(unsigned helpers, Job& job) {
    if (forked()) return false;  // a child process has none of the parent's threads
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true)) return false;
    {
      std::lock_guard<std::mutex> lock(sync_->mutex);
      std::vector<std::thread>& workers = sync_->workers;
      try {
        while (workers.size() < helpers) {
          const unsigned id = static_cast<unsigned>(workers.size());
          workers.emplace_back([this, id] { work(id); });
        }
      } catch (...) {  // no more threads (a resource limit): run with the workers there are
        if (workers.empty()) {
          busy_.store(false);
          return false;
        }
        helpers = static_cast<unsigned>(workers.size());
      }
      job_ = &job;
      call_ = [](void* j) { (*static_cast<Job*>(j))(); };
      helpers_ = helpers;
      pending_ = helpers;
      ++generation_;
    }
    sync_->wake.notify_all();
    job();
    std::unique_lock<std::mutex> lock(sync_->mutex);
    sync_->done.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    busy_.store(false);
    return true;
  }

 private:
  void work(unsigned id) {
    unsigned long long seen = 0;
    std::unique_lock<std::mutex> lock(sync_->mutex);
    for (;;) {
      sync_->wake.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (id >= helpers_) continue;  // not needed for this job
      void* job = job_;
      void (*call)(void*) = call_;
      lock.unlock();
      call(job);
      lock.lock();
      if (--pending_ == 0) sync_->done.notify_one();
    }
  }

#if defined(__unix__) || defined(__APPLE__)
  bool forked() const { return ::getpid() != owner_pid_; }
  const pid_t owner_pid_ = ::getpid();
#else
  bool forked() const { return false; }
#endif
  /// What the threads share, on the heap so that a forked child can leave it undestroyed.
  struct synchronised {
    std::mutex mutex;  // guards the members of worker_pool below busy_
    std::condition_variable wake, done;
    std::vector<std::thread> workers;
  };
  std::atomic<bool> busy_{false};  // set while one caller's job runs
  std::unique_ptr<synchronised> sync_ = std::make_unique<synchronised>();
  void* job_ = nullptr;
  void (*call_)(void*) = nullptr;
  unsigned helpers_ = 0;
  unsigned pending_ = 0;
  unsigned long long generation_ = 0;
  bool stopping_ = false;
};

/// Calls body(i) for i in [0, n). `work_per_item` (≈ elements touched) decides whether threads
/// pay off; `threads == 0` uses every hardware thread. Rows are handed out in small chunks so
/// uneven rows balance. An exception from body is rethrown in the caller after all threads stop.
template <class Body>
void parallel_for(unsigned threads, std::size_t n, std::size_t work_per_item, Body&& body) {
  constexpr std::size_t min_work_per_thread = std::size_t(1) << 15;
  // hardware_concurrency() reads /sys on every call; ask once per process.
  static const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  const unsigned hw = threads != 0 ? threads : hardware;
  const std::size_t total = n * std::max<std::size_t>(work_per_item, 1);
  const std::size_t useful = std::max<std::size_t>(1, total / min_work_per_thread);
  const unsigned count = static_cast<unsigned>(std::min<std::size_t>({hw, n, useful}));
  auto serial = [&] {
    for (std::size_t i = 0; i < n; ++i) body(i);
  };
  if (count <= 1) return serial();
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
  if (!worker_pool::instance().try_run(count - 1, worker)) return serial();
  if (failure) std::rethrow_exception(failure);
}

/// first = min(first, i), atomically: the lowest row a parallel pass found.
inline void lower_to(std::atomic<std::size_t>& first, std::size_t i) {
  std::size_t seen = first.load();
  while (i < seen && !first.compare_exchange_weak(seen, i)) {
  }
}

/// Runs check(i) → bool (true = row i is bad) over all rows in parallel and returns the smallest
/// bad row, or n when every row is fine. Deterministic whatever the thread count.
template <class Check>
std::size_t first_bad_row(unsigned threads, std::size_t n, std::size_t work_per_item, Check&& check) {
  std::atomic<std::size_t> first{n};
  parallel_for(threads, n, work_per_item, [&](std::size_t i) {
    if (i >= first.load(std::memory_order_relaxed)) return;
    if (check(i)) lower_to(first, i);
  });
  return first.load();
}

/// Runs problem(r) over all rows in parallel (a result that converts to true is a problem) and
/// passes the lowest bad row's problem to `raise`, which throws (naming `fn` and the row).
template <class Problem, class P>
void throw_first_problem(const char* fn, unsigned threads, std::size_t n, std::size_t work_per_item,
                         Problem&& problem, void (*raise)(const char*, std::size_t, const P&)) {
  const std::size_t bad =
      first_bad_row(threads, n, work_per_item, [&](std::size_t r) { return bool(problem(r)); });
  if (bad != n) raise(fn, bad, problem(bad));
}

}  // namespace cpu
}  // namespace detail
TROLL_END_NAMESPACE
