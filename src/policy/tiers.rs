//! Tier assignments as text: the one parser the ingest bulk call, the CLI's
//! file and the ShardSet's ConfigMap share. A line is `<tenant> <tier>`
//! (any run of spaces or tabs between); blank lines and lines starting with
//! `#` are ignored. In the API's bulk call a tier of `-` clears the
//! tenant's assignment.

/// Longest tier name, and the pattern the CRD's `tierWeights` share:
/// `^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`.
pub const MAX_TIER_BYTES: usize = 63;

/// What is wrong with a tier name, if anything.
pub fn check_tier_name(tier: &str) -> Result<(), String> {
    let rule =
        "a tier starts with a letter or digit and has at most 63 letters, digits, '.', '_' and '-'";
    let Some(first) = tier.chars().next() else {
        return Err("must not be empty".into());
    };
    if tier.len() > MAX_TIER_BYTES {
        return Err(format!(
            "is {} bytes; the limit is {MAX_TIER_BYTES}",
            tier.len()
        ));
    }
    if !first.is_ascii_alphanumeric() {
        return Err(format!("starts with {first:?}; {rule}"));
    }
    if let Some(c) = tier
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!("contains {c:?}; {rule}"));
    }
    Ok(())
}

/// One assignment: the tenant, and its tier (`None`: clear it).
pub type Assignment = (String, Option<String>);

/// A line that is not an assignment: its number (from 1) and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadLine {
    pub line: usize,
    pub reason: String,
    /// The rule the line breaks, without any of its content: what a
    /// message may say to someone who may not read the text itself.
    pub rule: &'static str,
}

impl BadLine {
    /// `line N: <rule>`, quoting nothing from the line.
    pub fn redacted(&self) -> String {
        format!("line {}: {}", self.line, self.rule)
    }
}

impl std::fmt::Display for BadLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

/// Parse assignment lines. `check_tenant` is the tenant id rule (the
/// envelope's, passed in: this layer knows no envelope). With
/// `allow_clear`, a tier of `-` clears. Returns the good assignments in
/// order (a tenant listed twice: the later line wins, as the writes apply in
/// order) and every bad line; `max` bounds how many assignments are read
/// (one past it is a bad line, and reading stops).
pub fn parse_assignments(
    text: &str,
    allow_clear: bool,
    max: usize,
    check_tenant: impl Fn(&str) -> Result<(), String>,
) -> (Vec<Assignment>, Vec<BadLine>) {
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let n = i + 1;
        let mut words = line.split_ascii_whitespace();
        let (Some(tenant), Some(tier), None) = (words.next(), words.next(), words.next()) else {
            bad.push(BadLine {
                line: n,
                reason: format!("expected `<tenant> <tier>`, got {:?}", clip(line)),
                rule: "expected `<tenant> <tier>`",
            });
            continue;
        };
        if let Err(r) = check_tenant(tenant) {
            bad.push(BadLine {
                line: n,
                reason: format!("tenant {:?}: {r}", clip(tenant)),
                rule: "not a valid tenant id",
            });
            continue;
        }
        let tier = if allow_clear && tier == "-" {
            None
        } else if let Err(r) = check_tier_name(tier) {
            bad.push(BadLine {
                line: n,
                reason: format!("tier {:?}: {r}", clip(tier)),
                rule: "not a valid tier name (a letter or digit, then up to 62 letters, digits, '.', '_' or '-')",
            });
            continue;
        } else {
            Some(tier.to_string())
        };
        if good.len() == max {
            bad.push(BadLine {
                line: n,
                reason: format!("more than {max} assignments; split the list"),
                rule: "past the most assignments one list may hold",
            });
            break;
        }
        good.push((tenant.to_string(), tier));
    }
    (good, bad)
}

fn clip(s: &str) -> String {
    if s.len() <= 80 {
        return s.to_string();
    }
    let mut end = 77;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant_ok(t: &str) -> Result<(), String> {
        if t.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            Ok(())
        } else {
            Err("bad tenant".into())
        }
    }

    #[test]
    fn tier_names_follow_the_crd_pattern() {
        for ok in ["gold", "a", "Tier-2", "p.1_x", &"x".repeat(63)] {
            assert_eq!(check_tier_name(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "-gold",
            ".x",
            "gold tier",
            "gold=4",
            "g\u{202e}",
            &"x".repeat(64),
        ] {
            assert!(check_tier_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lines_parse_comments_and_blanks_skip_and_bad_lines_are_named() {
        let text =
            "# tiers\nacme gold\n\n  beta\tsilver  \nno-tier\nx y z\nbad! gold\nc =bad\nd -\n";
        let (good, bad) = parse_assignments(text, false, 100, tenant_ok);
        assert_eq!(
            good,
            vec![
                ("acme".to_string(), Some("gold".to_string())),
                ("beta".to_string(), Some("silver".to_string())),
            ]
        );
        let lines: Vec<usize> = bad.iter().map(|b| b.line).collect();
        assert_eq!(lines, vec![5, 6, 7, 8, 9], "{bad:?}");
        assert!(bad[2].reason.contains("tenant \"bad!\""), "{}", bad[2]);
        assert!(bad[3].reason.contains("tier \"=bad\""), "{}", bad[3]);
        // '-' clears only where clearing is allowed
        let (good, bad) = parse_assignments("d -\n", true, 100, tenant_ok);
        assert_eq!(good, vec![("d".to_string(), None)]);
        assert!(bad.is_empty());
    }

    #[test]
    fn a_redacted_bad_line_quotes_nothing_of_the_text() {
        let text = "s3cr3t-customer-name gold extra\nevil\u{202e}name gold\nok =hidden-tier\n";
        let (_, bad) = parse_assignments(text, false, 100, tenant_ok);
        assert_eq!(bad.len(), 3);
        for b in &bad {
            let r = b.redacted();
            for secret in ["s3cr3t", "evil", "hidden"] {
                assert!(!r.contains(secret), "{r}");
            }
            assert!(r.starts_with(&format!("line {}: ", b.line)), "{r}");
        }
    }

    #[test]
    fn reading_stops_one_past_the_bound() {
        let text: String = (0..5).map(|i| format!("t{i} gold\n")).collect();
        let (good, bad) = parse_assignments(&text, false, 3, tenant_ok);
        assert_eq!(good.len(), 3);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].line, 4);
    }
}
