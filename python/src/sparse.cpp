// python/src/sparse.cpp — troll's sparse rows (top-K + remainder bucket, docs/sparse.md) for
// Python: sparsify and its backward, align dense new logits with sparse old rows, and the
// projection of aligned rows with its backward. Sparse rows travel as tuples of arrays (the
// NamedTuples of troll/_core.py): (indices, log_probs, counts, log_remainder, vocab) and, aligned,
// (indices, counts, new_log_probs, old_log_probs, new_log_remainder, old_log_remainder, vocab).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "shard_args.hpp"
#include "sparse_args.hpp"
#include "sparse_views.hpp"

namespace troll_py {
namespace {

troll::cpu_policy policy(unsigned threads) { return troll::cpu.with_threads(threads); }

/// The sampled tokens (int32 from Python) as troll::token_id, the API's token type.
std::vector<troll::token_id> sampled_ids(const char* fn, const std::optional<in_array>& sampled,
                                        const rows_shape& rows) {
  if (!sampled) return {};
  const sparse_index* s = as_rows<const sparse_index>(fn, "sampled", *sampled, rows);
  return std::vector<troll::token_id>(s, s + rows.count());
}

void sparsify(const in_array& logits, const std::optional<in_array>& sampled, int k, double delta,
              nb::handle out, unsigned threads) {
  constexpr const char* fn = "sparsify";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    using T = decltype(tag);
    const auto x = as_batch<const T>(fn, "logits", logits);
    const std::vector<troll::token_id> ids = sampled_ids(fn, sampled, rows_of("logits", logits));
    const troll::token_id* s = sampled ? ids.data() : nullptr;
    const sparse_rows<T> o(fn, "out", out);
    require_same_rows(fn, o.rows, rows_of("logits", logits));
    const troll::sparsify_options options = sparsify_settings(k, delta);
    nb::gil_scoped_release release;
    troll::sparsify(policy(threads), x, s, options, o.view);
  });
}

void sparsify_backward(const in_array& logits, nb::handle support, nb::handle grad,
                       const out_array& grad_logits, unsigned threads) {
  constexpr const char* fn = "sparsify_backward";
  dispatch_float(fn, "logits", logits, [&](auto tag) {
    const sparsify_backward_args<decltype(tag)> a(fn, logits, support, grad, grad_logits);
    nb::gil_scoped_release release;
    troll::sparsify_backward(policy(threads), a.logits, a.support.view, a.grad.view, a.grad_logits);
  });
}

void align(const in_array& new_logits, nb::handle new_support, nb::handle old_rows, nb::handle out,
           unsigned threads) {
  constexpr const char* fn = "align";
  dispatch_float(fn, "new_logits", new_logits, [&](auto tag) {
    const align_args<decltype(tag)> a(fn, new_logits, new_support, old_rows, out);
    nb::gil_scoped_release release;
    troll::align(policy(threads), a.new_logits, a.support, a.old.view, a.out.view);
  });
}

void kl_aligned(nb::handle rows, const out_array& out, unsigned threads) {
  constexpr const char* fn = "kl_sparse";
  dispatch_aligned(fn, rows, [&](auto tag) {
    const kl_aligned_args<decltype(tag)> a(fn, rows, out);
    nb::gil_scoped_release release;
    troll::kl(policy(threads), a.rows.view, a.out);
  });
}

void project_aligned(nb::handle rows, double eps, nb::handle out, const out_array& stats_values,
                     const out_array& stats_counters, double rtol, double atol, int max_iterations,
                     unsigned threads) {
  constexpr const char* fn = "project_sparse";
  dispatch_aligned(fn, rows, [&](auto tag) {
    const project_aligned_args<decltype(tag), stats_out> a(fn, rows, out, stats_values, stats_counters);
    const troll::projection_options options = projection_settings(rtol, atol, max_iterations);
    std::vector<troll::projection_stats> stats(a.rows.view.rows);
    {
      nb::gil_scoped_release release;
      troll::project(policy(threads), a.rows.view, eps, a.out.view, stats.data(), options);
    }
    a.stats.write(stats);
  });
}

