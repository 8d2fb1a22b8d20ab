"""troll's exceptions. The C++ exceptions of the same names become these (see python/src/module.cpp)."""

from __future__ import annotations

from typing import Optional


class InvalidInput(ValueError):
    """An argument troll cannot use. ``row`` is the lowest offending row (of the flattened
    leading dimensions), or None when no single row is at fault; ``code`` says what is wrong with
    it (``troll::row_error``, 0: none). Nothing was written."""

    def __init__(self, message: str, row: Optional[int] = None, code: int = 0) -> None:
        super().__init__(message)
        self.row = row
        #: What is wrong with that row: the C++ ``troll::row_error`` value (the same on both
        #: backends; 0 when the problem is not one row's). See include/troll/row_error.hpp.
        self.code = code


class ShapeError(InvalidInput):
    """Shapes, dtypes of index arrays, strides, devices or capacities do not fit."""


class DTypeError(ShapeError, TypeError):
    """An array whose element type does not fit the call: float32 next to float64 logits, int64
    ids where int32 is needed, ... Both a ShapeError (what troll raised for it before) and a
    TypeError (what Python raises for a wrong type)."""


class DomainError(InvalidInput):
    """A value is outside the domain: NaN or +inf logits, an all -inf row, eps <= 0, ..."""


class InfeasibleError(InvalidInput):
    """No distribution the new row can reach lies inside the trust region."""


class BackendError(RuntimeError):
    """A backend (CUDA) call failed."""
