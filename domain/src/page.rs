//! Keyset pagination for Relay connections: cursors are opaque strings that encode the last key
//! seen; pages are at most [`MAX_PAGE`] long.

use crate::error::{Error, Result};

/// The longest page a client may ask for.
pub const MAX_PAGE: i64 = 100;
/// The page length when the client gives neither `first` nor `last`.
pub const DEFAULT_PAGE: i64 = 50;

/// The Relay arguments as the client sent them.
#[derive(Debug, Clone, Default)]
pub struct PageRequest {
    pub first: Option<i64>,
    pub after: Option<String>,
    pub last: Option<i64>,
    pub before: Option<String>,
}

/// A validated page request: keys, not cursors. Hashable, so loaders can group by it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PageArgs {
    pub after: Option<String>,
    pub before: Option<String>,
    pub limit: i64,
    /// `last`/`before`: take the page from the end.
    pub backward: bool,
}

impl PageRequest {
    /// Checks the arguments and decodes the cursors.
    pub fn resolve(&self) -> Result<PageArgs> {
        if self.first.is_some() && self.last.is_some() {
            return Err(Error::bad_input(
                "first",
                "give `first` or `last`, not both",
            ));
        }
        let check = |field: &str, n: i64| {
            if (0..=MAX_PAGE).contains(&n) {
                Ok(n)
            } else {
                Err(Error::bad_input(
                    field,
                    format!("`{field}` must be between 0 and {MAX_PAGE}"),
                ))
            }
        };
        let (limit, backward) = match (self.first, self.last) {
            (Some(n), None) => (check("first", n)?, false),
            (None, Some(n)) => (check("last", n)?, true),
            _ => (DEFAULT_PAGE, false),
        };
        Ok(PageArgs {
            after: self
                .after
                .as_deref()
                .map(|c| decode_cursor("after", c))
                .transpose()?,
            before: self
                .before
                .as_deref()
                .map(|c| decode_cursor("before", c))
                .transpose()?,
            limit,
            backward,
        })
    }
}

/// One page of a connection.
#[derive(Debug, Clone)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub has_next: bool,
    pub has_previous: bool,
}

impl<T> Page<T> {
    /// Builds a page from rows fetched with `limit + 1` in the request's direction.
    pub fn from_rows(mut rows: Vec<T>, args: &PageArgs) -> Page<T> {
        let more = rows.len() as i64 > args.limit;
        rows.truncate(args.limit as usize);
        if args.backward {
            rows.reverse();
            Page {
                items: rows,
                has_next: args.before.is_some(),
                has_previous: more,
            }
        } else {
            Page {
                items: rows,
                has_next: more,
                has_previous: args.after.is_some(),
            }
        }
    }
}

/// Appends the keyset condition, order and limit of `page` over the id column `key` (such as
/// `r.id`) to a listing built with a `WHERE`, and fetches its page: the one home of the paging
/// of every id-ordered listing.
pub async fn fetch_page<'a, T>(
    mut qb: sqlx::QueryBuilder<'a, sqlx::Postgres>,
    key: &str,
    page: &PageArgs,
    db: &crate::db::Db,
) -> Result<Page<T>>
where
    T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
{
    if let Some(after) = &page.after {
        qb.push(format!(" AND {key} > ")).push_bind(after.clone());
    }
    if let Some(before) = &page.before {
        qb.push(format!(" AND {key} < ")).push_bind(before.clone());
    }
    let direction = if page.backward { "DESC" } else { "ASC" };
    qb.push(format!(" ORDER BY {key} {direction} LIMIT "))
        .push_bind(page.limit + 1);
    let rows = qb.build_query_as().fetch_all(db.pool()).await?;
    Ok(Page::from_rows(rows, page))
}

const CURSOR_PREFIX: &str = "k1:";

/// The opaque cursor of a key.
pub fn encode_cursor(key: &str) -> String {
    let raw = format!("{CURSOR_PREFIX}{key}");
    crate::process::hex(raw.as_bytes())
}

/// The key of a cursor made by [`encode_cursor`].
pub fn decode_cursor(field: &str, cursor: &str) -> Result<String> {
    let bad = || Error::bad_input(field, format!("`{field}` is not a cursor this API made"));
    if !cursor.len().is_multiple_of(2) || cursor.len() > 1024 {
        return Err(bad());
    }
    let bytes = (0..cursor.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(cursor.get(i..i + 2).ok_or_else(bad)?, 16).map_err(|_| bad()))
        .collect::<Result<Vec<u8>>>()?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    // A key never holds a control character (ids do not), and PostgreSQL refuses NUL in text.
    if text.chars().any(char::is_control) {
        return Err(bad());
    }
    text.strip_prefix(CURSOR_PREFIX)
        .map(str::to_owned)
        .ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_forgeries() {
        let c = encode_cursor("site_0193");
        assert_eq!(decode_cursor("after", &c).expect("decodes"), "site_0193");
        assert!(decode_cursor("after", "site_0193").is_err());
        assert!(decode_cursor("after", "zz").is_err());
    }

    #[test]
    fn page_requests_are_bounded() {
        let r = PageRequest {
            first: Some(101),
            ..Default::default()
        };
        assert_eq!(
            r.resolve().expect_err("too long").code(),
            crate::ErrorCode::BadUserInput
        );
        let r = PageRequest {
            first: Some(1),
            last: Some(1),
            ..Default::default()
        };
        assert!(r.resolve().is_err());
        let args = PageRequest::default().resolve().expect("default");
        assert_eq!((args.limit, args.backward), (DEFAULT_PAGE, false));
    }
}
