// troll/eigen.hpp — batch views over Eigen matrices (CPU side): make_batch(m) for a row-major
// Eigen::Matrix, Eigen::Map, Eigen::Ref or block with direct access. Checked on the host: the rows
// must be contiguous (inner stride 1) and row-major (a column-major object only when it is one row
// or one column, where both layouts agree); anything else throws shape_error.
//
//   Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> z(rows, V);
//   troll::project(troll::cpu, troll::make_batch(z), troll::make_batch(z_old), eps, troll::make_batch(out), stats);
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>

#include "batch.hpp"
#include "config.hpp"
#include "detail/cpu/eigen.hpp"
#include "errors.hpp"

TROLL_BEGIN_NAMESPACE

namespace detail {
template <class M>
using eigen_plain = std::remove_cv_t<std::remove_reference_t<M>>;

template <class M>
constexpr bool is_eigen_direct() {
  return std::is_base_of<Eigen::DenseBase<eigen_plain<M>>, eigen_plain<M>>::value &&
         (int(eigen_plain<M>::Flags) & int(Eigen::DirectAccessBit)) != 0;
}
}  // namespace detail

/// A batch_view of the Eigen object `m` (rows × cols, row stride its outer stride); const when `m`
/// gives const access. Throws shape_error for a column-major object with more than one row and
/// column, or rows that are not contiguous (inner stride ≠ 1).
template <class M, std::enable_if_t<detail::is_eigen_direct<M>(), int> = 0>
auto make_batch(M&& m) -> batch_view<std::remove_pointer_t<decltype(m.data())>> {
  using plain = detail::eigen_plain<M>;
  using element = std::remove_pointer_t<decltype(m.data())>;
  const std::size_t rows = static_cast<std::size_t>(m.rows()), cols = static_cast<std::size_t>(m.cols());
  const std::size_t inner = static_cast<std::size_t>(m.innerStride());
  const std::size_t outer = static_cast<std::size_t>(m.outerStride());
  if (plain::IsRowMajor) {
    if (inner != 1 && cols > 1)
      detail::throw_shape("make_batch", "the Eigen object's rows are not contiguous (inner stride " + std::to_string(inner) +
                                    "; troll needs 1)");
    return batch_view<element>{m.data(), rows, cols, rows > 1 ? outer : cols};
  }
  if (rows > 1 && cols > 1)
    detail::throw_shape("make_batch", "the Eigen object is column-major (" + std::to_string(rows) + "x" +
                                  std::to_string(cols) + "); troll batches are row-major: use Eigen::RowMajor");
  if (cols == 1) return batch_view<element>{m.data(), rows, 1, inner};  // a column: one token per row
  if (outer != 1 && cols > 1)
    detail::throw_shape("make_batch", "the Eigen row is not contiguous (stride " + std::to_string(outer) + "; troll needs 1)");
  return batch_view<element>{m.data(), rows, cols, cols};
}

TROLL_END_NAMESPACE
