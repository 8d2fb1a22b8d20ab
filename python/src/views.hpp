// python/src/views.hpp — how the binding turns DLPack arrays into troll views: dtype and device
// checks, (..., V) arrays flattened to rows × V with their row stride, per-row arrays, and the
// projection statistics packed as two small arrays. No maths here: every check that reads values
// is troll's own. Problems are thrown as troll::shape_error, so Python sees troll.ShapeError.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <troll/projection.hpp>

#include "errors.hpp"

namespace troll_py {

namespace nb = nanobind;

/// An input array (read-only arrays accepted) and an output array (must be writable).
using in_array = nb::ndarray<nb::ro>;
using out_array = nb::ndarray<>;

[[noreturn]] inline void fail(const char* fn, const std::string& what) {
  throw troll::shape_error(std::string("troll.") + fn + ": " + what);
}


/// "(2, 3, 5)" for error messages.
inline std::string dims_text(const std::vector<std::size_t>& dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

/// The shape of an array as dims_text writes it.
template <class A>
std::string shape_text(const A& a) {
  std::vector<std::size_t> dims;
  for (std::size_t i = 0; i < a.ndim(); ++i) dims.push_back(a.shape(i));
  return dims_text(dims);
}

template <class T>
const char* dtype_name() {
  if (std::is_same<T, float>::value) return "float32";
  if (std::is_same<T, double>::value) return "float64";
  if (std::is_same<T, std::int32_t>::value) return "int32";
  if (std::is_same<T, std::uint8_t>::value) return "uint8";
  return "int64";
}

template <class A>
std::string dtype_text(const A& a) {
  const nb::dlpack::dtype d = a.dtype();
  const char* kind = d.code == uint8_t(nb::dlpack::dtype_code::Float)   ? "float"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Int)   ? "int"
                     : d.code == uint8_t(nb::dlpack::dtype_code::UInt)  ? "uint"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Bool)  ? "bool"
                                                                        : "other";
  return kind + std::to_string(int(d.bits));
}

/// Where this module's arrays live: host memory for troll._troll, CUDA device memory for
/// troll._troll_cuda (its translation unit defines TROLL_PY_CUDA).
#ifdef TROLL_PY_CUDA
constexpr std::int32_t module_device = nb::device::cuda::value;
constexpr const char* module_device_text =
    "is not in CUDA device memory; troll._troll_cuda takes CUDA arrays (host arrays go to troll._troll)";
#else
constexpr std::int32_t module_device = nb::device::cpu::value;
constexpr const char* module_device_text =
    "is not in host memory; troll._troll takes host arrays (CUDA arrays go to troll._troll_cuda: "
    "see docs/python.md, CUDA)";
#endif

/// Throws unless `a` lives where this module computes and holds elements of type T.
template <class T, class A>
void require_host_dtype(const char* fn, const char* name, const A& a) {
  if (a.device_type() != module_device)
    fail(fn, std::string(name) + " (device type " + std::to_string(a.device_type()) + ") " + module_device_text);
  if (!(a.dtype() == nb::dtype<T>()))
    throw dtype_error(std::string("troll.") + fn + ": " + name + " has dtype " + dtype_text(a) +
                      " but " + dtype_name<T>() + " is needed here");
}

/// The shape of `a` without its last dimension (the rows), as a vector.
template <class A>
std::vector<std::size_t> leading_shape(const A& a) {
  std::vector<std::size_t> s;
  for (std::size_t i = 0; i + 1 < a.ndim(); ++i) s.push_back(a.shape(i));
  return s;
}

template <class A>
std::int64_t element_stride(const A& a, std::size_t i) {
  // DLPack allows null strides for a compact row-major array.
  if (a.stride_ptr() != nullptr) return a.stride(i);
  std::int64_t s = 1;
  for (std::size_t k = i + 1; k < a.ndim(); ++k) s *= std::int64_t(a.shape(k));
  return s;
}

