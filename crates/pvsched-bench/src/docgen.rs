//! `pvsched-bench doc`: the results page's figures, drawn from the JSON
//! reports it cites and never typed by hand.
//!
//! The page marks what is generated; everything between the marks is
//! rewritten from the report:
//!
//! ```text
//! <!-- generated from docs/bench/s1.json -->
//! (the report's tables, `Render::markdown`)
//! <!-- end generated -->
//! ```
//!
//! and a figure inside a sentence names its JSON value (an RFC 6901 pointer;
//! `~1` is a `/` inside a key) and how many decimals to show:
//!
//! ```text
//! does <!--v docs/bench/s6.json#/cells/0/ratio 2-->1.51<!--/v-->× vanilla's work
//! ```
//!
//! `pvsched-bench doc` rewrites the page; `--check` only compares and exits
//! 1 listing every figure that differs, which is how CI keeps the page and
//! the JSON in step. Paths are relative to the repository root.

use serde_json::Value;
use std::path::{Path, PathBuf};

/// A report read back from its committed JSON and drawn as the tables a
/// results page shows. Numbers are rounded here and only here.
pub trait Render: serde::de::DeserializeOwned {
    /// The report's tables (and verdicts) as markdown.
    fn markdown(&self) -> String;
}

/// Errors of `pvsched-bench doc`.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum DocError {
    #[error("doc: reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("doc: writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("doc: {path} is not a JSON report: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "doc: {path}: scenario {scenario:?} has no renderer (s1-s6 have; was it written by pvsched-bench?)"
    )]
    Scenario { path: PathBuf, scenario: String },
    #[error("doc: {page} line {line}: {what}")]
    Marker {
        page: PathBuf,
        line: usize,
        what: String,
    },
    #[error("doc: {page} line {line}: {file} has no number at {pointer}")]
    Pointer {
        page: PathBuf,
        line: usize,
        file: String,
        pointer: String,
    },
}

/// Draws one report, chosen by its `scenario` field.
pub type Renderer = fn(&Value) -> Result<String, serde_json::Error>;

/// Reads a report of type `R` back and draws it.
fn draw<R: Render>(v: &Value) -> Result<String, serde_json::Error> {
    Ok(R::deserialize(v)?.markdown())
}

/// Every scenario's report type, by its `scenario` field.
const RENDERERS: &[(&str, Renderer)] = &[
    ("s1", draw::<crate::report::ScenarioReport>),
    ("s2", draw::<crate::report::ScenarioReport>),
    ("s3", draw::<crate::report::ScenarioReport>),
    ("s4", draw::<crate::s4::S4Report>),
    ("s5", draw::<crate::report::ScenarioReport>),
    ("s6", draw::<crate::s6::S6Report>),
];

/// The renderer of a scenario's report, if it has one.
pub fn renderer(scenario: &str) -> Option<Renderer> {
    RENDERERS
        .iter()
        .find(|(s, _)| *s == scenario)
        .map(|(_, r)| *r)
}

const BEGIN: &str = "<!-- generated from ";
const END: &str = "<!-- end generated -->";
const VALUE: &str = "<!--v ";
const VALUE_END: &str = "<!--/v-->";

/// One figure that differs between the page and its JSON.
#[derive(Debug, PartialEq)]
pub struct Difference {
    /// Line of the page (1-based) where the figure or block starts.
    pub line: usize,
    /// What the page says (a block is shown by its first differing line).
    pub page: String,
    /// What the JSON gives.
    pub json: String,
}

/// The page regenerated from its JSON, and what differed.
pub struct Regenerated {
    /// The whole page with every generated part redrawn.
    pub text: String,
    /// Each generated part that differed from the page.
    pub differences: Vec<Difference>,
}

/// Regenerates every marked part of `page_text` (the page at `page`, for
/// messages) from the JSON files under `root`.
pub fn regenerate(page: &Path, page_text: &str, root: &Path) -> Result<Regenerated, DocError> {
    let mut cache: Vec<(String, Value)> = Vec::new();
    let mut load = |file: &str| -> Result<Value, DocError> {
        if let Some((_, v)) = cache.iter().find(|(f, _)| f == file) {
            return Ok(v.clone());
        }
        let path = root.join(file);
        let text = std::fs::read_to_string(&path).map_err(|source| DocError::Read {
            path: path.clone(),
            source,
        })?;
        let v: Value =
            serde_json::from_str(&text).map_err(|source| DocError::Json { path, source })?;
        cache.push((file.to_string(), v.clone()));
        Ok(v)
    };
    let mut out = String::with_capacity(page_text.len());
    let mut differences = Vec::new();
    let mut lines = page_text.split_inclusive('\n').enumerate();
    while let Some((i, line)) = lines.next() {
        let marker = |what: String| DocError::Marker {
            page: page.to_path_buf(),
            line: i + 1,
            what,
        };
        let trimmed = line.trim_end();
        if let Some(rest) = trimmed.strip_prefix(BEGIN) {
            let file = rest
                .strip_suffix("-->")
                .map(str::trim)
                .ok_or_else(|| marker(format!("`{BEGIN}FILE -->` is not closed")))?;
            let v = load(file)?;
            let scenario = v.get("scenario").and_then(Value::as_str).unwrap_or("");
            let draw = renderer(scenario).ok_or_else(|| DocError::Scenario {
                path: root.join(file),
                scenario: scenario.to_string(),
            })?;
            let fresh = draw(&v).map_err(|source| DocError::Json {
                path: root.join(file),
                source,
            })?;
            let mut old = String::new();
            let mut closed = false;
            for (_, l) in lines.by_ref() {
                if l.trim_end() == END {
                    closed = true;
                    break;
                }
                old.push_str(l);
            }
            if !closed {
                return Err(marker(format!("no `{END}` after this block")));
            }
            let fresh = if fresh.ends_with('\n') || fresh.is_empty() {
                fresh
            } else {
                fresh + "\n"
            };
            if old != fresh {
                differences.push(first_difference(i + 2, &old, &fresh));
            }
            out.push_str(line);
            out.push_str(&fresh);
            out.push_str(END);
            out.push('\n');
            continue;
        }
        out.push_str(&inline_values(
            page,
            i + 1,
            line,
            &mut load,
            &mut differences,
        )?);
    }
    Ok(Regenerated {
        text: out,
        differences,
    })
}

