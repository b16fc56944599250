//! How the report writes numbers: three significant digits with SI prefixes, thousands
//! separators, ratios and goal verdicts.

/// Three significant digits with an SI prefix: `1.25 G`, `340 M`, `54.9 `.
pub(super) fn si(v: f64) -> String {
    let (scaled, prefix) = [(1e9, "G"), (1e6, "M"), (1e3, "k")]
        .iter()
        .find(|(f, _)| v.abs() >= *f)
        .map_or((v, ""), |(f, p)| (v / f, *p));
    format!("{} {prefix}", sig3(scaled))
}

/// Three significant digits.
pub(super) fn sig3(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A duration in ns, shown in the unit that fits: `1.44 ns`, `25.3 µs`, `51.0 ms`.
pub(super) fn time_ns(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{} s", sig3(ns / 1e9))
    } else if ns >= 1e6 {
        format!("{} ms", sig3(ns / 1e6))
    } else if ns >= 1e3 {
        format!("{} µs", sig3(ns / 1e3))
    } else {
        format!("{} ns", sig3(ns))
    }
}

/// Events per second: `1.25 G/s`.
pub(super) fn rate(v: f64) -> String {
    format!("{}/s", si(v))
}

/// An integer with thousands separators: `2,596,148`.
pub(super) fn thousands(v: impl Into<i128>) -> String {
    let v: i128 = v.into();
    let digits = v.unsigned_abs().to_string();
    let mut s = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            s.push(',');
        }
        s.push(c);
    }
    if v < 0 { format!("−{s}") } else { s }
}

pub(super) fn ratio(v: f64) -> String {
    format!("{}×", sig3(v))
}

pub(super) fn verdict(met: bool) -> String {
    if met {
        "met".into()
    } else {
        "**not met**".into()
    }
}

/// `v` rounded to the nearest integer (saturating): for figures shown as whole numbers.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // Saturating by definition.
pub(super) fn whole(v: f64) -> u64 {
    v.round().clamp(0.0, u64::MAX as f64) as u64
}