/// The single stride between consecutive rows of the dimensions [0, dims) of `a`, flattened in
/// row-major order, or throws when they do not flatten to one stride (a transposed or sliced
/// batch). Dimensions of extent 1 may have any stride. `fallback` is returned when no dimension
/// has extent > 1.
template <class A>
std::size_t flat_stride(const char* fn, const char* name, const A& a, std::size_t dims,
                        std::size_t fallback) {
  std::size_t stride = fallback, span = 0;  // span: stride × extent of the dimensions seen
  bool seen = false;
  for (std::size_t i = dims; i-- > 0;) {
    const std::size_t extent = a.shape(i);
    if (extent <= 1) continue;
    const std::int64_t s = element_stride(a, i);
    if (s < 0) fail(fn, std::string(name) + " has a negative stride");
    if (!seen) {
      stride = std::size_t(s);
      seen = true;
    } else if (std::size_t(s) != span) {
      fail(fn, std::string(name) + " of shape " + shape_text(a) +
                   ": its leading dimensions do not flatten to one row stride (make it "
                   ".contiguous() or reshape it first; troll never copies behind your back)");
    }
    span = std::size_t(s) * extent;
  }
  return stride;
}

/// A (..., V) array as a rows × V batch view: unit stride along V, leading dimensions flattened
/// to one row stride (padded rows are fine).
/// The layout alone (the caller checked device and dtype; T only sizes nothing: strides are in
/// elements).
template <class T, class A>
troll::batch_view<T> as_layout(const char* fn, const char* name, const A& a) {
  if (a.ndim() == 0) fail(fn, std::string(name) + " is a scalar; a (..., V) array is needed");
  const std::size_t last = a.ndim() - 1, cols = a.shape(last);
  std::size_t rows = 1;
  for (std::size_t i = 0; i < last; ++i) rows *= a.shape(i);
  if (cols > 1 && rows > 0 && element_stride(a, last) != 1)
    fail(fn, std::string(name) + " of shape " + shape_text(a) +
                 " is strided along its last dimension, which must be contiguous (make it .contiguous())");
  const std::size_t stride = rows == 0 ? cols : flat_stride(fn, name, a, last, cols);
  // troll's views need rows apart (stride ≥ V); say what such an array is and what to do, where
  // troll's own check would only state the stride (the usual case: a broadcast std or old row)
  if (rows > 1 && stride < cols)
    fail(fn, std::string(name) + " has row stride " + std::to_string(stride) + ", smaller than its " +
                 std::to_string(cols) + " columns: its rows overlap (an expanded/broadcast or as_strided array; "
                 "make it .contiguous())");
  return troll::batch_view<T>{static_cast<T*>(a.data()), rows, cols, stride};
}

/// As as_layout, after checking the device and that the elements are T.
template <class T, class A>
troll::batch_view<T> as_batch(const char* fn, const char* name, const A& a) {
  require_host_dtype<std::remove_const_t<T>>(fn, name, a);
  return as_layout<T>(fn, name, a);
}

/// As as_batch, and the rows must be packed (row stride = V), as troll's sparse layouts need.
template <class T, class A>
troll::batch_view<T> as_packed(const char* fn, const char* name, const A& a) {
  troll::batch_view<T> v = as_batch<T>(fn, name, a);
  if (v.rows > 1 && v.stride != v.cols)
    fail(fn, std::string(name) + " must be packed (row stride " + std::to_string(v.stride) +
                 " != " + std::to_string(v.cols) + "); make it .contiguous()");
  v.stride = v.cols;
  return v;
}

/// The shape every per-row array of a call must have: the leading shape of the array that holds the
/// rows (`of`, for messages). Per-row arrays pair with the rows in flattened order, so the count
/// alone is not enough: a (3, 2) array for rows of shape (2, 3) would pair them wrongly.
struct rows_shape {
  std::string of;
  std::vector<std::size_t> dims;

  std::size_t count() const {
    std::size_t n = 1;
    for (std::size_t d : dims) n *= d;
    return n;
  }
};

