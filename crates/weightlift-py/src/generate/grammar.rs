//! `LlamaGrammar` (llama-cpp-python's class of that name: a GBNF grammar) and
//! `Model.grammar_mask`. Parsing, and converting JSON schemas, is the engine's; this only
//! converts.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use weightlift_engine::EngineError;
use weightlift_engine::generate::keywords::Gbnf;
use weightlift_engine::grammar::{Constraint, Grammar};

use super::args::read;
use crate::errors::{ToPyErr, eng, io_error};
use crate::model::Model;

/// A parsed GBNF grammar (llama.cpp's grammar format, root rule `root`), as llama-cpp-python's
/// `LlamaGrammar`: pass it as `grammar=` to keep generated text inside it. A grammar that does
/// not parse raises `GrammarError` (a ValueError) naming the line, the column and what was
/// expected.
#[pyclass(module = "weightlift._native", frozen)]
pub struct LlamaGrammar {
    pub(crate) grammar: Arc<Grammar>,
}

fn parsed(text: &str) -> PyResult<Arc<Grammar>> {
    Grammar::parse(text)
        .map(Arc::new)
        .map_err(|e| EngineError::from(e).to_pyerr())
}

#[pymethods]
impl LlamaGrammar {
    /// Parse GBNF `grammar`. `verbose` is llama-cpp-python's and changes nothing: errors raise.
    #[staticmethod]
    #[pyo3(signature = (grammar, verbose = true))]
    fn from_string(grammar: &str, verbose: bool) -> PyResult<LlamaGrammar> {
        let _ = verbose;
        Ok(LlamaGrammar {
            grammar: parsed(grammar)?,
        })
    }

    /// The grammar of the JSON texts that JSON Schema `json_schema` (JSON text) accepts, as
    /// llama-cpp-python's `from_json_schema` (llama.cpp's converter) lays them out: required
    /// properties first in schema order, at most one space between tokens. A keyword it cannot
    /// enforce (`pattern`, most `format`s, bounds on `number`, ...) raises `UnsupportedError`
    /// naming the keyword and where it is in the schema, where llama-cpp-python ignores it;
    /// text that is not a schema raises `PlanError`. `verbose` changes nothing.
    #[staticmethod]
    #[pyo3(signature = (json_schema, verbose = true))]
    fn from_json_schema(json_schema: &str, verbose: bool) -> PyResult<LlamaGrammar> {
        let _ = verbose;
        let grammar =
            Grammar::from_json_schema(json_schema).map_err(|e| EngineError::from(e).to_pyerr())?;
        Ok(LlamaGrammar {
            grammar: Arc::new(grammar),
        })
    }

    /// Read and parse the GBNF file `file` (a path). An unreadable file raises the matching
    /// `OSError`.
    #[staticmethod]
    #[pyo3(signature = (file, verbose = true))]
    fn from_file(file: PathBuf, verbose: bool) -> PyResult<LlamaGrammar> {
        let _ = verbose;
        let text = std::fs::read_to_string(&file).map_err(|e| io_error(&file, &e))?;
        Ok(LlamaGrammar {
            grammar: parsed(&text)?,
        })
    }

    /// The GBNF text.
    #[getter]
    fn text(&self) -> &str {
        self.grammar.source()
    }

    fn __repr__(&self) -> String {
        format!("<LlamaGrammar: {} rules>", self.grammar.n_rules())
    }
}

#[pymethods]
impl Model {
    fn grammar_mask<'py>(
        &self,
        py: Python<'py>,
        grammar: &Bound<'_, PyAny>,
        logits: numpy::PyReadonlyArray1<'_, f32>,
    ) -> PyResult<Bound<'py, numpy::PyArray1<f32>>> {
        let grammar = match grammar.cast::<LlamaGrammar>() {
            Ok(g) => Arc::clone(&g.get().grammar),
            Err(_) => parsed(&read::<Gbnf>(grammar, "grammar")?.0)?,
        };
        let mut row = logits.as_slice()?.to_vec();
        let tok = eng(self.lock()?.model.tokenizer())?;
        let mut constraint = Constraint::new(grammar, &tok, row.len())
            .map_err(|e| EngineError::from(e).to_pyerr())?;
        constraint
            .mask(&mut row)
            .map_err(|e| EngineError::from(e).to_pyerr())?;
        Ok(numpy::PyArray1::from_vec(py, row))
    }
}
