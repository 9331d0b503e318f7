//! The web console and GraphiQL in a real headless Chromium against a real `compute-api dev` on
//! a throwaway data directory: sign in, the demonstration fleet (a node's liveness changing on
//! the page as its events arrive), a reservation made through the
//! form with two clicks that appears once on the timeline through the live stream, its
//! cancellation, the event stream across a reconnect, the operator's page, GraphiQL running a
//! query and a subscription; no request to any host but the server, no script error, no
//! Content-Security-Policy violation. Screenshots of every page go to `target/browser/`.

use std::process::Stdio;
use std::time::Duration;

use compute_tests::cdp::Browser;
use compute_tests::eventually;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

struct Dev {
    _child: tokio::process::Child,
    base: String,
    data: std::path::PathBuf,
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// `compute-api dev` on a free port and a new data directory.
async fn start_dev() -> Dev {
    let port = compute_tests::bench::free_port();
    let data = std::env::temp_dir().join(format!("compute-console-{}-{port}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_test-api"))
        .args([
            "dev",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(&data)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start compute-api dev");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually("compute-api dev is ready", Duration::from_secs(90), || {
        let req = http.get(format!("{base}/readyz")).send();
        async move { req.await.ok().filter(|r| r.status().is_success()) }
    })
    .await;
    Dev {
        _child: child,
        base,
        data,
    }
}

async fn graphql(dev: &Dev, token: &str, query: &str, variables: Value) -> Value {
    let v: Value = reqwest::Client::new()
        .post(format!("{}/graphql", dev.base))
        .bearer_auth(token)
        .json(&json!({ "query": query, "variables": variables }))
        .send()
        .await
        .expect("POST /graphql")
        .json()
        .await
        .expect("JSON");
    assert!(v["errors"].is_null(), "{v}");
    v["data"].clone()
}

async fn set_cordon(dev: &Dev, token: &str, node: &Value, cordoned: bool) {
    let query = if cordoned {
        "mutation($id: ID!) { cordonNode(input: { id: $id, reason: \"browser test\" }) { computeNode { cordoned } } }"
    } else {
        "mutation($id: ID!) { uncordonNode(input: { id: $id }) { computeNode { cordoned } } }"
    };
    let v = graphql(dev, token, query, json!({ "id": node })).await;
    assert_eq!(v.to_string().contains("true"), cordoned, "{v}");
}

fn shot(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/browser")
        .join(format!("{name}.png"))
}

const RESERVATIONS: &str = "query { reservations(first: 50) { totalCount nodes { id state } } }";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_reserves_once_through_the_form_and_shows_it_live_in_a_real_browser() {
    let dev = start_dev().await;
    let token: Value = reqwest::get(format!("{}/console/dev-token", dev.base))
        .await
        .expect("dev token")
        .json()
        .await
        .expect("JSON");
    let token = token["token"].as_str().expect("a token").to_owned();
    // A page of another name that resolves here (DNS rebinding) is same-origin with the
    // server: it gets no token.
    let rebound = reqwest::Client::new()
        .get(format!("{}/console/dev-token", dev.base))
        .header("Host", "attacker.example:8080")
        .send()
        .await
        .expect("dev token");
    assert_eq!(rebound.status().as_u16(), 403);
    let b = Browser::launch(1440, 1000).await;

    // Sign in with the one-click development token.
    b.goto(&format!("{}/", dev.base)).await;
    b.wait_for("document.querySelector('#dev-sign-in')", WAIT)
        .await;
    b.screenshot(&shot("1-sign-in")).await;
    b.click("#dev-sign-in", 1).await;

    // The demonstration fleet: two sites, their pools, live nodes.
    b.wait_for("document.querySelectorAll('.site').length === 2", WAIT)
        .await;
    let sites = b
        .eval("[...document.querySelectorAll('.site h2')].map(e => e.textContent)")
        .await;
    assert!(sites.to_string().contains("ams1"), "{sites}");
    assert!(sites.to_string().contains("iad1"), "{sites}");
    b.wait_for(
        "document.querySelector('#live').dataset.state === 'live'",
        WAIT,
    )
    .await;
    b.click(".pool h3 button.link", 1).await;
    b.wait_for(
        "document.querySelectorAll('.node-row .badge.connected').length >= 1",
        WAIT,
    )
    .await;
    // Liveness changes live: stop one node's simulated daemon (`dev` reads `sim-stopped` every
    // second) and its row turns DISCONNECTED from the event, without a reload.
    b.eval("window.__notReloaded = true").await;
    let host = b
        .eval("document.querySelector('.node-row').dataset.hostname")
        .await;
    let host = host.as_str().expect("a hostname").to_owned();
    std::fs::write(dev.data.join("sim-stopped"), format!("{host}\n")).expect("stop a daemon");
    b.wait_for(
        &format!(
            "document.querySelector('.node-row[data-hostname=\"{host}\"] .badge.disconnected')"
        ),
        WAIT,
    )
    .await;
    assert_eq!(b.eval("window.__notReloaded === true").await, true);
    b.screenshot(&shot("2-fleet")).await;
    std::fs::write(dev.data.join("sim-stopped"), "").expect("start it again");
    b.wait_for(
        &format!("document.querySelector('.node-row[data-hostname=\"{host}\"] .badge.connected')"),
        WAIT,
    )
    .await;

    // The timeline, and the form beside it. A marker on `window` shows the page is never
    // reloaded: what appears, appears through the subscription.
    b.eval("window.location.hash = '#/timeline'; window.__notReloaded = true")
        .await;
    b.wait_for("document.querySelector('#timeline .gantt-row')", WAIT)
        .await;
    let before = graphql(&dev, &token, RESERVATIONS, json!({})).await;
    assert_eq!(before["reservations"]["totalCount"], 0, "{before}");
    assert_eq!(
        b.eval("document.querySelectorAll('#timeline [data-reservation]').length")
            .await,
        0
    );
    // The pool's calendar above it comes from `capacityTimeline`: nothing booked yet.
    b.wait_for(
        "document.querySelector('#capacity-chart').dataset.maxBooked === '0'",
        WAIT,
    )
    .await;
    // Two hours from now, for an hour: SCHEDULED, so it can be cancelled.
    let start = b
        .eval(
            "(() => { const d = new Date(Date.now() + 2 * 3600e3); const p = n => String(n).padStart(2, '0'); \
             return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())}T${p(d.getHours())}:${p(d.getMinutes())}`; })()",
        )
        .await;
    b.fill("#reserve-start", start.as_str().expect("a time"))
        .await;
    b.fill("#reserve-count", "1").await;
    // Submit, twice, as a person double-clicking would.
    b.click("#reserve-submit", 2).await;
    b.wait_for(
        "document.querySelector('#reserve-result .outcome[data-reservation]')",
        WAIT,
    )
    .await;
    let id = b
        .eval("document.querySelector('#reserve-result .outcome').dataset.reservation")
        .await;
    let id = id.as_str().expect("the reservation's id").to_owned();
    // It appears on the timeline (one bar: one GPU) without a reload.
    b.wait_for(
        &format!("document.querySelector('#timeline [data-reservation=\"{id}\"]')"),
        WAIT,
    )
    .await;
    assert_eq!(b.eval("window.__notReloaded === true").await, true);
    let shown = b
        .eval("new Set([...document.querySelectorAll('#timeline [data-reservation]')].map(e => e.dataset.reservation)).size")
        .await;
    assert_eq!(shown, 1, "exactly one reservation on the timeline");
    assert_eq!(
        b.eval(&format!(
            "document.querySelectorAll('#timeline [data-reservation=\"{id}\"]').length"
        ))
        .await,
        1,
        "one bar for one GPU"
    );
    // The calendar counts it: one whole GPU booked at its peak, of the pool's total.
    b.wait_for(
        "document.querySelector('#capacity-chart').dataset.maxBooked === '1'",
        WAIT,
    )
    .await;
    let total = b
        .eval("Number(document.querySelector('#capacity-chart').dataset.total)")
        .await;
    assert!(total.as_i64().is_some_and(|t| t > 1), "{total}");
    let after = graphql(&dev, &token, RESERVATIONS, json!({})).await;
    assert_eq!(
        after["reservations"]["totalCount"], 1,
        "booked once: {after}"
    );
    assert_eq!(after["reservations"]["nodes"][0]["id"], json!(id));
    // Sending the unchanged form again replays the same key: still one reservation.
    b.click("#reserve-submit", 1).await;
    b.wait_for(
        "document.querySelector('#reserve-result .outcome').dataset.replay === 'true'",
        WAIT,
    )
    .await;
    let again = graphql(&dev, &token, RESERVATIONS, json!({})).await;
    assert_eq!(again["reservations"]["totalCount"], 1, "{again}");
    b.screenshot(&shot("3-timeline")).await;

    // Cancel it from its details; the bar goes away through the stream.
    b.click(&format!("#timeline [data-reservation=\"{id}\"]"), 1)
        .await;
    b.wait_for("document.querySelector('#details #cancel')", WAIT)
        .await;
    b.click("#details #cancel", 1).await;
    b.wait_for(
        &format!("!document.querySelector('#timeline [data-reservation=\"{id}\"]')"),
        WAIT,
    )
    .await;
    let cancelled = graphql(
        &dev,
        &token,
        "query($id: ID!) { reservation(id: $id) { state } }",
        json!({ "id": id }),
    )
    .await;
    assert_eq!(cancelled["reservation"]["state"], "CANCELLED");
    // The form's answer follows the reservation's events: it no longer says SCHEDULED.
    b.wait_for(
        &format!(
            "(() => {{ const o = document.querySelector('#reserve-result .outcome'); \
             return o && o.dataset.reservation === '{id}' && o.dataset.state === 'CANCELLED' && o.textContent.includes('CANCELLED'); }})()"
        ),
        WAIT,
    )
    .await;

    // A gang on one node, one allocation of it on one NVLink domain: its details say both.
    let pools = graphql(
        &dev,
        &token,
        "query { pools(first: 20) { nodes { id name } } }",
        json!({}),
    )
    .await;
    let h100 = pools["pools"]["nodes"]
        .as_array()
        .expect("pools")
        .iter()
        .find(|p| p["name"] == "h100")
        .expect("the demonstration's h100 pool")["id"]
        .clone();
    let starts = chrono::Utc::now() + chrono::Duration::hours(3);
    let gang = graphql(
        &dev,
        &token,
        "mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { id state } } }",
        json!({ "i": { "poolId": h100, "startsAt": starts.to_rfc3339(), "endsAt": (starts + chrono::Duration::hours(1)).to_rfc3339(),
                       "allocations": [{ "gpuCount": 2, "sameNvlinkDomain": true }, { "gpuCount": 1 }],
                       "gang": { "colocate": "NODE" }, "idempotencyKey": "console-gang" } }),
    )
    .await;
    assert_eq!(
        gang["createReservation"]["reservation"]["state"], "SCHEDULED",
        "{gang}"
    );
    let gang = gang["createReservation"]["reservation"]["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    b.eval(&format!(
        "(() => {{ const s = document.querySelector('#timeline-pool'); s.value = {h100}; s.dispatchEvent(new Event('change')); }})()"
    ))
    .await;
    b.wait_for(
        &format!(
            "document.querySelectorAll('#timeline [data-reservation=\"{gang}\"]').length === 3"
        ),
        WAIT,
    )
    .await;
    b.click(&format!("#timeline [data-reservation=\"{gang}\"]"), 1)
        .await;
    b.wait_for(
        "(document.querySelector('#details .gang') || {}).textContent === 'on one node'",
        WAIT,
    )
    .await;
    let held = b
        .eval("[...document.querySelectorAll('#details .allocation')].map(e => e.textContent)")
        .await;
    let held = held.as_array().expect("the allocations' lines").clone();
    assert_eq!(held.len(), 2, "{held:?}");
    assert!(
        held[0]
            .as_str()
            .is_some_and(|t| t.contains("2× any GPU on one NVLink domain on ams1-h100-01")),
        "{held:?}"
    );
    assert!(
        held[1].as_str().is_some_and(|t| !t.contains("NVLink")),
        "{held:?}"
    );
    b.screenshot(&shot("3-gang")).await;