/// The rows of `a`, a (..., X) array named `name`: its shape without the last dimension.
template <class A>
rows_shape rows_of(const std::string& name, const A& a) {
  return {name, leading_shape(a)};
}

/// Throws unless two arrays of rows that pair row by row (dense logits and sparse rows, aligned
/// rows and their outputs) have the same leading shape: the pairing is in flattened order, so a
/// (3, 2) batch against a (2, 3) one, or a flattened (6,) one, would pair rows wrongly or by luck.
inline void require_same_rows(const char* fn, const rows_shape& a, const rows_shape& b) {
  if (a.dims != b.dims)
    fail(fn, a.of + " holds rows of shape " + dims_text(a.dims) + " but " + b.of + " holds rows of shape " +
                 dims_text(b.dims) + " (rows pair in flattened order: the leading shapes must agree)");
}

/// `entries` elements of T stored contiguously in `a` (any layout that flattens to unit stride),
/// whatever its shape: for arrays that are not one entry per row of a batch (the metrics).
template <class T, class A>
T* as_entries(const char* fn, const char* name, const A& a, std::size_t entries) {
  require_host_dtype<std::remove_const_t<T>>(fn, name, a);
  if (a.size() != entries)
    fail(fn, std::string(name) + " has shape " + shape_text(a) + " (" + std::to_string(a.size()) +
                 " entries) but " + std::to_string(entries) + " entries are needed");
  if (entries > 1 && flat_stride(fn, name, a, a.ndim(), 1) != 1)
    fail(fn, std::string(name) + " must be contiguous");
  return static_cast<T*>(a.data());
}

/// A per-row array: its shape must be the rows' (`rows.dims`, exactly), its layout must flatten to
/// unit stride. A pointer to its rows.count() elements of T.
template <class T, class A>
T* as_rows(const char* fn, const char* name, const A& a, const rows_shape& rows) {
  require_host_dtype<std::remove_const_t<T>>(fn, name, a);
  bool same = a.ndim() == rows.dims.size();
  for (std::size_t i = 0; same && i < a.ndim(); ++i) same = a.shape(i) == rows.dims[i];
  if (!same)
    fail(fn, std::string(name) + " has shape " + shape_text(a) + " but one entry per row of " + rows.of +
                 " is needed: shape " + dims_text(rows.dims));
  return as_entries<T>(fn, name, a, rows.count());
}

/// Throws unless `a` has exactly the shape of `ref` (not just the same number of rows).
template <class A, class B>
void require_same_shape(const char* fn, const char* name, const A& a, const char* ref_name,
                        const B& ref) {
  bool same = a.ndim() == ref.ndim();
  for (std::size_t i = 0; same && i < a.ndim(); ++i) same = a.shape(i) == ref.shape(i);
  if (!same)
    fail(fn, std::string(name) + " has shape " + shape_text(a) + " but " + ref_name + " has " +
                 shape_text(ref));
}

/// The bytes [begin, end) a batch view spans.
template <class T>
std::pair<const char*, const char*> byte_span(const troll::batch_view<T>& v) {
  if (v.rows == 0 || v.cols == 0) return {nullptr, nullptr};
  const char* begin = reinterpret_cast<const char*>(v.data);
  return {begin, begin + ((v.rows - 1) * v.stride + v.cols) * sizeof(T)};
}

