//! Sites: create (idempotent) and update.

use super::*;

/// Input of `create_site`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NewSite {
    pub name: String,
    pub region: Option<String>,
}

/// Creates a site; with an idempotency key, a retry returns the same site.
#[tracing::instrument(level = "debug", skip_all, fields(name = %input.name))]
pub async fn create_site(
    db: &Db,
    actor: &Actor,
    input: NewSite,
    idempotency_key: Option<String>,
) -> Result<Outcome<Site>> {
    let idempotency_key = idempotency_key
        .map(|k| idempotency::parse_key("idempotencyKey", &k))
        .transpose()?;
    let id = SiteId::generate();
    let request = serde_json::to_value(&input).map_err(Error::internal)?;
    db.tx("create_site", TxKind::Write, |conn| {
        let (id, input, request, key, actor) = (
            id.clone(),
            input.clone(),
            request.clone(),
            idempotency_key.clone(),
            actor.clone(),
        );
        Box::pin(async move {
            if let Some(key) = &key {
                match idempotency::claim(conn, &actor, key, "createSite", &request).await? {
                    Claim::New => {}
                    Claim::Refused(e) => return Ok(Err(e)),
                    Claim::Replay(id) => {
                        let value = query_sites!("SELECT", "FROM sites s WHERE s.id = $1", id)
                            .fetch_one(&mut *conn)
                            .await?;
                        return Ok(Ok(Outcome {
                            value,
                            replayed: true,
                        }));
                    }
                }
            }
            let created = async {
                let site = query_sites!(
                    "INSERT INTO sites AS s (id, name, region) VALUES ($1, $2, $3) RETURNING",
                    "",
                    id.as_str(),
                    input.name,
                    input.region,
                )
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| {
                    on_constraint(
                        e,
                        &[("sites_name_key", &|| {
                            conflict(
                                format!("a site named `{}` already exists", input.name),
                                None,
                            )
                        })],
                    )
                })?;
                emit(
                    conn,
                    EventType::SiteCreated,
                    &site.id,
                    &SitePayload {
                        site: (&site).into(),
                    },
                )
                .await?;
                Ok(Outcome {
                    value: site,
                    replayed: false,
                })
            }
            .await;
            idempotency::settle(conn, &actor, key.as_deref(), created, |o| {
                o.value.id.to_string()
            })
            .await
        })
    })
    .await?
}

/// Changes a site's name or region.
#[tracing::instrument(level = "debug", skip_all, fields(site = %id))]
pub async fn update_site(
    db: &Db,
    id: &SiteId,
    version: i64,
    name: Option<String>,
    region: Option<String>,
) -> Result<Site> {
    db.tx("update_site", TxKind::Write, |conn| {
        let (id, name, region) = (id.clone(), name.clone(), region.clone());
        Box::pin(async move {
            let site = query_sites!(
                "UPDATE sites AS s SET name = coalesce($3, s.name), region = coalesce($4, s.region),
                 version = s.version + 1, updated_at = compute_now()
                 WHERE s.id = $1 AND s.version = $2 RETURNING",
                "",
                id.as_str(),
                version,
                name,
                region,
            )
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| {
                on_constraint(
                    e,
                    &[("sites_name_key", &|| {
                        conflict(
                            format!(
                                "a site named `{}` already exists",
                                name.clone().unwrap_or_default()
                            ),
                            None,
                        )
                    })],
                )
            })?;
            let Some(site) = site else {
                return Err(explain_miss(conn, "sites", "site", id.as_str(), Some(version)).await);
            };
            emit(
                conn,
                EventType::SiteUpdated,
                &site.id,
                &SitePayload {
                    site: (&site).into(),
                },
            )
            .await?;
            Ok(site)
        })
    })
    .await
}
