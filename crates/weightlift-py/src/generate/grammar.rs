//! `LlamaGrammar` (llama-cpp-python's class of that name: a GBNF grammar), declared over this
//! class in `weightlift/_objects.py`, and `Model.grammar_mask`. Parsing, and converting JSON
//! schemas, is the engine's; this only converts.

use std::sync::Arc;

use pyo3::prelude::*;
use weightlift_engine::EngineError;
use weightlift_engine::generate::keywords::Gbnf;
use weightlift_engine::grammar::{Constraint, Grammar, json_schema_to_gbnf};

use super::args::read;
use crate::errors::{ToPyErr, eng};
use crate::model::Model;

#[pyclass(module = "weightlift._native", frozen, subclass)]
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
    /// llama-cpp-python's constructor: GBNF text `_grammar`, parsed.
    #[new]
    #[pyo3(signature = (*, _grammar))]
    fn new(_grammar: &str) -> PyResult<Self> {
        Ok(LlamaGrammar {
            grammar: parsed(_grammar)?,
        })
    }

    /// The GBNF text of the JSON texts JSON Schema `json_schema` (JSON text) accepts.
    #[staticmethod]
    fn _schema_gbnf(json_schema: &str) -> PyResult<String> {
        json_schema_to_gbnf(json_schema).map_err(|e| EngineError::from(e).to_pyerr())
    }

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
