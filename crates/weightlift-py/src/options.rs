//! A call's keyword arguments, as the Python wrapper that declares them (signature, defaults and
//! docstring, in `weightlift/_api.py`) hands them on: its `locals()`. What a keyword means, and
//! its grammar, are the core's ([`wp::Keywords`]); here they only become its data.

use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};
use pythonize::Depythonizer;
use weightlift_engine::planned::cache_spec;
use weightlift_plan as wp;

use crate::cache::Cache;
use crate::errors::py_err;

/// The keyword arguments of a call, as one dict.
#[derive(FromPyObject)]
#[pyo3(transparent)]
pub struct Kw<'py>(Bound<'py, PyDict>);

impl<'py> Kw<'py> {
    /// Argument `key`, converted as PyO3 converts a declared one (a note names the argument).
    pub fn get<T: FromPyObjectOwned<'py>>(&self, key: &str) -> PyResult<T> {
        let Some(value) = self.0.get_item(key)? else {
            return Err(PyTypeError::new_err(format!(
                "missing required argument '{key}'"
            )));
        };
        value.extract::<T>().map_err(|e| {
            let (e, note): (PyErr, _) = (e.into(), format!("while processing '{key}'"));
            let _ = e.value(self.0.py()).call_method1("add_note", (note,));
            e
        })
    }

    /// Argument `key`, None when absent or None.
    pub fn opt<T: FromPyObjectOwned<'py>>(&self, key: &str) -> PyResult<Option<T>> {
        match self.0.get_item(key)? {
            Some(_) => self.get(key),
            None => Ok(None),
        }
    }

    /// Argument `key` as a Python object, None when absent or None.
    pub fn any(&self, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.0.get_item(key)?.filter(|v| !v.is_none()))
    }

    /// The keywords as the core reads them ([`add`]).
    pub fn data(&self) -> PyResult<wp::Keywords> {
        let mut kw = wp::Keywords::default();
        for (key, v) in self.0.iter() {
            add(&mut kw, key.extract()?, &v)?;
        }
        Ok(kw)
    }
}

/// Keyword `key` set to `v` as the core reads it: a plain value as it is, a dataclass (a
/// `CacheSpec`, a `RuntimeSpec`) as its fields and a `Cache` as its shape (the data they stand
/// for), and any other object by its type's name, for the caller to take with [`Kw::any`] or the
/// grammar to refuse. A NaN or an infinity in a plain value is refused here, by name.
fn add(kw: &mut wp::Keywords, key: String, v: &Bound<'_, PyAny>) -> PyResult<()> {
    let data = if let Ok(c) = v.cast::<Cache>() {
        serde_json::to_value(cache_spec(c.get().cache.config())).map_err(|e| e.to_string())
    } else {
        let plain = if v.hasattr(intern!(v.py(), "__dataclass_fields__"))?
            && !v.is_instance_of::<PyType>()
        {
            v.py().import("dataclasses")?.call_method1("asdict", (v,))?
        } else {
            v.clone()
        };
        wp::keywords::json_value(&mut Depythonizer::from_object(&plain)).map_err(|e| e.to_string())
    };
    match data {
        Ok(value) => kw.insert(key, value),
        Err(e) => match wp::keywords::non_finite_refusal(&key, &e) {
            Some(refusal) => return Err(py_err(refusal)),
            None => kw.insert_foreign(key, v.get_type().name()?.to_string()),
        },
    }
    Ok(())
}

/// Argument `key`, `v`, read by the core's keyword grammar.
pub fn keyword<T: wp::FromKeyword>(key: &str, v: &Bound<'_, PyAny>) -> PyResult<Option<T>> {
    let mut kw = wp::Keywords::default();
    add(&mut kw, key.to_owned(), v)?;
    kw.get(key).map_err(py_err)
}

/// A cache dtype name (`"fp16"`, `"q4"`, ...), parsed by the planner's grammar.
pub struct CacheDTypeArg(pub wp::CacheDType);

impl<'a, 'py> FromPyObject<'a, 'py> for CacheDTypeArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let name: String = obj.extract()?;
        Ok(CacheDTypeArg(wp::CacheDType::parse(&name).map_err(py_err)?))
    }
}

/// Token ids given as an argument (`forward`, `detokenize`, `embed`): any sequence of ints,
/// numpy's included. An id that is no u32 is a TypeError naming its place, worded as the
/// generation keywords' `prompt` (PyO3 adds the argument's name); PyO3's own conversion would
/// raise a bare OverflowError that names neither.
pub struct TokenIds(pub Vec<u32>);

impl<'a, 'py> FromPyObject<'a, 'py> for TokenIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(ids) = obj.extract::<Vec<u32>>() {
            return Ok(TokenIds(ids));
        }
        // Only the error is left to find: the item that is not an id, or PyO3's word on a
        // value that is no sequence.
        let items: Vec<Bound<'py, PyAny>> = obj.extract()?;
        let (at, bad) = items
            .iter()
            .enumerate()
            .find(|(_, v)| v.extract::<u32>().is_err())
            .ok_or_else(|| PyTypeError::new_err("expected token ids (ints >= 0)"))?;
        Err(PyTypeError::new_err(format!(
            "item {at}: expected token ids (ints >= 0), got {}",
            bad.repr()?
        )))
    }
}