void project_aligned_backward(nb::handle rows, nb::handle log_probs, const in_array& stats_values,
                              const in_array& stats_counters, nb::handle grad, nb::handle grad_new,
                              nb::handle grad_old, const std::optional<out_array>& grad_eps,
                              unsigned threads) {
  constexpr const char* fn = "project_sparse_backward";
  dispatch_aligned(fn, rows, [&](auto tag) {
    const project_aligned_backward_args<decltype(tag), stats_in> a(fn, rows, log_probs, stats_values,
                                                                   stats_counters, grad, grad_new,
                                                                   grad_old, grad_eps);
    nb::gil_scoped_release release;
    troll::project_backward(policy(threads), a.rows.view, a.log_probs.view, a.stats.data(),
                            a.grad.view, a.grad_new.view, a.grad_old, a.grad_eps);
  });
}

// ---- Vocabulary shards (troll::sparsify_shard / merge / finalize / tail sums / shard backward) ----
// Packed states and the argument checks: shard_args.hpp (shared with the CUDA module).

void pack_state(const troll::sparsify_state& st, std::uint8_t* to, std::size_t bytes) {
  std::memcpy(to, &st, bytes);
}

void unpack_state(const std::uint8_t* from, std::size_t bytes, troll::sparsify_state& st) {
  std::memcpy(&st, from, bytes);
}

void sparsify_shard(const in_array& shard_logits, std::size_t vocab_offset, std::size_t vocab,
                    const std::optional<in_array>& sampled, int k, double delta, const out_array& states,
                    unsigned threads) {
  constexpr const char* fn = "sparsify_shard";
  const std::size_t bytes = packed_state_bytes(k);
  dispatch_float(fn, "shard_logits", shard_logits, [&](auto tag) {
    using T = decltype(tag);
    const auto x = as_batch<const T>(fn, "shard_logits", shard_logits);
    const std::vector<troll::token_id> ids = sampled_ids(fn, sampled, rows_of("shard_logits", shard_logits));
    const troll::token_id* s = sampled ? ids.data() : nullptr;
    std::uint8_t* out = shard_states_out(fn, states, x.rows, k);
    const troll::sparsify_options options = sparsify_settings(k, delta);
    nb::gil_scoped_release release;
    std::vector<troll::sparsify_state> st(x.rows);
    troll::sparsify_shard(policy(threads), x, vocab_offset, vocab, s, options, st.data());
    for (std::size_t r = 0; r < x.rows; ++r) pack_state(st[r], out + r * bytes, bytes);
  });
}

void sparsify_finalize(const in_array& states, int k, double delta, nb::handle out,
                       const std::optional<out_array>& log_sums, const std::optional<out_array>& tail_max,
                       const std::optional<in_array>& tail_sums, unsigned threads) {
  constexpr const char* fn = "sparsify_finalize";
  const stacked_states all(fn, states, k);
  dispatch_sparse_out(fn, out, [&](auto tag) {
    using T = decltype(tag);
    const finalize_args<T> a(fn, out, all.rows, log_sums, tail_max, tail_sums);
    const troll::sparsify_options options = sparsify_settings(k, delta);
    nb::gil_scoped_release release;
    const std::size_t rows = all.rows, bytes = all.bytes;
    std::vector<troll::sparsify_state> merged(rows), next(rows);
    for (std::size_t r = 0; r < rows; ++r) unpack_state(all.data + r * bytes, bytes, merged[r]);
    for (std::size_t s = 1; s < all.shards; ++s) {
      for (std::size_t r = 0; r < rows; ++r) unpack_state(all.data + (s * rows + r) * bytes, bytes, next[r]);
      troll::sparsify_merge(policy(threads), merged.data(), next.data(), rows);
    }
    troll::sparsify_finalize(policy(threads), merged.data(), options, a.out.view, a.log_sums, a.tail_max,
                             a.tail_sums, a.tail_shards);
  });
}

void sparsify_tail_sums(const in_array& shard_logits, std::size_t vocab_offset, nb::handle support,
                        const in_array& tail_max, const out_array& sums, unsigned threads) {
  constexpr const char* fn = "sparsify_tail_sums";
  dispatch_float(fn, "shard_logits", shard_logits, [&](auto tag) {
    using T = decltype(tag);
    const auto x = as_batch<const T>(fn, "shard_logits", shard_logits);
    const tail_sums_args<T> a(fn, x.rows, support, tail_max, sums);
    nb::gil_scoped_release release;
    troll::sparsify_tail_sums<T>(policy(threads), x, vocab_offset, a.support.view, a.tail_max, a.sums);
  });
}

