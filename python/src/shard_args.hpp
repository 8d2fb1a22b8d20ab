// python/src/shard_args.hpp — the arguments of the vocabulary-shard functions (sparsify_shard,
// sparsify_finalize, sparsify_tail_sums, sparsify_shard_backward), checked and turned into views
// once for both extension modules: troll._troll (sparse.cpp, host arrays) and troll._troll_cuda
// (cuda_module.cpp, device arrays — views.hpp's device rule differs, the checks here do not).
//
// Shard states travel between processes as packed bytes: a state's fields before its heap, then
// its first k heap entries (a state holds at most k; the spare slot is finalize's). Packing is a
// byte copy of the trivially copyable struct, the same on the host and the device; sparsify_merge
// and sparsify_finalize validate every field of what they unpack, so a torn or foreign buffer is a
// typed error, never an out-of-bounds read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <troll/sparsify_state.hpp>

#include "sparse_views.hpp"

namespace troll_py {

constexpr std::size_t state_header = offsetof(troll::sparsify_state, heap);

/// Bytes of one packed state for top-k.
inline std::size_t packed_state_bytes(int k) {
  if (k < 1 || k > troll::sparsify_max_k)
    throw troll::domain_error("troll.sparsify_state_bytes: k must be in [1, " +
                              std::to_string(troll::sparsify_max_k) + "], got " + std::to_string(k));
  return state_header + sizeof(troll::detail::sparse_candidate) * std::size_t(k);
}

/// sparsify_shard's output: `rows` packed states of packed_state_bytes(k) bytes.
inline std::uint8_t* shard_states_out(const char* fn, const out_array& states, std::size_t rows, int k) {
  const std::size_t bytes = packed_state_bytes(k);
  const auto out = as_packed<std::uint8_t>(fn, "states", states);
  if (out.rows != rows || out.cols != bytes)
    fail(fn, "states has shape " + shape_text(states) + " but needs " + std::to_string(rows) + " rows of " +
                 std::to_string(bytes) + " bytes");
  return out.data;
}

/// sparsify_finalize's input: packed states stacked (shards, ..., bytes), shard s of row r at
/// data + (s · rows + r) · bytes.
struct stacked_states {
  const std::uint8_t* data = nullptr;
  std::size_t shards = 0, rows = 0, bytes = 0;

  stacked_states(const char* fn, const in_array& states, int k) {
    bytes = packed_state_bytes(k);
    if (states.ndim() < 2) fail(fn, "states must have shape (shards, ..., bytes)");
    const auto all = as_packed<const std::uint8_t>(fn, "states", states);
    shards = states.shape(0);
    if (all.cols != bytes || shards == 0 || all.rows % shards != 0)
      fail(fn, "states has shape " + shape_text(states) + ": (shards >= 1, ..., " + std::to_string(bytes) +
                   " bytes) is needed for k = " + std::to_string(k));
    data = all.data;
    rows = all.rows / shards;
  }
};

/// sparsify_finalize's outputs and second-stage input: the rows (T), and optional log_sums
/// (..., 2), tail_max (...) and the shards' tail_sums (shards, ..., 2).
template <class T>
struct finalize_args {
  sparse_rows<T> out;
  double* log_sums = nullptr;
  double* tail_max = nullptr;
  const double* tail_sums = nullptr;
  std::size_t tail_shards = 0;

  finalize_args(const char* fn, nb::handle out_rows, std::size_t rows, const std::optional<out_array>& sums,
                const std::optional<out_array>& max, const std::optional<in_array>& tails)
      : out(fn, "out", out_rows) {
    if (out.view.rows != rows)
      fail(fn, "out has " + std::to_string(out.view.rows) + " rows but states hold " + std::to_string(rows));
    if (sums) {
      const auto ls = as_packed<double>(fn, "log_sums", *sums);
      if (ls.rows != rows || ls.cols != std::size_t(troll::sparsify_log_sums_width))
        fail(fn, "log_sums must have shape (..., 4), {ref, total, tail_ref, tail} a row");
      log_sums = ls.data;
    }
    if (max) tail_max = as_rows<double>(fn, "tail_max", *max, rows_of("out.indices", out.indices));
    if (tails) {
      const auto ts = as_packed<const double>(fn, "tail_sums", *tails);
      if (tails->ndim() < 2 || ts.cols != 2 || ts.rows % (rows == 0 ? 1 : rows) != 0 ||
          (rows != 0 && ts.rows / rows == 0))
        fail(fn, "tail_sums has shape " + shape_text(*tails) + ": (shards >= 1, ..., 2) is needed");
      tail_sums = ts.data;
      tail_shards = rows == 0 ? 0 : ts.rows / rows;
    }
  }
};

/// sparsify_tail_sums: the support rows (indices and counts read), tail_max (one a row) and the
/// output pairs (..., 2), for a shard of `rows` rows.
template <class T>
struct tail_sums_args {
  sparse_rows<const T> support;
  const double* tail_max = nullptr;
  double* sums = nullptr;

  tail_sums_args(const char* fn, std::size_t rows, nb::handle support_rows, const in_array& max,
                 const out_array& out)
      : support(fn, "support", support_rows) {
    tail_max = as_rows<const double>(fn, "tail_max", max, rows_of("support.indices", support.indices));
    const auto o = as_packed<double>(fn, "sums", out);
    if (o.rows != rows || o.cols != 2) fail(fn, "sums must have shape (..., 2), one pair a row");
    sums = o.data;
  }
};

/// sparsify_shard_backward: shard logits and grad_shard of one shape (not overlapping), the
/// support rows, their gradient and the rows' log_sums (..., 2).
template <class T>
struct shard_backward_args {
  troll::batch_view<const T> logits;
  troll::batch_view<T> grad_shard;
  sparse_rows<const T> support;
  sparse_grad<const T> grad;
  const double* log_sums = nullptr;

  shard_backward_args(const char* fn, const in_array& x, nb::handle support_rows, nb::handle g,
                      const in_array& sums, const out_array& gx)
      : support(fn, "support", support_rows), grad(fn, "grad", g) {
    require_same_shape(fn, "grad_shard", gx, "shard_logits", x);
    require_same_rows(fn, support.rows, rows_of("shard_logits", x));
    require_same_rows(fn, grad.rows, support.rows);
    logits = as_batch<const T>(fn, "shard_logits", x);
    grad_shard = as_batch<T>(fn, "grad_shard", gx);
    require_disjoint(fn, "grad_shard", grad_shard, "shard_logits", logits);
    const auto ls = as_packed<const double>(fn, "log_sums", sums);
    if (ls.rows != logits.rows || ls.cols != std::size_t(troll::sparsify_log_sums_width))
      fail(fn, "log_sums must have shape (..., 4), {ref, total, tail_ref, tail} a row");
    log_sums = ls.data;
  }
};

}  // namespace troll_py