    // The live events, across a dropped connection: an event written while the console
    // reconnects is shown once.
    b.eval("window.location.hash = '#/events'").await;
    b.wait_for(
        "document.querySelector('#events li[data-type=\"reservation.cancelled\"]')",
        WAIT,
    )
    .await;
    b.click("#events-drop", 1).await;
    let node = graphql(
        &dev,
        &token,
        "query { computeNodes(first: 1) { nodes { id } } }",
        json!({}),
    )
    .await;
    let node = node["computeNodes"]["nodes"][0]["id"].clone();
    set_cordon(&dev, &token, &node, true).await;
    b.wait_for(
        "document.querySelectorAll('#events li[data-type=\"node.cordoned\"]').length >= 1",
        WAIT,
    )
    .await;
    b.wait_for(
        "document.querySelector('#live').dataset.state === 'live'",
        WAIT,
    )
    .await;
    // A later event: the stream is in order, so a second copy of the first would be shown
    // before this one is.
    set_cordon(&dev, &token, &node, false).await;
    b.wait_for(
        "document.querySelector('#events li[data-type=\"node.uncordoned\"]')",
        WAIT,
    )
    .await;
    assert_eq!(
        b.eval("document.querySelectorAll('#events li[data-type=\"node.cordoned\"]').length")
            .await,
        1,
        "the event written across the reconnect, once"
    );
    let status = b
        .eval("document.querySelector('#events-status').textContent")
        .await;
    assert!(!status.to_string().contains(" 0 reconnects"), "{status}");
    b.screenshot(&shot("4-events")).await;