/// Whether two batch views share a byte. Their spans are compared first; where those meet, row by
/// row: row i of `a` meets row j of `b` exactly when j lies in the range solved below, so the
/// interleaved halves of one buffer (big[:, :V] and big[:, V:]) are told apart from views that
/// really share elements. O(a.rows) and only for spans that meet.
template <class T, class U>
bool views_overlap(const troll::batch_view<T>& a, const troll::batch_view<U>& b) {
  const auto sa = byte_span(a), sb = byte_span(b);
  if (!sa.first || !sb.first || !(sa.first < sb.second && sb.first < sa.second)) return false;
  const std::uintptr_t base = std::min(reinterpret_cast<std::uintptr_t>(sa.first),
                                       reinterpret_cast<std::uintptr_t>(sb.first));
  const std::uintptr_t a0 = reinterpret_cast<std::uintptr_t>(sa.first) - base;
  const std::uintptr_t b0 = reinterpret_cast<std::uintptr_t>(sb.first) - base;
  const std::uintptr_t a_step = a.stride * sizeof(T), a_len = a.cols * sizeof(T);
  const std::uintptr_t b_step = b.stride * sizeof(U), b_len = b.cols * sizeof(U);
  // Rows of b with stride 0 (an expanded input) are all one byte range: take it once.
  const std::uintptr_t b_rows = b_step == 0 ? 1 : b.rows;
  for (std::size_t i = 0; i < a.rows; ++i) {
    const std::uintptr_t x = a0 + i * a_step;  // row i of a: [x, x + a_len)
    // Row j of b, [b0 + j b_step, b0 + j b_step + b_len), meets it iff
    //   b0 + j b_step < x + a_len  and  x < b0 + j b_step + b_len.
    if (x + a_len <= b0) continue;
    // the largest j whose row starts below x + a_len (every one when b_step = 0)
    const std::uintptr_t j_hi = b_step == 0 ? 0 : (x + a_len - 1 - b0) / b_step;
    const std::uintptr_t j = std::min<std::uintptr_t>(j_hi, b_rows - 1);
    if (x < b0 + j * b_step + b_len) return true;  // the latest row starting in time ends past x
  }
  return false;
}

/// Throws when an output overlaps an input: troll reads its inputs while it writes.
template <class T, class U>
void require_disjoint(const char* fn, const char* out_name, const troll::batch_view<T>& out,
                      const char* in_name, const troll::batch_view<U>& in) {
  if (views_overlap(out, in))
    fail(fn, std::string(out_name) + " overlaps " + in_name +
                 " (troll does not compute in place; pass a separate out= buffer)");
}

/// An output the binding writes itself (the packed statistics): rows that overlap one another (a
/// row stride below the row's width: an expanded or as_strided buffer) would take every row's
/// values in the same memory, the last row's winning, silently.
template <class T>
void require_rows_apart(const char* fn, const char* name, const troll::batch_view<T>& v) {
  if (v.rows > 1 && v.stride < v.cols)
    fail(fn, std::string(name) + " has row stride " + std::to_string(v.stride) + ", smaller than its " +
                 std::to_string(v.cols) + " columns: its rows overlap (pass a fresh buffer)");
}

/// project()'s statistics buffers (a caller's stats=) must overlap neither the call's arrays nor
/// each other: troll writes them while (CUDA) or after (host) it reads the logits.
template <class T>
void require_stats_disjoint(const char* fn, const troll::batch_view<double>& values,
                            const troll::batch_view<std::int32_t>& counters,
                            const troll::batch_view<const T>& new_logits,
                            const troll::batch_view<const T>& old_logits,
                            const troll::batch_view<T>& out) {
  require_disjoint(fn, "stats.values", values, "stats.counters", counters);
  require_disjoint(fn, "stats.values", values, "new_logits", new_logits);
  require_disjoint(fn, "stats.values", values, "old_logits", old_logits);
  require_disjoint(fn, "stats.values", values, "out", out);
  require_disjoint(fn, "stats.counters", counters, "new_logits", new_logits);
  require_disjoint(fn, "stats.counters", counters, "old_logits", old_logits);
  require_disjoint(fn, "stats.counters", counters, "out", out);
}

/// `out` after require_disjoint(out, in): for checks in a constructor's initialiser list.
template <class T, class U>
troll::batch_view<T> disjoint_from(const char* fn, const char* out_name, const troll::batch_view<T>& out,
                                   const char* in_name, const troll::batch_view<U>& in) {
  require_disjoint(fn, out_name, out, in_name, in);
  return out;
}

/// The columns of the packed statistics: `values` is (..., 6) float64, `counters` (..., 2) int32.
enum stats_column { st_t, st_eta, st_kl_before, st_kl_after, st_mu, st_sigma2, st_values };
enum stats_counter { st_iterations, st_status, st_counters };

