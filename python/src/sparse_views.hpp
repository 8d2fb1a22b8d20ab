// python/src/sparse_views.hpp — sparse rows, aligned row pairs and their gradients as Python
// passes them (tuples of arrays, the NamedTuples of troll/_core.py), turned into troll's sparse
// views. Each holder keeps its arrays for the call; the views point into them.
#pragma once

#include <string>
#include <type_traits>

#include "views.hpp"

namespace troll_py {

using troll::sparse_index;

template <class T>
using array_for = std::conditional_t<std::is_const<T>::value, in_array, out_array>;

/// Element i of a tuple as an (input or output) array, with a readable error when it is not one.
template <class A>
A item(const char* fn, const char* name, const nb::tuple& t, std::size_t i) {
  try {
    return nb::cast<A>(t[i]);
  } catch (const nb::cast_error&) {
    throw nb::type_error((std::string("troll.") + fn + ": " + name + "[" + std::to_string(i) +
                          "] is not a " + (std::is_same<A, in_array>::value ? "" : "writable ") +
                          "DLPack array")
                             .c_str());
  }
}

inline nb::tuple as_tuple(const char* fn, const char* name, nb::handle h, std::size_t size) {
  if (!nb::isinstance<nb::tuple>(h) || nb::len(h) != size)
    throw nb::type_error((std::string("troll.") + fn + ": " + name + " must be a tuple of " +
                          std::to_string(size) + " entries")
                             .c_str());
  return nb::borrow<nb::tuple>(h);
}

/// Sparse rows: the arrays are held here for the call (views point into them).
template <class T>
struct sparse_rows {
  using A = array_for<T>;
  A indices, log_probs, counts, log_remainder;
  troll::sparse_batch_view<T> view;
  rows_shape rows;  ///< the leading shape of `indices` (require_same_rows)

  sparse_rows(const char* fn, const char* name, nb::handle h) {
    const nb::tuple t = as_tuple(fn, name, h, 5);
    indices = item<A>(fn, name, t, 0);
    log_probs = item<A>(fn, name, t, 1);
    counts = item<A>(fn, name, t, 2);
    log_remainder = item<A>(fn, name, t, 3);
    using I = std::conditional_t<std::is_const<T>::value, const sparse_index, sparse_index>;
    const std::string n(name);
    require_same_shape(fn, (n + ".log_probs").c_str(), log_probs, (n + ".indices").c_str(), indices);
    const auto iv = as_packed<I>(fn, (n + ".indices").c_str(), indices);
    const auto lv = as_packed<T>(fn, (n + ".log_probs").c_str(), log_probs);
    view.indices = iv.data;
    view.log_probs = lv.data;
    rows = rows_of(n + ".indices", indices);
    view.counts = as_rows<I>(fn, (n + ".counts").c_str(), counts, rows);
    view.log_remainder = as_rows<T>(fn, (n + ".log_remainder").c_str(), log_remainder, rows);
    view.rows = iv.rows;
    view.k_max = iv.cols;
    view.vocab = nb::cast<std::size_t>(t[4]);
  }
};

/// Aligned row pairs, held for the call.
template <class T>
struct aligned_rows {
  using A = array_for<T>;
  A indices, counts, new_lp, old_lp, new_lr, old_lr;
  troll::aligned_batch_view<T> view;
  rows_shape rows;  ///< the leading shape of `indices` (require_same_rows)

  aligned_rows(const char* fn, const char* name, nb::handle h) {
    const nb::tuple t = as_tuple(fn, name, h, 7);
    indices = item<A>(fn, name, t, 0);
    counts = item<A>(fn, name, t, 1);
    new_lp = item<A>(fn, name, t, 2);
    old_lp = item<A>(fn, name, t, 3);
    new_lr = item<A>(fn, name, t, 4);
    old_lr = item<A>(fn, name, t, 5);
    using I = std::conditional_t<std::is_const<T>::value, const sparse_index, sparse_index>;
    const std::string n(name);
    require_same_shape(fn, (n + ".new_log_probs").c_str(), new_lp, (n + ".indices").c_str(), indices);
    require_same_shape(fn, (n + ".old_log_probs").c_str(), old_lp, (n + ".indices").c_str(), indices);
    const auto iv = as_packed<I>(fn, (n + ".indices").c_str(), indices);
    rows = rows_of(n + ".indices", indices);
    view.indices = iv.data;
    view.counts = as_rows<I>(fn, (n + ".counts").c_str(), counts, rows);
    view.new_log_probs = as_packed<T>(fn, (n + ".new_log_probs").c_str(), new_lp).data;
    view.old_log_probs = as_packed<T>(fn, (n + ".old_log_probs").c_str(), old_lp).data;
    view.new_log_remainder = as_rows<T>(fn, (n + ".new_log_remainder").c_str(), new_lr, rows);
    view.old_log_remainder = as_rows<T>(fn, (n + ".old_log_remainder").c_str(), old_lr, rows);
    view.rows = iv.rows;
    view.k_max = iv.cols;
    view.vocab = nb::cast<std::size_t>(t[6]);
  }
};

/// A gradient on sparse rows: (log_probs (rows, k_max), log_remainder (rows)), held for the call.
template <class T>
struct sparse_grad {
  using A = array_for<T>;
  A log_probs, log_remainder;
  troll::sparse_grad_view<T> view;
  rows_shape rows;  ///< the leading shape of `log_probs` (require_same_rows)

  sparse_grad(const char* fn, const char* name, nb::handle h) {
    const nb::tuple t = as_tuple(fn, name, h, 2);
    log_probs = item<A>(fn, name, t, 0);
    log_remainder = item<A>(fn, name, t, 1);
    const std::string n(name);
    const auto lv = as_packed<T>(fn, (n + ".log_probs").c_str(), log_probs);
    rows = rows_of(n + ".log_probs", log_probs);
    view.log_probs = lv.data;
    view.log_remainder = as_rows<T>(fn, (n + ".log_remainder").c_str(), log_remainder, rows);
    view.rows = lv.rows;
    view.k_max = lv.cols;
  }
};

}  // namespace troll_py
