//! Every `extensions.code` the API can answer, as one closed enum ([`Code`]): the domain's
//! (`compute_domain::ErrorCode`) and the transport's ([`TransportCode`]: a document that does not
//! parse or validate, a malformed request, a published limit, a deadline, persisted queries).
//! The metrics label of a response's code and the status of a request-level error are derived
//! from it, so no list of codes is written twice; the refusals at a published limit are
//! [`Limit`], each with its code. `docs/errors.md` documents every code (a test here checks it).

use axum::http::StatusCode;
use compute_domain::ErrorCode;

/// The codes the transport and the door answer, before or around any resolver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportCode {
    GraphqlParseFailed,
    GraphqlValidationFailed,
    BadRequest,
    LimitExceeded,
    QueryTooCostly,
    Timeout,
    PersistedQueryNotFound,
    PersistedQueryHashMismatch,
    PersistedQueryRequired,
}

impl TransportCode {
    pub const ALL: [TransportCode; 9] = [
        TransportCode::GraphqlParseFailed,
        TransportCode::GraphqlValidationFailed,
        TransportCode::BadRequest,
        TransportCode::LimitExceeded,
        TransportCode::QueryTooCostly,
        TransportCode::Timeout,
        TransportCode::PersistedQueryNotFound,
        TransportCode::PersistedQueryHashMismatch,
        TransportCode::PersistedQueryRequired,
    ];

    /// The code as it appears on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransportCode::GraphqlParseFailed => "GRAPHQL_PARSE_FAILED",
            TransportCode::GraphqlValidationFailed => "GRAPHQL_VALIDATION_FAILED",
            TransportCode::BadRequest => "BAD_REQUEST",
            TransportCode::LimitExceeded => "LIMIT_EXCEEDED",
            TransportCode::QueryTooCostly => "QUERY_TOO_COSTLY",
            TransportCode::Timeout => "TIMEOUT",
            TransportCode::PersistedQueryNotFound => "PERSISTED_QUERY_NOT_FOUND",
            TransportCode::PersistedQueryHashMismatch => "PERSISTED_QUERY_HASH_MISMATCH",
            TransportCode::PersistedQueryRequired => "PERSISTED_QUERY_REQUIRED",
        }
    }
}

/// Every code the API can answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Domain(ErrorCode),
    Transport(TransportCode),
}

impl Code {
    /// Every code: the domain's, then the transport's.
    pub fn all() -> impl Iterator<Item = Code> {
        ErrorCode::ALL
            .into_iter()
            .map(Code::Domain)
            .chain(TransportCode::ALL.into_iter().map(Code::Transport))
    }

    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Domain(c) => c.as_str(),
            Code::Transport(c) => c.as_str(),
        }
    }

    /// The code named `s`, if the API answers it.
    pub fn parse(s: &str) -> Option<Code> {
        Code::all().find(|c| c.as_str() == s)
    }

    /// The metrics label of a code seen in a response (`OTHER` for one this API never answers:
    /// a caller cannot make new series).
    pub fn label(code: Option<&str>) -> &'static str {
        code.map(|c| c.trim_matches('"'))
            .and_then(Code::parse)
            .map_or("OTHER", Code::as_str)
    }

    /// The HTTP status of a request that failed as a whole with this code (no `data`), under
    /// `application/graphql-response+json`: `429` for a spent budget, `504` for a deadline,
    /// `400` otherwise.
    pub fn request_status(self) -> StatusCode {
        match self {
            Code::Domain(ErrorCode::RateLimited) => StatusCode::TOO_MANY_REQUESTS,
            Code::Transport(TransportCode::Timeout) => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// A refusal at a published limit (`extensions.limit`, and the `compute_api_refusals_total` reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    DocumentBytes,
    Aliases,
    Directives,
    Selections,
    RootFields,
    Errors,
    Cost,
    RateLimited,
    NulCharacter,
    ListItems,
    Timeout,
}

impl Limit {
    pub const ALL: [Limit; 11] = [
        Limit::DocumentBytes,
        Limit::Aliases,
        Limit::Directives,
        Limit::Selections,
        Limit::RootFields,
        Limit::Errors,
        Limit::Cost,
        Limit::RateLimited,
        Limit::NulCharacter,
        Limit::ListItems,
        Limit::Timeout,
    ];

    /// `extensions.limit`, and the metrics' reason.
    pub const fn as_str(self) -> &'static str {
        match self {
            Limit::DocumentBytes => "document_bytes",
            Limit::Aliases => "aliases",
            Limit::Directives => "directives",
            Limit::Selections => "selections",
            Limit::RootFields => "root_fields",
            Limit::Errors => "errors",
            Limit::Cost => "cost",
            Limit::RateLimited => "rate_limited",
            Limit::NulCharacter => "nul_character",
            Limit::ListItems => "list_items",
            Limit::Timeout => "timeout",
        }
    }

    /// The code a refusal at this limit answers.
    pub const fn code(self) -> Code {
        match self {
            Limit::DocumentBytes
            | Limit::Aliases
            | Limit::Directives
            | Limit::Selections
            | Limit::RootFields
            | Limit::Errors => Code::Transport(TransportCode::LimitExceeded),
            Limit::Cost => Code::Transport(TransportCode::QueryTooCostly),
            Limit::Timeout => Code::Transport(TransportCode::Timeout),
            Limit::RateLimited => Code::Domain(ErrorCode::RateLimited),
            Limit::NulCharacter | Limit::ListItems => Code::Domain(ErrorCode::BadUserInput),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ERRORS_MD: &str = include_str!("../../docs/errors.md");

    #[test]
    fn every_code_is_documented_and_counted_under_its_own_label() {
        let mut labels = std::collections::HashSet::new();
        for c in Code::all() {
            assert!(
                ERRORS_MD.contains(&format!("| `{}` |", c.as_str())),
                "{} is not in docs/errors.md's tables",
                c.as_str()
            );
            assert_eq!(Code::label(Some(c.as_str())), c.as_str());
            assert!(labels.insert(c.as_str()), "{} twice", c.as_str());
        }
        assert_eq!(Code::label(Some("QUERY_TOO_COSTLY")), "QUERY_TOO_COSTLY");
        assert_eq!(Code::label(Some("MADE_UP")), "OTHER");
        assert_eq!(Code::label(None), "OTHER");
    }

    #[test]
    fn every_limit_has_a_code_and_a_documented_name() {
        for l in Limit::ALL {
            assert!(Code::parse(l.code().as_str()).is_some());
            assert!(
                ERRORS_MD.contains(&format!("`{}`", l.as_str()))
                    || include_str!("../../docs/security.md")
                        .contains(&format!("`{}`", l.as_str())),
                "limit {} is documented nowhere",
                l.as_str()
            );
        }
        assert_eq!(
            Code::Transport(TransportCode::Timeout).request_status(),
            StatusCode::GATEWAY_TIMEOUT
        );
    }
}
