// troll/batch.hpp — non-owning views of a batch of rows over caller memory.
// A batch is N rows of V entries, row-major, with a row stride (in elements) ≥ V. troll never
// owns or reallocates the memory behind a view; views are trivially copyable and device-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "config.hpp"
#include "errors.hpp"

TROLL_BEGIN_NAMESPACE

/// The type of a token id the caller passes: sampled tokens (token_batch::tokens, sparsify's and
/// sparsify_shard's `sampled`), the same on every backend.
using token_id = std::int64_t;

template <class T>
struct batch_view {
  T* data = nullptr;
  std::size_t rows = 0;
  std::size_t cols = 0;
  std::size_t stride = 0;  // elements between the starts of two consecutive rows

  TROLL_HOST_DEVICE T* row(std::size_t r) const { return data + r * stride; }
  TROLL_HOST_DEVICE bool empty() const { return rows == 0 || cols == 0; }

  /// Implicit conversion to a read-only view.
  template <class U = T, class = std::enable_if_t<!std::is_const<U>::value>>
  TROLL_HOST_DEVICE operator batch_view<const U>() const {
    return batch_view<const U>{data, rows, cols, stride};
  }
};

namespace detail {
/// Entry points accept float and double elements.
template <class T>
constexpr void require_float_type() {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "troll: element type must be float or double");
}

template <class T>
struct identity {
  using type = T;
};

/// Views of one element type, each const or not: the deducing overloads of entry points whose
/// element type appears only in input views (gaussian::kl, gaussian::kl_diag).
template <class A, class... Rest>
using if_same_elements =
    std::enable_if_t<std::conjunction<std::is_same<std::remove_const_t<A>, std::remove_const_t<Rest>>...>::value, int>;
}  // namespace detail

/// Read-only view whose element type is deduced from another (output) argument, so a mutable
/// batch_view<T> converts implicitly where an input is expected.
template <class T>
using input_view = batch_view<const typename detail::identity<T>::type>;

/// A view of `rows` × `cols` elements at `data`, rows `stride` elements apart (default: packed).
template <class T>
TROLL_HOST_DEVICE batch_view<T> make_batch(T* data, std::size_t rows, std::size_t cols,
                                           std::size_t stride = 0) {
  return batch_view<T>{data, rows, cols, stride == 0 ? cols : stride};
}

namespace detail {

/// Throws shape_error unless `v` is a usable view: non-null, V ≥ 1, stride ≥ V.
/// An empty batch (rows == 0) is legal and needs no pointer.
template <class T>
void check_view(const char* function, const char* name, const batch_view<T>& v) {
  if (v.rows == 0) return;
  if (v.cols == 0)
    throw_shape(function, std::string(name) + " has V = 0 columns (a row needs at least one token)");
  if (v.data == nullptr) throw_shape(function, std::string(name) + " is a null pointer");
  if (v.stride < v.cols)
    throw_shape(function, std::string(name) + " has row stride " + std::to_string(v.stride) +
                              " smaller than its " + std::to_string(v.cols) + " columns");
}

/// Throws shape_error unless `a` and `b` have the same rows and columns.
template <class A, class B>
void check_same_shape(const char* function, const char* name_a, const batch_view<A>& a,
                      const char* name_b, const batch_view<B>& b) {
  if (a.rows != b.rows || a.cols != b.cols)
    throw_shape(function, std::string(name_a) + " is " + std::to_string(a.rows) + "x" +
                              std::to_string(a.cols) + " but " + name_b + " is " +
                              std::to_string(b.rows) + "x" + std::to_string(b.cols));
}

}  // namespace detail

TROLL_END_NAMESPACE
