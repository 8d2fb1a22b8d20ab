// python/src/errors.hpp — troll's C++ exceptions as the Python exceptions of troll/_errors.py,
// registered by each extension module (troll._troll, troll._troll_cuda) at import.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <exception>

#include <troll/errors.hpp>

namespace troll_py {

/// An array of the wrong element type next to the right ones (float32 with float64 logits, int64
/// ids for int32): Python's troll.DTypeError, both a ShapeError and a TypeError.
class dtype_error : public troll::shape_error {
 public:
  using troll::shape_error::shape_error;
};

/// The Python exception classes, looked up once per module at import and held for the life of
/// the process (translators may run during interpreter shutdown).
struct error_classes {
  PyObject* invalid_input = nullptr;
  PyObject* shape_error = nullptr;
  PyObject* dtype_error = nullptr;
  PyObject* domain_error = nullptr;
  PyObject* infeasible_error = nullptr;
  PyObject* backend_error = nullptr;
};

inline error_classes& errors() {
  static error_classes e;
  return e;
}

inline void raise(PyObject* cls, const troll::invalid_input& x) {
  nanobind::object row_object = nanobind::none();
  if (x.row() != troll::invalid_input::npos) row_object = nanobind::int_(x.row());
  nanobind::object instance = nanobind::borrow(cls)(nanobind::str(x.what()), row_object,
                                                    nanobind::int_(static_cast<int>(x.code())));
  PyErr_SetObject(cls, instance.ptr());
}

inline void translate(const std::exception_ptr& p, void*) {
  const error_classes& e = errors();
  try {
    std::rethrow_exception(p);
  } catch (const dtype_error& x) {
    raise(e.dtype_error, x);
  } catch (const troll::shape_error& x) {
    raise(e.shape_error, x);
  } catch (const troll::infeasible_error& x) {
    raise(e.infeasible_error, x);
  } catch (const troll::domain_error& x) {
    raise(e.domain_error, x);
  } catch (const troll::invalid_input& x) {
    raise(e.invalid_input, x);
  } catch (const troll::backend_error& x) {
    // BackendError is a RuntimeError: the message is its only argument (no row).
    PyErr_SetString(e.backend_error, x.what());
  }
}

inline void register_errors() {
  namespace nb = nanobind;
  nb::module_ err = nb::module_::import_("troll._errors");
  error_classes& e = errors();
  e.invalid_input = nb::object(err.attr("InvalidInput")).release().ptr();
  e.shape_error = nb::object(err.attr("ShapeError")).release().ptr();
  e.dtype_error = nb::object(err.attr("DTypeError")).release().ptr();
  e.domain_error = nb::object(err.attr("DomainError")).release().ptr();
  e.infeasible_error = nb::object(err.attr("InfeasibleError")).release().ptr();
  e.backend_error = nb::object(err.attr("BackendError")).release().ptr();
  nb::register_exception_translator(&translate);
}

}  // namespace troll_py