    // The operator's page shows a cordon and its reason.
    set_cordon(&dev, &token, &node, true).await;
    b.eval("window.location.hash = '#/operator'").await;
    b.wait_for(
        "[...document.querySelectorAll('#operator-nodes .badge.cordoned')].some(e => e.textContent.includes('browser test'))",
        WAIT,
    )
    .await;
    // Each GPU with its topology (the demonstration's servers: two NUMA nodes).
    b.wait_for(
        "[...document.querySelectorAll('#operator-nodes .topology')].some(e => e.textContent.startsWith('NUMA 1'))",
        WAIT,
    )
    .await;
    b.screenshot(&shot("5-operator")).await;

    // GraphiQL, from the binary: a query, then a subscription that sees an event.
    let query = "query Me { viewer { subject } serverTime }";
    b.goto(&format!(
        "{}/graphiql?query={}",
        dev.base,
        query
            .replace(' ', "%20")
            .replace('{', "%7B")
            .replace('}', "%7D")
    ))
    .await;
    b.wait_for("document.querySelector('.graphiql-execute-button')", WAIT)
        .await;
    b.click(".graphiql-execute-button", 1).await;
    b.wait_for(
        "(document.querySelector('.result-window') || {}).textContent?.includes('dev@localhost')",
        WAIT,
    )
    .await;
    b.screenshot(&shot("6-graphiql-query")).await;
    let subscription =
        "subscription Live { events(types: [\"node.uncordoned\"]) { type subject } }";
    b.goto(&format!(
        "{}/graphiql?query={}",
        dev.base,
        subscription
            .replace(' ', "%20")
            .replace('{', "%7B")
            .replace('}', "%7D")
            .replace('"', "%22")
            .replace('[', "%5B")
            .replace(']', "%5D")
    ))
    .await;
    b.wait_for("document.querySelector('.graphiql-execute-button')", WAIT)
        .await;
    b.click(".graphiql-execute-button", 1).await;
    // The subscription starts at the present when the server gets it, which the page cannot
    // tell: uncordon (and cordon again) until an uncordon arrives.
    eventually("GraphiQL's subscription shows an event", WAIT, || async {
        set_cordon(&dev, &token, &node, false).await;
        let seen = b
            .eval("(document.querySelector('.result-window') || {}).textContent?.includes('node.uncordoned') || false")
            .await;
        set_cordon(&dev, &token, &node, true).await;
        (seen == json!(true)).then_some(())
    })
    .await;
    b.screenshot(&shot("7-graphiql-subscription")).await;