/// The errors of stats arrays that do not fit the batch: an input (the backward's) and an output.
inline std::string stats_mismatch_text(std::size_t rows) {
  return "stats do not match the batch (" + std::to_string(rows) +
         " rows): pass the stats project() returned for these logits";
}
inline std::string stats_buffers_text(std::size_t rows) {
  return "the stats buffers must be (rows, 6) float64 and (rows, 2) int32 for " + std::to_string(rows) + " rows";
}

/// Reads `rows` projection_stats from the packed arrays (the backward's input).
inline std::vector<troll::projection_stats> read_stats(const char* fn, const in_array& values,
                                                       const in_array& counters, std::size_t rows) {
  const auto v = as_batch<const double>(fn, "stats.values", values);
  const auto c = as_batch<const std::int32_t>(fn, "stats.counters", counters);
  if (v.rows != rows || v.cols != st_values || c.rows != rows || c.cols != st_counters)
    fail(fn, stats_mismatch_text(rows));
  std::vector<troll::projection_stats> s(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const double* x = v.row(r);
    s[r].t = x[st_t];
    s[r].eta = x[st_eta];
    s[r].kl_before = x[st_kl_before];
    s[r].kl_after = x[st_kl_after];
    s[r].mu = x[st_mu];
    s[r].sigma2 = x[st_sigma2];
    s[r].iterations = c.row(r)[st_iterations];
    s[r].status = static_cast<troll::row_status>(c.row(r)[st_status]);
  }
  return s;
}

/// The statistics a backward reads on the host (read_stats, held for the call).
struct stats_in {
  std::vector<troll::projection_stats> stats;

  stats_in(const char* fn, const in_array& values, const in_array& counters, std::size_t rows)
      : stats(read_stats(fn, values, counters, rows)) {}

  const troll::projection_stats* data() const { return stats.data(); }
};

/// Checks the packed output arrays for `rows` statistics (before any work).
struct stats_out {
  troll::batch_view<double> values;
  troll::batch_view<std::int32_t> counters;

  stats_out(const char* fn, const out_array& v, const out_array& c, std::size_t rows)
      : values(as_batch<double>(fn, "stats.values", v)),
        counters(as_batch<std::int32_t>(fn, "stats.counters", c)) {
    if (values.rows != rows || values.cols != st_values || counters.rows != rows ||
        counters.cols != st_counters)
      fail(fn, stats_buffers_text(rows));
    require_rows_apart(fn, "stats.values", values);
    require_rows_apart(fn, "stats.counters", counters);
  }

  void write(const std::vector<troll::projection_stats>& s) const {
    for (std::size_t r = 0; r < s.size(); ++r) {
      double* x = values.row(r);
      x[st_t] = s[r].t;
      x[st_eta] = s[r].eta;
      x[st_kl_before] = s[r].kl_before;
      x[st_kl_after] = s[r].kl_after;
      x[st_mu] = s[r].mu;
      x[st_sigma2] = s[r].sigma2;
      counters.row(r)[st_iterations] = s[r].iterations;
      counters.row(r)[st_status] = static_cast<std::int32_t>(s[r].status);
    }
  }
};

/// Calls f.template operator()<T>() with T the element type of `a` (float32 or float64).
template <class F, class A>
decltype(auto) dispatch_float(const char* fn, const char* name, const A& a, F&& f) {
  if (a.dtype() == nb::dtype<float>()) return f(float{});
  if (a.dtype() == nb::dtype<double>()) return f(double{});
  throw nb::type_error((std::string("troll.") + fn + ": " + name + " has dtype " + dtype_text(a) +
                        "; troll computes on float32 and float64 arrays")
                           .c_str());
}

/// The module's sections.
void bind_dense(nb::module_& m);
void bind_sparse(nb::module_& m);
void bind_objectives(nb::module_& m);
void bind_gaussian(nb::module_& m);

}  // namespace troll_py
