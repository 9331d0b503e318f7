//! Finds SQL that reads the database's wall clock.
//!
//! Time in this project flows from `compute_now()` so that tests can
//! simulate it; SQL that calls `now()` or `CURRENT_TIMESTAMP` silently bypasses
//! that clock. This module scans Rust string literals and `.sql` files for such
//! calls so a test can fail the build when one slips in.

use std::fmt;
use std::path::{Path, PathBuf};

/// Marker that exempts one physical source line from the check, for the rare
/// place where reading the database clock is deliberate.
const ALLOW_MARKER: &str = "check-sql-now: allow";

/// Wall-clock functions matched as whole words, with or without parentheses.
const CLOCK_WORDS: &[&str] = &[
    "current_timestamp",
    "localtimestamp",
    "transaction_timestamp",
    "statement_timestamp",
    "clock_timestamp",
];

/// One source line that reads the wall clock; reported so a human can fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// File containing the offending line.
    pub path: PathBuf,
    /// 1-based line number within `path`.
    pub line: usize,
    /// The offending source line, trimmed.
    pub text: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.path.display(), self.line, self.text)
    }
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Whether `sql` calls a function that reads the database's wall clock.
///
/// Matching is case-insensitive. `now()` counts only when not preceded by an
/// identifier character, `.`, `:` or `"`, so Rust calls such as `Utc::now()`
/// or `compute_now()` appearing in the same text are not flagged.
pub fn reads_wall_clock(sql: &str) -> bool {
    let s = sql.to_ascii_lowercase();
    let b = s.as_bytes();
    let before_ok =
        |i: usize, extra: &[u8]| i == 0 || !(is_ident(b[i - 1]) || extra.contains(&b[i - 1]));
    let skip_ws = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    for (i, _) in s.match_indices("now") {
        if !before_ok(i, b".:\"") {
            continue;
        }
        let open = skip_ws(i + 3);
        if open < b.len() && b[open] == b'(' {
            let close = skip_ws(open + 1);
            if close < b.len() && b[close] == b')' {
                return true;
            }
        }
    }
    CLOCK_WORDS.iter().any(|word| {
        s.match_indices(word).any(|(i, _)| {
            let end = i + word.len();
            before_ok(i, b"") && (end >= b.len() || !is_ident(b[end]))
        })
    })
}

