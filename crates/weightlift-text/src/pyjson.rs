//! The two helpers chat templates call that minijinja does not have in Python's form:
//!
//! - `tojson`, as transformers and llama-cpp-python define it for templates: Python's
//!   `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, so
//!   `", "` and `": "` between items (`","` with an indent), keys in the order given, text kept
//!   as it is; minijinja's own `tojson` writes compact JSON and escapes HTML characters, which
//!   changes the prompt a model was trained on.
//! - `strftime_now(format)`: the current UTC date and time through a `strftime` format (the
//!   directives templates use: `%d %b %Y` and the like).
//!
//! Both are written here because serde_json's `Formatter` trait lets its serializer produce
//! Python's layout, and no date crate is needed for a handful of directives.

use minijinja::value::{Kwargs, Value};
use minijinja::{Error, ErrorKind};
use serde::Serialize;
use serde_json::ser::{CharEscape, Formatter};
use std::io::{self, Write};

/// The `tojson` filter with Python's keyword arguments.
pub(crate) fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(usize::try_from(v).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a count or a string",
                )
            })?),
        }),
    };
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be an (item, key) pair",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        sort(&mut json);
    }
    let format = PyFormat {
        item: item.into_bytes(),
        key: key.into_bytes(),
        indent: indent.map(String::into_bytes),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        depth: 0,
        has_value: false,
    };
    let mut out = Vec::new();
    json.serialize(&mut serde_json::Serializer::with_formatter(
        &mut out, format,
    ))
    .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    // The serializer writes UTF-8 (escaped to ASCII with ensure_ascii).
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(text))
}

fn sort(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.sort_keys();
            m.values_mut().for_each(sort);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(sort),
        _ => {}
    }
}

/// Python's `json.dumps` layout: its separators, and with an indent one item a line.
struct PyFormat {
    item: Vec<u8>,
    key: Vec<u8>,
    indent: Option<Vec<u8>>,
    ensure_ascii: bool,
    depth: usize,
    has_value: bool,
}

impl PyFormat {
    fn newline<W: ?Sized + Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.depth {
                w.write_all(indent)?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + Write>(&mut self, w: &mut W, c: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(c)
    }

    fn close<W: ?Sized + Write>(&mut self, w: &mut W, c: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(c)
    }

    fn next<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(&self.item)?;
        }
        self.newline(w)
    }
}

impl Formatter for PyFormat {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.next(w, first)
    }

    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.next(w, first)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(&self.key)
    }

    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn write_string_fragment<W: ?Sized + Write>(&mut self, w: &mut W, s: &str) -> io::Result<()> {
        if !self.ensure_ascii {
            return w.write_all(s.as_bytes());
        }
        for c in s.chars() {
            if c.is_ascii() {
                w.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    write!(w, "\\u{u:04x}")?;
                }
            }
        }
        Ok(())
    }

    fn write_char_escape<W: ?Sized + Write>(&mut self, w: &mut W, e: CharEscape) -> io::Result<()> {
        // Python writes the same escapes as serde_json, but spells control bytes in lower-case
        // hex (`\u001b`), as serde_json does too.
        serde_json::ser::CompactFormatter.write_char_escape(w, e)
    }
}

/// `strftime_now(format)`: the current UTC time through `format`.
pub(crate) fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(format, i64::try_from(secs).unwrap_or(0))
}

/// `format` (`%d %b %Y`, ...) at `unix` seconds, UTC.
pub(crate) fn strftime(format: &str, unix: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0);
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        match d {
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:>2}")),
            'm' => out.push_str(&format!("{month:02}")),
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'H' => out.push_str(&format!("{:02}", secs / 3600)),
            'M' => out.push_str(&format!("{:02}", secs / 60 % 60)),
            'S' => out.push_str(&format!("{:02}", secs % 60)),
            'F' => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: the directive %{other} is not supported"),
                ));
            }
        }
    }
    Ok(out)
}

/// (year, month 1-12, day 1-31) of a day count from 1970-01-01 (the proleptic Gregorian
/// calendar, by eras of 400 years).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_the_calendars() {
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
        // 2024-07-26 (a Friday) and 2000-02-29.
        assert_eq!(
            strftime("%A %d %B %Y", 1_721_952_000).unwrap(),
            "Friday 26 July 2024"
        );
        assert_eq!(
            strftime("%F %H:%M:%S", 951_782_400 + 3_723).unwrap(),
            "2000-02-29 01:02:03"
        );
        assert!(strftime("%Q", 0).is_err());
    }
}