/// Redraws the `<!--v FILE#POINTER DECIMALS-->X<!--/v-->` figures of one line.
fn inline_values(
    page: &Path,
    line_no: usize,
    line: &str,
    load: &mut impl FnMut(&str) -> Result<Value, DocError>,
    differences: &mut Vec<Difference>,
) -> Result<String, DocError> {
    let marker = |what: &str| DocError::Marker {
        page: page.to_path_buf(),
        line: line_no,
        what: what.to_string(),
    };
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(VALUE) {
        out.push_str(&rest[..at]);
        let tail = &rest[at + VALUE.len()..];
        let close = tail
            .find("-->")
            .ok_or_else(|| marker("`<!--v` is not closed by `-->`"))?;
        let spec = tail[..close].trim();
        let after = &tail[close + 3..];
        let end = after
            .find(VALUE_END)
            .ok_or_else(|| marker("no `<!--/v-->` after a `<!--v ...-->`"))?;
        let shown = &after[..end];
        let (target, decimals) = spec
            .rsplit_once(' ')
            .ok_or_else(|| marker("`<!--v FILE#POINTER DECIMALS-->` needs the decimals"))?;
        let decimals: usize = decimals
            .parse()
            .map_err(|_| marker("the decimals of a `<!--v` figure are not a number"))?;
        let (file, pointer) = target
            .split_once('#')
            .ok_or_else(|| marker("`<!--v FILE#POINTER ...-->` needs `#`"))?;
        let v = load(file)?;
        let number =
            v.pointer(pointer)
                .and_then(Value::as_f64)
                .ok_or_else(|| DocError::Pointer {
                    page: page.to_path_buf(),
                    line: line_no,
                    file: file.to_string(),
                    pointer: pointer.to_string(),
                })?;
        let fresh = format!("{number:.decimals$}");
        if fresh != shown {
            differences.push(Difference {
                line: line_no,
                page: shown.to_string(),
                json: fresh.clone(),
            });
        }
        out.push_str(&rest[at..at + VALUE.len() + close + 3]);
        out.push_str(&fresh);
        out.push_str(VALUE_END);
        rest = &after[end + VALUE_END.len()..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The first line where a generated block differs, for the message.
fn first_difference(first_line: usize, old: &str, fresh: &str) -> Difference {
    let mut a = old.lines();
    let mut b = fresh.lines();
    let mut line = first_line;
    loop {
        match (a.next(), b.next()) {
            (Some(x), Some(y)) if x == y => line += 1,
            (x, y) => {
                return Difference {
                    line,
                    page: x.unwrap_or("(block ends)").to_string(),
                    json: y.unwrap_or("(block ends)").to_string(),
                };
            }
        }
    }
}

/// `pvsched-bench doc [--check] [PAGE]`: returns the differences found
/// (after rewriting the page unless `check`).
pub fn run(page: &Path, root: &Path, check: bool) -> Result<Vec<Difference>, DocError> {
    let text = std::fs::read_to_string(page).map_err(|source| DocError::Read {
        path: page.to_path_buf(),
        source,
    })?;
    let fresh = regenerate(page, &text, root)?;
    if !check && fresh.text != text {
        std::fs::write(page, &fresh.text).map_err(|source| DocError::Write {
            path: page.to_path_buf(),
            source,
        })?;
    }
    Ok(fresh.differences)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with(file: &str, json: &str) -> tempdir::Dir {
        let d = tempdir::Dir::new();
        std::fs::write(d.0.join(file), json).unwrap();
        d
    }

    mod tempdir {
        /// A directory removed on drop.
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let p = std::env::temp_dir().join(format!(
                    "pvsched-docgen-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn an_inline_figure_is_redrawn_and_an_edit_is_a_difference() {
        let d = root_with("r.json", r#"{"cells": {"2x2/cpu": {"ratio": 1.5137}}}"#);
        let page = "does <!--v r.json#/cells/2x2~1cpu/ratio 2-->1.51<!--/v-->× the work\n";
        let r = regenerate(Path::new("p.md"), page, &d.0).unwrap();
        assert_eq!(r.text, page);
        assert!(r.differences.is_empty());
        let edited = page.replace(">1.51<", ">1.61<");
        let r = regenerate(Path::new("p.md"), &edited, &d.0).unwrap();
        assert_eq!(r.text, page, "the rewrite puts the JSON's figure back");
        assert_eq!(
            r.differences,
            vec![Difference {
                line: 1,
                page: "1.61".into(),
                json: "1.51".into()
            }]
        );
    }

    #[test]
    fn a_missing_value_or_an_unclosed_block_is_an_error_not_a_pass() {
        let d = root_with("r.json", r#"{"scenario": "s1"}"#);
        let page = "x <!--v r.json#/nothing 2-->1<!--/v-->\n";
        assert!(matches!(
            regenerate(Path::new("p.md"), page, &d.0),
            Err(DocError::Pointer { .. })
        ));
        let page = "<!-- generated from r.json -->\nold\n";
        assert!(regenerate(Path::new("p.md"), page, &d.0).is_err());
    }
}
