//! Byte sizes: parsing `"24GiB"`, `"512MB"`, `"1000"` and printing them back.

use crate::error::{PlanError, Result};

const UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("kb", 1000),
    ("mb", 1000 * 1000),
    ("gb", 1000 * 1000 * 1000),
    ("tb", 1000 * 1000 * 1000 * 1000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

/// Parse a byte size: a number with an optional unit. `B`, `KB`/`MB`/`GB`/`TB` are powers of
/// 1000, `KiB`/`MiB`/`GiB`/`TiB` powers of 1024 (case-insensitive); a plain number is bytes.
/// The number may have a decimal fraction (`"1.5GiB"`); the result is rounded down to a byte,
/// computed in integers so it is exact.
pub fn parse_size(text: &str) -> Result<u64> {
    let err = |reason: &str| PlanError::Size {
        text: text.to_string(),
        reason: reason.to_string(),
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    if num.is_empty() {
        return Err(err(
            "expected a number followed by an optional unit such as GiB or MB",
        ));
    }
    let mult = if unit.is_empty() {
        1
    } else {
        UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .map(|(_, m)| *m)
            .ok_or_else(|| err("unknown unit; use B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"))?
    };
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if frac.contains('.') || (int.is_empty() && frac.is_empty()) || frac.len() > 18 {
        return Err(err("malformed number"));
    }
    let int_v: u64 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| err("number too large"))?
    };
    let mut total = int_v
        .checked_mul(mult)
        .ok_or_else(|| err("size overflows 64 bits"))?;
    if !frac.is_empty() {
        let frac_v: u128 = frac.parse().map_err(|_| err("malformed fraction"))?;
        let denom = 10u128.pow(frac.len() as u32);
        let extra = frac_v * u128::from(mult) / denom;
        total = total
            .checked_add(u64::try_from(extra).map_err(|_| err("size overflows 64 bits"))?)
            .ok_or_else(|| err("size overflows 64 bits"))?;
    }
    Ok(total)
}

/// Format bytes for people: `"1.50 GiB"`, `"512.00 MiB"`, `"17 B"`; `u64::MAX` prints as
/// `"unbounded"`.
pub fn fmt_bytes(b: u64) -> String {
    if b == u64::MAX {
        return "unbounded".to_string();
    }
    const K: f64 = 1024.0;
    let f = b as f64;
    if f >= K * K * K * K {
        format!("{:.2} TiB", f / (K * K * K * K))
    } else if f >= K * K * K {
        format!("{:.2} GiB", f / (K * K * K))
    } else if f >= K * K {
        format!("{:.2} MiB", f / (K * K))
    } else if f >= K {
        format!("{:.2} KiB", f / K)
    } else {
        format!("{b} B")
    }
}

/// Bytes as GiB with two decimals, for table columns.
pub fn gib(b: u64) -> String {
    if b == u64::MAX {
        return "inf".to_string();
    }
    format!("{:.2}", b as f64 / (1u64 << 30) as f64)
}

/// Bytes as MiB with one decimal, for table columns.
pub fn mib(b: u64) -> String {
    if b == u64::MAX {
        return "inf".to_string();
    }
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert_eq!(parse_size("24GiB").unwrap(), 24 << 30);
        assert_eq!(parse_size("24gib").unwrap(), 24 << 30);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("7B").unwrap(), 7);
        assert_eq!(parse_size("4KB").unwrap(), 4000);
        assert_eq!(parse_size("1TiB").unwrap(), 1 << 40);
        let e = parse_size("12 furlongs").unwrap_err().to_string();
        assert!(e.contains("unknown unit"), "{e}");
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1.2.3GiB").is_err());
        assert!(parse_size("99999999999999999999TiB").is_err());
        assert!(parse_size("20000000TiB").is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_bytes(17), "17 B");
        assert_eq!(fmt_bytes(3 << 29), "1.50 GiB");
        assert_eq!(fmt_bytes(u64::MAX), "unbounded");
    }
}