/// Returns the content of every string literal in Rust source `src`.
///
/// Each physical line of a literal's content becomes one entry paired with
/// its 1-based source line number, so findings point at the exact line.
/// Content is returned as written (escapes are not decoded). Comments, char
/// literals and lifetimes are skipped so that they cannot be mistaken for
/// string delimiters.
pub fn rust_string_literals(src: &str) -> Vec<(usize, String)> {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0usize;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                // Escaped char literal such as '\'' or '\u{7f}'.
                i += 3; // Past the quote, the backslash and the escaped char.
                while i < c.len() && c[i] != '\'' && c[i] != '\n' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' && at(i + 1) != '\n' {
                i += 3; // Plain char literal such as 'a' or '"'.
            } else {
                i += 1; // Lifetime or label: its name is skipped as an identifier.
            }
        } else if ch == '"' {
            i = read_string(&c, i + 1, 0, &mut line, &mut out);
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw = matches!(word.as_str(), "r" | "br" | "cr");
            if raw {
                let mut hashes = 0;
                while at(i + hashes) == '#' {
                    hashes += 1;
                }
                if at(i + hashes) == '"' {
                    i = read_string(&c, i + hashes + 1, hashes + 1, &mut line, &mut out);
                }
            } else if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                i = read_string(&c, i + 1, 0, &mut line, &mut out);
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Reads a string body starting at `i` (just past the opening quote) and
/// returns the index after the closing delimiter. `raw` is 0 for an escaped
/// string, or 1 + the number of `#`s for a raw string.
fn read_string(
    c: &[char],
    mut i: usize,
    raw: usize,
    line: &mut usize,
    out: &mut Vec<(usize, String)>,
) -> usize {
    let mut cur = String::new();
    while i < c.len() {
        let ch = c[i];
        if raw == 0 && ch == '\\' && i + 1 < c.len() {
            cur.push(ch);
            i += 1;
            if c[i] == '\n' {
                out.push((*line, std::mem::take(&mut cur)));
                *line += 1;
            } else {
                cur.push(c[i]);
            }
            i += 1;
            continue;
        }
        if ch == '"' && (1..raw).all(|k| c.get(i + k) == Some(&'#')) {
            out.push((*line, cur));
            return i + raw.max(1);
        }
        if ch == '\n' {
            out.push((*line, std::mem::take(&mut cur)));
            *line += 1;
        } else {
            cur.push(ch);
        }
        i += 1;
    }
    out.push((*line, cur));
    i
}

/// Scans `root/dir` for each of `dirs` (recursively, skipping `target` and
/// hidden directories) and reports every line that reads the wall clock.
///
/// Rust files are checked string literal by string literal; `.sql` files line
/// by line after stripping `--` comments. `exempt_files` lists files,
/// relative to `root` with `/` separators, whose clock use is intentional.
/// A line containing `check-sql-now: allow` is never reported. Unreadable
/// files and missing directories are skipped. Results are sorted by path and
/// line so output is stable.
pub fn scan_tree(root: &Path, dirs: &[&str], exempt_files: &[&str]) -> Vec<Finding> {
    let mut files = Vec::new();
    for dir in dirs {
        collect_files(&root.join(dir), &mut files);
    }
    let mut findings = Vec::new();
    for path in files {
        let Ok(src) = std::fs::read_to_string(&path) else {
            continue;
        };
        let lines: Vec<&str> = src.lines().collect();
        let mut push = |line: usize, text: &str| {
            findings.push(Finding {
                path: path.clone(),
                line,
                text: text.trim().to_owned(),
            });
        };
        let rel = path.strip_prefix(root).unwrap_or(&path);
        let rel: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if exempt_files.contains(&rel.join("/").as_str()) {
            continue;
        }
        match path.extension().and_then(|e| e.to_str()) {
            Some("rs") => {
                for (line, text) in rust_string_literals(&src) {
                    let source = lines.get(line - 1).copied().unwrap_or("");
                    if reads_wall_clock(&text) && !source.contains(ALLOW_MARKER) {
                        push(line, source);
                    }
                }
            }
            Some("sql") => {
                for (idx, source) in lines.iter().enumerate() {
                    let code = source.split("--").next().unwrap_or("");
                    if reads_wall_clock(code) && !source.contains(ALLOW_MARKER) {
                        push(idx + 1, source);
                    }
                }
            }
            _ => {}
        }
    }
    findings.sort_by(|a, b| (&a.path, a.line).cmp(&(&b.path, b.line)));
    findings.dedup();
    findings
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        match entry.file_type() {
            // Build output and hidden directories (.git, ...) hold no project SQL.
            Ok(t) if t.is_dir() && name != "target" && !name.starts_with('.') => {
                collect_files(&path, out);
            }
            Ok(t) if t.is_file() => out.push(path),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(src: &str) -> Vec<String> {
        rust_string_literals(src)
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    #[test]
    fn wall_clock_detection() {
        let yes = "SELECT now()|select NOW ()|x = now( )|CURRENT_TIMESTAMP|default clock_timestamp()|(localtimestamp)";
        for sql in yes.split('|') {
            assert!(reads_wall_clock(sql), "{sql}");
        }
        let no = "compute_now()|Utc::now()|my_current_timestamp_col|nowhere()|t.now()|\"now\"|current_timestamps";
        for sql in no.split('|') {
            assert!(!reads_wall_clock(sql), "{sql}");
        }
    }

    #[test]
    fn lexer_handles_raw_strings_and_comments() {
        assert_eq!(
            texts(r###"let q = r#"SELECT "x", now()"#;"###),
            vec![r#"SELECT "x", now()"#]
        );
        assert_eq!(
            texts(r###"f(br##"a"#b"##, b"c", r"d\")"###),
            vec![r##"a"#b"##, "c", r"d\"]
        );
        assert!(texts("// comment now()\n/// doc \"now()\"\nlet x = 1;").is_empty());
        assert!(texts("/* now() /* \"nested\" */ \"still\" */ let x = 1;").is_empty());
    }

    #[test]
    fn lexer_handles_chars_lifetimes_and_escapes() {
        assert_eq!(texts(r#"let q = '"'; let s = "now()";"#), vec!["now()"]);
        assert_eq!(
            texts(r#"let q = '\''; let e = '\\'; let s = "a";"#),
            vec!["a"]
        );
        assert_eq!(
            texts("fn f<'a>(x: &'a str) -> &'static str { \"now()\" }"),
            vec!["now()"]
        );
        assert_eq!(
            texts(r#"let s = "say \"hi\\\" now()"; let t = "u";"#),
            vec![r#"say \"hi\\\" now()"#, "u"]
        );
        assert_eq!(texts("r#type; b'\"'; \"z\""), vec!["z"]);
    }

    #[test]
    fn lexer_reports_line_per_physical_line() {
        let got = rust_string_literals("// x\nlet q = \"SELECT 1,\n  now()\";\nlet r = \"b\";");
        let want: Vec<(usize, String)> = vec![
            (2, "SELECT 1,".into()),
            (3, "  now()".into()),
            (4, "b".into()),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn scan_tree_flags_and_exempts() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let root = std::env::temp_dir().join(format!("sqlscan-{}-{nanos}", std::process::id()));
        let write = |rel: &str, body: &str| {
            let p = root.join(rel);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, body).expect("write");
        };
        write(
            "src/a.rs",
            "fn f() {\n    sqlx::query(\"SELECT now()\");\n    let t = Utc::now();\n}\n",
        );
        write(
            "src/b.rs",
            "fn g() {\n    sqlx::query(\"SELECT now()\"); // check-sql-now: allow\n}\n",
        );
        write("src/target/c.rs", "const Q: &str = \"SELECT now()\";\n");
        write(
            "migrations/0001_clock.sql",
            "CREATE TABLE a (t timestamptz DEFAULT now());\n",
        );
        write(
            "migrations/0002_x.sql",
            "-- now() in a comment\nSELECT 1; -- now()\nINSERT INTO a VALUES (CURRENT_TIMESTAMP);\n",
        );
        let found = scan_tree(
            &root,
            &["src", "migrations", "missing"],
            &["migrations/0001_clock.sql"],
        );
        std::fs::remove_dir_all(&root).expect("cleanup");
        let got: Vec<(PathBuf, usize)> = found.iter().map(|f| (f.path.clone(), f.line)).collect();
        let want = vec![
            (root.join("migrations/0002_x.sql"), 3),
            (root.join("src/a.rs"), 2),
        ];
        assert_eq!(got, want);
        assert_eq!(found[1].text, "sqlx::query(\"SELECT now()\");");
        assert!(
            found[1]
                .to_string()
                .ends_with("a.rs:2: sqlx::query(\"SELECT now()\");")
        );
    }
}