    // A member, with a token pasted: no Operator page, and only the tenant's events.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_test-api"))
        .args([
            "token",
            "--role",
            "member",
            "--tenant",
            "acme",
            "--sub",
            "alice@acme",
        ])
        .arg("--data-dir")
        .arg(&dev.data)
        .output()
        .expect("compute-api token");
    let member = String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned();
    assert!(member.starts_with("ey"), "a JWT: {member}");
    b.goto(&format!("{}/", dev.base)).await;
    b.click("#signout", 1).await;
    b.wait_for("document.querySelector('#token')", WAIT).await;
    b.fill("#token", &member).await;
    b.click("#sign-in", 1).await;
    b.wait_for(
        "document.querySelector('#who').textContent.includes('alice@acme')",
        WAIT,
    )
    .await;
    assert_eq!(
        b.eval("document.querySelector('a[data-view=\"operator\"]').hidden")
            .await,
        true,
        "members have no Operator page"
    );
    b.eval("window.location.hash = '#/events'").await;
    b.wait_for(
        "document.querySelector('#view-events') && document.querySelector('#view-events').textContent.includes('The events of tenant acme')",
        WAIT,
    )
    .await;
    b.eval("window.location.hash = '#/timeline'").await;
    b.wait_for(
        "(document.querySelector('#timeline .gantt-axis') || {}).textContent?.includes('0 reservations in view')",
        WAIT,
    )
    .await;
    // The dev tenant's reservation and the fleet's events are not the member's.
    assert_eq!(
        b.eval("document.querySelectorAll('#timeline [data-reservation]').length")
            .await,
        0
    );
    // A fleet event, then one of the member's tenant (its quota set): the stream is in order, so
    // once the second is shown the first would have been.
    b.eval("window.location.hash = '#/events'").await;
    b.wait_for("document.querySelector('#events')", WAIT).await;
    set_cordon(&dev, &token, &node, false).await;
    let pool = graphql(
        &dev,
        &token,
        "query { pools(first: 1) { nodes { id } } }",
        json!({}),
    )
    .await;
    graphql(
        &dev,
        &token,
        "mutation($p: ID!) { setQuota(input: { tenantId: \"acme\", scopeId: $p, gpus: 2 }) { quotas { max } } }",
        json!({ "p": pool["pools"]["nodes"][0]["id"] }),
    )
    .await;
    b.wait_for(
        "document.querySelector('#events li[data-type=\"quota.set\"]')",
        WAIT,
    )
    .await;
    assert_eq!(
        b.eval("document.querySelectorAll('#events li[data-type^=\"node.\"]').length")
            .await,
        0,
        "a member sees no fleet events"
    );
    b.screenshot(&shot("8-member")).await;