void sparsify_shard_backward(const in_array& shard_logits, std::size_t vocab_offset, nb::handle support,
                             nb::handle grad, const in_array& log_sums, const out_array& grad_shard,
                             unsigned threads) {
  constexpr const char* fn = "sparsify_shard_backward";
  dispatch_float(fn, "shard_logits", shard_logits, [&](auto tag) {
    using T = decltype(tag);
    const shard_backward_args<T> a(fn, shard_logits, support, grad, log_sums, grad_shard);
    nb::gil_scoped_release release;
    troll::sparsify_shard_backward(policy(threads), a.logits, vocab_offset, a.support.view, a.grad.view, a.log_sums,
                                   a.grad_shard);
  });
}

}  // namespace

void bind_sparse(nb::module_& m) {
  using namespace nb::literals;
  m.attr("SPARSIFY_MAX_K") = troll::sparsify_max_k;
  m.attr("SPARSE_MAX_ENTRIES") = troll::sparse_max_entries;
  m.def("sparsify", &sparsify, "logits"_a, "sampled"_a.none(), "k"_a, "delta"_a, "out"_a,
        "threads"_a = 0, "Top-k + remainder rows of dense logits into caller-allocated sparse rows.");
  m.def("sparsify_backward", &sparsify_backward, "logits"_a, "support"_a, "grad"_a,
        "grad_logits"_a, "threads"_a = 0,
        "Scatters a gradient on sparse rows gathered from logits back to the dense logits.");
  m.def("align", &align, "new_logits"_a, "new_support"_a.none(), "old"_a, "out"_a,
        "threads"_a = 0, "Aligns dense new logits with sparse old rows on U = S_new | S_old.");
  m.def("kl_sparse", &kl_aligned, "rows"_a, "out"_a, "threads"_a = 0,
        "KL(new || old) of aligned rows (the lumped categories).");
  m.def("project_sparse", &project_aligned, "rows"_a, "eps"_a, "out"_a, "stats_values"_a,
        "stats_counters"_a, "rtol"_a = troll::projection_options{}.rtol, "atol"_a = troll::projection_options{}.atol,
        "max_iterations"_a = troll::projection_options{}.max_iterations,
        "threads"_a = 0, "The trust-region projection of aligned rows.");
  m.def("project_sparse_backward", &project_aligned_backward, "rows"_a, "log_probs"_a,
        "stats_values"_a, "stats_counters"_a, "grad"_a, "grad_new"_a, "grad_old"_a.none(),
        "grad_eps"_a.none(), "threads"_a = 0,
        "VJP of project_sparse w.r.t. the aligned new (and old) log-probs and buckets, and eps.");
  m.def("sparsify_state_bytes", &packed_state_bytes, "k"_a,
        "Bytes of one packed sparsify state (one row of one vocabulary shard) for top-k.");
  m.def("sparsify_shard", &sparsify_shard, "shard_logits"_a, "vocab_offset"_a, "vocab"_a, "sampled"_a.none(),
        "k"_a, "delta"_a, "states"_a, "threads"_a = 0,
        "Packed sparsify states (rows x sparsify_state_bytes(k) uint8) of one vocabulary shard.");
  m.def("sparsify_finalize", &sparsify_finalize, "states"_a, "k"_a, "delta"_a, "out"_a, "log_sums"_a.none(),
        "tail_max"_a.none() = nb::none(), "tail_sums"_a.none() = nb::none(), "threads"_a = 0,
        "Merges packed states (shards, ..., bytes) in shard order and writes the sparse rows (and the "
        "rows' log-sums for sparsify_shard_backward, the tails' max); given the shards' tail_sums "
        "(shards, ..., 2), the exact values.");
  m.def("sparsify_tail_sums", &sparsify_tail_sums, "shard_logits"_a, "vocab_offset"_a, "support"_a, "tail_max"_a,
        "sums"_a, "threads"_a = 0,
        "One shard's exact sum (hi, lo) of exp(z - tail_max) over its tokens outside each row's support.");
  m.def("sparsify_shard_backward", &sparsify_shard_backward, "shard_logits"_a, "vocab_offset"_a, "support"_a,
        "grad"_a, "log_sums"_a, "grad_shard"_a, "threads"_a = 0,
        "The gradient w.r.t. one vocabulary shard's logits of a loss on sparse rows finalised from all shards.");
}

}  // namespace troll_py
