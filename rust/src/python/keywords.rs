//! Keyword arguments that belong together, read from a binding's `**kwargs` into a
//! small struct of their own (`keywords!`): how a binding takes more options than a
//! Rust function should have parameters. The binding's `text_signature` still names
//! every one, so that `help()`, `inspect.signature` and `tests/test_core_stub.py`
//! (against `_core.pyi`) see them all; a keyword that none of the binding's structs
//! takes is refused, as Python refuses an unexpected keyword argument.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Declares a struct of keyword arguments and how `Given` reads it: each field is the
/// keyword of its name, its default after `=` (none: the keyword is required).
/// Attributes pass through, so the struct can be a `#[pyclass]`.
macro_rules! keywords {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$field_attr:meta])* $field:ident : $ty:ty $(= $default:expr)? ),* $(,)?
        }
    ) => {
        $(#[$attr])*
        $vis struct $name {
            $( $(#[$field_attr])* $field: $ty, )*
        }

        impl $crate::python::keywords::Keywords for $name {
            fn take(given: &mut $crate::python::keywords::Given<'_>) -> ::pyo3::PyResult<Self> {
                Ok(Self {
                    $( $field: keywords!(@read given, $field $(, $default)?), )*
                })
            }
        }
    };
    (@read $given:ident, $field:ident) => {
        $given.required(stringify!($field))?
    };
    (@read $given:ident, $field:ident, $default:expr) => {
        $given.or(stringify!($field), || $default)?
    };
}

/// A struct that `keywords!` declares.
pub(super) trait Keywords: Sized {
    fn take(given: &mut Given<'_>) -> PyResult<Self>;
}

/// The keyword arguments a binding was given, taken struct by struct.
pub(super) struct Given<'py> {
    /// The binding, as its errors name it.
    call: &'static str,
    /// What no struct has taken yet: a copy, the caller's dict stays as it was.
    left: Option<Bound<'py, PyDict>>,
}

impl<'py> Given<'py> {
    pub(super) fn new(call: &'static str, kwargs: Option<&Bound<'py, PyDict>>) -> PyResult<Self> {
        let left = kwargs.map(|k| k.copy()).transpose()?;
        Ok(Given { call, left })
    }

    /// Reads the keywords of `T`.
    pub(super) fn take<T: Keywords>(&mut self) -> PyResult<T> {
        T::take(self)
    }

    /// Reads the keywords of `T` and refuses any other.
    pub(super) fn only<T: Keywords>(mut self) -> PyResult<T> {
        let taken = self.take()?;
        self.finish()?;
        Ok(taken)
    }

    /// Refuses a keyword that no struct took.
    pub(super) fn finish(self) -> PyResult<()> {
        let Some(left) = self.left else {
            return Ok(());
        };
        match left.keys().iter().next() {
            None => Ok(()),
            Some(name) => Err(PyTypeError::new_err(format!(
                "{}() got an unexpected keyword argument {}",
                self.call,
                name.repr()?
            ))),
        }
    }

    /// The value given for `name`, else `default()`.
    pub(super) fn or<T: FromPyObjectOwned<'py>>(
        &mut self,
        name: &'static str,
        default: impl FnOnce() -> T,
    ) -> PyResult<T> {
        match self.remove(name)? {
            Some(value) => extract(name, &value),
            None => Ok(default()),
        }
    }

    /// The value given for `name`, which the binding cannot do without.
    pub(super) fn required<T: FromPyObjectOwned<'py>>(
        &mut self,
        name: &'static str,
    ) -> PyResult<T> {
        match self.remove(name)? {
            Some(value) => extract(name, &value),
            None => Err(PyTypeError::new_err(format!(
                "{}() missing required keyword argument: '{name}'",
                self.call
            ))),
        }
    }

    fn remove(&mut self, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(left) = &self.left else {
            return Ok(None);
        };
        let value = left.get_item(name)?;
        if value.is_some() {
            left.del_item(name)?;
        }
        Ok(value)
    }
}

/// `value` as a `T`; an error names the argument, as pyo3's own do.
fn extract<'py, T: FromPyObjectOwned<'py>>(name: &str, value: &Bound<'py, PyAny>) -> PyResult<T> {
    value.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        let py = value.py();
        let named = PyErr::from_type(
            e.get_type(py),
            format!("argument '{name}': {}", e.value(py)),
        );
        named.set_cause(py, Some(e));
        named
    })
}