    // Over the quota just set (2 GPUs in that pool): the form says QUOTA_EXCEEDED, and nothing
    // was booked.
    let quota_pool = pool["pools"]["nodes"][0]["id"]
        .as_str()
        .expect("a pool")
        .to_owned();
    b.eval("window.location.hash = '#/reserve'").await;
    b.wait_for("document.querySelector('#reserve-form')", WAIT)
        .await;
    b.fill("#reserve-pool", &quota_pool).await;
    b.fill("#reserve-count", "3").await;
    b.click("#reserve-submit", 1).await;
    b.wait_for(
        "(document.querySelector('#reserve-result .outcome.error') || {dataset: {}}).dataset.code === 'QUOTA_EXCEEDED'",
        WAIT,
    )
    .await;
    let shown = b
        .eval("document.querySelector('#reserve-result .outcome').textContent")
        .await;
    assert!(
        shown.to_string().starts_with("\"QUOTA_EXCEEDED: "),
        "{shown}"
    );
    b.screenshot(&shot("9-quota-exceeded")).await;
    let mine = graphql(&dev, &member, RESERVATIONS, json!({})).await;
    assert_eq!(mine["reservations"]["totalCount"], 0, "{mine}");

    // Nothing but the server was asked for anything.
    let urls = b.urls.lock().expect("lock").clone();
    assert!(urls.len() > 10, "{urls:?}");
    let host = dev.base.trim_start_matches("http://").to_owned();
    let foreign: Vec<_> = urls
        .iter()
        .filter(|u| {
            let rest = u
                .strip_prefix("http://")
                .or_else(|| u.strip_prefix("ws://"));
            !(u.starts_with("about:")
                || u.starts_with("data:")
                || rest.is_some_and(|r| r.starts_with(&format!("{host}/"))))
        })
        .collect();
    assert!(foreign.is_empty(), "requests to other hosts: {foreign:?}");
    let problems = b.problems.lock().expect("lock").clone();
    assert!(
        problems.is_empty(),
        "script errors or CSP reports: {problems:?}"
    );
}
