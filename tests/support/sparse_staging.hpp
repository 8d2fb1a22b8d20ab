// tests/support/sparse_staging.hpp — host sparse batches (sparse_oracle.hpp's sparse_rows,
// aligned_rows, sparse_grads) staged on a backend of backend.hpp (uploaded on construction,
// downloaded on request), and the sparse project / project_backward run there on host batches:
// what the sparse test bodies (tests/bodies/sparse_gradients.hpp, adversarial_sparse_backward.hpp)
// share.
#pragma once

#include <troll/sparse.hpp>

#include <cstddef>
#include <vector>

#include "sparse_oracle.hpp"

namespace troll_test {

/// A sparse batch staged on the backend.
template <class Backend, class T>
struct staged_sparse {
  template <class E>
  using buffer = typename Backend::template buffer<E>;
  std::size_t rows, k_max, vocab;
  buffer<troll::sparse_index> indices, counts;
  buffer<T> log_probs, log_remainder;
  explicit staged_sparse(const sparse_test::sparse_rows<T>& h)
      : rows(h.rows),
        k_max(h.k_max),
        vocab(h.vocab),
        indices(h.indices),
        counts(h.counts),
        log_probs(h.log_probs),
        log_remainder(h.log_remainder) {}
  troll::sparse_batch_view<T> view() {
    return {indices.get(), log_probs.get(), counts.get(), log_remainder.get(), rows, k_max, vocab};
  }
  troll::sparse_batch_view<const T> input() { return troll::sparse_batch_view<const T>(view()); }
  void download_to(sparse_test::sparse_rows<T>& h) const {
    h.indices = indices.download();
    h.counts = counts.download();
    h.log_probs = log_probs.download();
    h.log_remainder = log_remainder.download();
  }
};

/// An aligned batch staged on the backend.
template <class Backend, class T>
struct staged_aligned {
  template <class E>
  using buffer = typename Backend::template buffer<E>;
  std::size_t rows, k_max, vocab;
  buffer<troll::sparse_index> indices, counts;
  buffer<T> new_lp, old_lp, new_rem, old_rem;
  explicit staged_aligned(const sparse_test::aligned_rows<T>& h)
      : rows(h.rows),
        k_max(h.k_max),
        vocab(h.vocab),
        indices(h.indices),
        counts(h.counts),
        new_lp(h.new_log_probs),
        old_lp(h.old_log_probs),
        new_rem(h.new_log_remainder),
        old_rem(h.old_log_remainder) {}
  troll::aligned_batch_view<T> view() {
    return {indices.get(), counts.get(), new_lp.get(), old_lp.get(), new_rem.get(),
            old_rem.get(), rows,         k_max,        vocab};
  }
  troll::aligned_batch_view<const T> input() { return troll::aligned_batch_view<const T>(view()); }
  void download_to(sparse_test::aligned_rows<T>& h) const {
    h.indices = indices.download();
    h.counts = counts.download();
    h.new_log_probs = new_lp.download();
    h.old_log_probs = old_lp.download();
    h.new_log_remainder = new_rem.download();
    h.old_log_remainder = old_rem.download();
  }
};

/// Sparse gradients staged on the backend.
template <class Backend, class T>
struct staged_grads {
  template <class E>
  using buffer = typename Backend::template buffer<E>;
  std::size_t rows, k_max;
  buffer<T> log_probs, log_remainder;
  explicit staged_grads(const sparse_test::sparse_grads<T>& h)
      : rows(h.rows), k_max(h.k_max), log_probs(h.log_probs), log_remainder(h.log_remainder) {}
  troll::sparse_grad_view<T> view() { return {log_probs.get(), log_remainder.get(), rows, k_max}; }
  troll::sparse_grad_view<const T> input() { return troll::sparse_grad_view<const T>(view()); }
  void download_to(sparse_test::sparse_grads<T>& h) const {
    h.log_probs = log_probs.download();
    h.log_remainder = log_remainder.download();
  }
};

/// The backend's sparse project of host aligned rows into host `out` and `stats`.
template <class Backend, class T>
void project_on(const sparse_test::aligned_rows<T>& rows, double eps,
                sparse_test::sparse_rows<T>& out, std::vector<troll::projection_stats>& stats) {
  staged_aligned<Backend, T> din(rows);
  staged_sparse<Backend, T> dout(out);
  typename Backend::template buffer<troll::projection_stats> dst(stats.size());
  // Unqualified: argument-dependent lookup at instantiation finds the backend's overload, also
  // when its header (troll/cuda.cuh) comes after this one.
  project(Backend::policy(), din.input(), eps, dout.view(), dst.get());
  dout.download_to(out);
  stats = dst.download();
}

/// The backend's sparse project_backward on host batches; `grad_old` and `grad_eps` may be null
/// (not requested).
template <class Backend, class T>
void project_backward_on(const sparse_test::aligned_rows<T>& rows,
                         const sparse_test::sparse_rows<T>& log_probs,
                         const std::vector<troll::projection_stats>& stats,
                         const sparse_test::sparse_grads<T>& grad,
                         sparse_test::sparse_grads<T>& grad_new,
                         sparse_test::sparse_grads<T>* grad_old = nullptr, T* grad_eps = nullptr) {
  staged_aligned<Backend, T> din(rows);
  staged_sparse<Backend, T> dlp(log_probs);
  typename Backend::template buffer<troll::projection_stats> dst(stats);
  staged_grads<Backend, T> dg(grad), dgn(grad_new);
  staged_grads<Backend, T> dgo(grad_old != nullptr ? *grad_old
                                                   : sparse_test::sparse_grads<T>(0, 0));
  typename Backend::template buffer<T> dge(1);
  project_backward(Backend::policy(), din.input(), dlp.input(), dst.get(), dg.input(), dgn.view(),
                   grad_old != nullptr ? dgo.view() : troll::sparse_grad_view<T>{},
                   grad_eps != nullptr ? dge.get() : nullptr);  // unqualified, as in project_on

  dgn.download_to(grad_new);
  if (grad_old != nullptr) dgo.download_to(*grad_old);
  if (grad_eps != nullptr) *grad_eps = dge.download()[0];
}

}  // namespace troll_test
