//! Commands to node daemons, end to end: `runCommand` over HTTP, the dispatcher stepped under
//! its shard lease, the real gateway pushing over `/agent`, and simulated daemons answering from
//! their journals (`docs/commands.md`).

use std::time::Duration;

use compute_domain::ids::{CommandId, NodeId};
use compute_domain::node_commands::{self as cmds, AckAnswer, Report};
use compute_sim::{Daemon, DaemonConfig, Session, SharedJournal};
use compute_tests::TestApp;
use compute_workers::queue::{DISPATCH_KINDS, QueueWorker};
use serde_json::{Value, json};

use crate::agent::{refusal, reply};
use crate::reservations::pool;

const WAIT: Duration = Duration::from_secs(10);

pub const RUN: &str = "mutation($i: RunCommandInput!) { runCommand(input: $i) { idempotentReplay command { id state kind attempts retrySafe } } }";
const GET: &str = "query($id: ID!) { command(id: $id) { state attempts errorCode sessionEpoch journalId result startedAt finishedAt } }";

pub fn daemon_config(app: &TestApp, node: &str, journal: &str, observed: i64) -> DaemonConfig {
    DaemonConfig {
        url: app.agent_url(),
        token: app.node_token(node),
        node_id: node.to_owned(),
        daemon_version: "sim/1".into(),
        journal_id: journal.into(),
        observed_generation: observed,
    }
}

async fn setup() -> (TestApp, Vec<String>, QueueWorker) {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway
        .refresh_lease()
        .await
        .expect("the gateway's lease in simulated time");
    let p = pool(&app).await;
    let dispatcher =
        QueueWorker::new(app.db.db.clone(), "dispatcher-a", &DISPATCH_KINDS).in_family("dispatch");
    (app, p.nodes, dispatcher)
}

/// One pass of the dispatcher: keeps its shards, dispatches what is due.
async fn dispatch(worker: &mut QueueWorker) -> usize {
    worker.rebalance().await.expect("shards");
    worker.step().await.expect("dispatch")
}

async fn run(app: &TestApp, node: &str, kind: &str, key: &str, extra: Value) -> Value {
    let mut input = json!({ "computeNodeId": node, "kind": kind, "idempotencyKey": key });
    if let (Some(i), Some(e)) = (input.as_object_mut(), extra.as_object()) {
        i.extend(e.clone());
    }
    app.ok(&app.operator(), RUN, json!({ "i": input })).await["runCommand"].clone()
}

async fn get(app: &TestApp, id: &str) -> Value {
    app.ok(&app.operator(), GET, json!({ "id": id })).await["command"].clone()
}

/// Feeds the gateway's messages to `daemon` and sends its answers, until the gateway says it
/// recorded the result of `command`; every message received.
async fn serve_until_recorded(
    session: &mut Session,
    daemon: &mut Daemon,
    command: &str,
) -> Vec<Value> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(
            !left.is_zero(),
            "no result of {command} was recorded; saw {seen:#?}"
        );
        let Some(message) = session.next_message(left).await else {
            continue;
        };
        let message = message.expect("the session stays open");
        for reply in daemon.on_message(&message) {
            session.send(reply).await.expect("send");
        }
        let done = message["type"] == "recorded" && message["commandId"] == command;
        seen.push(message);
        if done {
            return seen;
        }
    }
}

/// Dispatches, then serves the session until the result of `command` is recorded.
pub async fn dispatch_and_serve(
    dispatcher: &mut QueueWorker,
    session: &mut Session,
    daemon: &mut Daemon,
    command: &str,
) -> Vec<Value> {
    dispatch(dispatcher).await;
    serve_until_recorded(session, daemon, command).await
}

/// The next `command` message, its answer not sent.
async fn next_command(session: &mut Session) -> Value {
    loop {
        let m = session
            .next_message(WAIT)
            .await
            .expect("a message")
            .expect("open");
        if m["type"] == "command" {
            return m;
        }
    }
}

fn executions(journal: &SharedJournal, id: &str) -> u32 {
    journal
        .lock()
        .expect("journal")
        .entries
        .get(id)
        .map_or(0, |e| e.executions)
}

async fn command_events(app: &TestApp, id: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT type FROM outbox WHERE subject = $1 ORDER BY txid, seq")
        .bind(id)
        .fetch_all(app.db.db.pool())
        .await
        .expect("events")
}

/// A dispatch pokes the session's gateway after its commit (`Db::poke_after_commit`; no writing
/// transaction notifies, `static_checks::only_the_after_commit_poker_notifies`): a listener on the
/// commands' channel hears the gateway's id once the dispatch returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_pokes_the_sessions_gateway_after_its_commit() {
    let (app, nodes, mut dispatcher) = setup().await;
    let node = &nodes[0];
    let _session = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    let heard = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let listener = tokio::spawn({
        let (db, heard) = (app.db.db.clone(), heard.clone());
        async move {
            let _ = cmds::listen_for_pokes(&db, |id| {
                heard.lock().expect("heard").push(id.to_owned());
            })
            .await;
        }
    });
    // The listener is up once it hears a poke sent by hand.
    compute_tests::eventually("the listener hears", WAIT, || async {
        app.db.db.poke_after_commit(cmds::NOTIFY_CHANNEL, "probe");
        tokio::time::sleep(Duration::from_millis(20)).await;
        heard
            .lock()
            .expect("heard")
            .iter()
            .any(|h| h == "probe")
            .then_some(())
    })
    .await;
    heard.lock().expect("heard").clear();
    run(&app, node, "NOOP", "poked", json!({})).await;
    assert!(
        dispatch(&mut dispatcher).await >= 1,
        "the command is dispatched"
    );
    let gateway = app.gateway.id().as_str().to_owned();
    compute_tests::eventually("the gateway's poke", WAIT, || async {
        heard
            .lock()
            .expect("heard")
            .contains(&gateway)
            .then_some(())
    })
    .await;
    listener.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_runs_once_end_to_end_and_a_retry_gets_the_same_command() {
    let (app, nodes, mut dispatcher) = setup().await;
    let node = &nodes[0];
    let journal = compute_sim::journal("j1");
    let mut d = Daemon::new(journal.clone(), 1);
    let mut session = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");

    let first = run(&app, node, "NOOP", "k1", json!({})).await;
    assert_eq!(first["idempotentReplay"], false);
    assert_eq!(first["command"]["state"], "PENDING");
    assert_eq!(first["command"]["retrySafe"], true);
    let id = first["command"]["id"].as_str().expect("id").to_owned();
    let again = run(&app, node, "NOOP", "k1", json!({})).await;
    assert_eq!(
        again["command"]["id"],
        id.as_str(),
        "the same key, the same command"
    );
    assert_eq!(again["idempotentReplay"], true);
    let input = |args: Value| json!({ "i": { "computeNodeId": node, "kind": "NOOP", "idempotencyKey": "k1", "args": args } });
    let (code, _) = app
        .fails(&app.operator(), RUN, input(json!({ "x": 1 })))
        .await;
    assert_eq!(code, "IDEMPOTENCY_KEY_REUSED");
    let (code, _) = app.fails(&app.operator(), RUN, json!({ "i": { "computeNodeId": node, "kind": "NOOP", "idempotencyKey": "k2", "args": [1] } })).await;
    assert_eq!(code, "BAD_USER_INPUT");
    let (code, _) = app
        .fails(
            &app.operator(),
            RUN,
            json!({ "i": { "computeNodeId": node, "kind": "APPLY_SPEC", "idempotencyKey": "k3" } }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "apply_spec is the control plane's");
    let (code, _) = app
        .fails(
            &app.member("acme"),
            RUN,
            json!({ "i": { "computeNodeId": node, "kind": "NOOP", "idempotencyKey": "k4" } }),
        )
        .await;
    assert_eq!(code, "FORBIDDEN");
    assert_eq!(
        app.count("commands").await,
        1,
        "refused requests wrote nothing"
    );

    assert!(dispatch(&mut dispatcher).await >= 1);
    let seen = serve_until_recorded(&mut session, &mut d, &id).await;
    let types: Vec<&str> = seen.iter().filter_map(|m| m["type"].as_str()).collect();
    assert_eq!(types, ["command", "proceed", "recorded"], "{seen:#?}");
    assert_eq!(seen[2]["recorded"], true);
    let c = get(&app, &id).await;
    assert_eq!(
        (
            c["state"].as_str(),
            c["attempts"].as_i64(),
            c["sessionEpoch"].as_i64(),
            c["journalId"].as_str()
        ),
        (Some("SUCCEEDED"), Some(1), Some(1), Some("j1"))
    );
    assert!(c["startedAt"].is_string() && c["finishedAt"].is_string());
    assert_eq!(executions(&journal, &id), 1);
    assert_eq!(
        command_events(&app, &id).await,
        [
            "command.created",
            "command.dispatched",
            "command.running",
            "command.succeeded"
        ]
    );

    // Nothing is pushed twice: another dispatch and a poll send this session nothing more.
    dispatch(&mut dispatcher).await;
    app.gateway.push_now().await.expect("push");
    assert!(
        session
            .next_message(Duration::from_millis(500))
            .await
            .is_none(),
        "nothing more arrives"
    );
    let listed = app
        .ok(&app.operator(), "query($n: ID!) { computeNode: node(id: $n) { ... on ComputeNode { commands(last: 5) { totalCount edges { node { id state } } } } } commands(state: SUCCEEDED) { totalCount } }", json!({ "n": node }))
        .await;
    assert_eq!(listed["computeNode"]["commands"]["totalCount"], 1);
    assert_eq!(
        listed["computeNode"]["commands"]["edges"][0]["node"]["id"],
        id.as_str()
    );
    assert_eq!(listed["commands"]["totalCount"], 1);
    session.bye().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_waits_for_its_generation_and_runs_once_the_daemon_reports_it() {
    let (app, nodes, mut dispatcher) = setup().await;
    let node = &nodes[0];
    // A spec change: generation 2, which the daemon (at 1) has not applied.
    let version = app
        .ok(
            &app.operator(),
            "query($n: ID!) { node(id: $n) { ... on ComputeNode { version } } }",
            json!({ "n": node }),
        )
        .await["node"]["version"]
        .as_i64()
        .expect("version");
    let updated = app
        .ok(&app.operator(), "mutation($i: UpdateNodeInput!) { updateNode(input: $i) { computeNode { generation observedGeneration } } }", json!({ "i": { "id": node, "version": version, "labels": [{ "key": "zone", "value": "a" }] } }))
        .await;
    assert_eq!(updated["updateNode"]["computeNode"]["generation"], 2);
    let journal = compute_sim::journal("j1");
    let mut d = Daemon::new(journal.clone(), 1);
    let mut session = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    let (code, _) = app
        .fails(&app.operator(), RUN, json!({ "i": { "computeNodeId": node, "kind": "NOOP", "idempotencyKey": "far", "minGeneration": 3 } }))
        .await;
    assert_eq!(
        code, "BAD_USER_INPUT",
        "a generation the node does not have would wait forever"
    );
    let waiting = run(
        &app,
        node,
        "NOOP",
        "after-spec",
        json!({ "minGeneration": 2 }),
    )
    .await;
    let id = waiting["command"]["id"].as_str().expect("id").to_owned();

    // The dispatcher sends the spec (made for generation 2), not the command.
    dispatch(&mut dispatcher).await;
    assert_eq!(
        get(&app, &id).await["state"],
        "PENDING",
        "it waits for generation 2"
    );
    let spec = next_command(&mut session).await;
    assert_eq!(spec["kind"], "apply_spec");
    assert_eq!(spec["args"], json!({ "generation": 2 }));
    let spec_id = spec["commandId"].as_str().expect("id").to_owned();
    for reply in d.on_message(&spec) {
        session.send(reply).await.expect("ack");
    }
    serve_until_recorded(&mut session, &mut d, &spec_id).await;
    compute_tests::eventually("the daemon's generation is recorded", WAIT, || async {
        let g: i64 = sqlx::query_scalar("SELECT observed_generation FROM nodes WHERE id = $1")
            .bind(node)
            .fetch_one(app.db.db.pool())
            .await
            .expect("node");
        (g == 2).then_some(())
    })
    .await;

    // Now it goes, once.
    dispatch(&mut dispatcher).await;
    serve_until_recorded(&mut session, &mut d, &id).await;
    assert_eq!(get(&app, &id).await["state"], "SUCCEEDED");
    assert_eq!(
        (executions(&journal, &spec_id), executions(&journal, &id)),
        (1, 1)
    );
    let specs: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM commands WHERE kind = 'apply_spec' AND node_id = $1",
    )
    .bind(node)
    .fetch_one(app.db.db.pool())
    .await
    .expect("count");
    assert_eq!(
        specs, 1,
        "one apply_spec per generation, however often the dispatcher runs"
    );
    session.bye().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_reset_fails_what_is_not_retry_safe_and_a_kept_journal_answers_from_memory() {
    let (app, nodes, mut dispatcher) = setup().await;
    let node = &nodes[0];
    let mut first = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    let reset = run(
        &app,
        node,
        "RESET_GPU",
        "reset",
        json!({ "args": { "device": "GPU-0" } }),
    )
    .await;
    assert_eq!(reset["command"]["retrySafe"], false);
    let reset = reset["command"]["id"].as_str().expect("id").to_owned();
    let noop = run(&app, node, "NOOP", "noop", json!({})).await["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    dispatch(&mut dispatcher).await;
    // Both reach the daemon, which is then wiped before it answers.
    next_command(&mut first).await;
    next_command(&mut first).await;

    let wiped = compute_sim::journal("j2");
    let mut d = Daemon::new(wiped.clone(), 1);
    let mut second = Session::open(&daemon_config(&app, node, "j2", 1))
        .await
        .expect("the wiped daemon comes back");
    assert_eq!(first.closed(WAIT).await.expect("superseded").code, 4409);
    let r = get(&app, &reset).await;
    assert_eq!(
        (r["state"].as_str(), r["errorCode"].as_str()),
        (Some("FAILED"), Some("JOURNAL_RESET"))
    );
    assert_eq!(
        get(&app, &noop).await["state"],
        "PENDING",
        "retry-safe: dispatched again"
    );
    dispatch(&mut dispatcher).await;
    serve_until_recorded(&mut second, &mut d, &noop).await;
    let n = get(&app, &noop).await;
    assert_eq!(
        (
            n["state"].as_str(),
            n["attempts"].as_i64(),
            n["journalId"].as_str(),
            n["sessionEpoch"].as_i64()
        ),
        (Some("SUCCEEDED"), Some(2), Some("j2"), Some(2))
    );
    assert_eq!(
        executions(&wiped, &reset),
        0,
        "the reset GPU command never ran again"
    );

    // The same journal: the daemon ran a command but its result was lost with the connection;
    // the next session gets the command again and answers from the journal, without running it.
    let kept = run(&app, node, "RESET_GPU", "kept", json!({})).await["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    dispatch(&mut dispatcher).await;
    let command = next_command(&mut second).await;
    for reply in d.on_message(&command) {
        second.send(reply).await.expect("ack");
    }
    let proceed = second
        .next_message(WAIT)
        .await
        .expect("proceed")
        .expect("open");
    assert_eq!(proceed["type"], "proceed");
    let lost = d.on_message(&proceed);
    assert_eq!(lost[0]["type"], "result", "it ran");
    second.cut();
    compute_tests::eventually("the command is running", WAIT, || async {
        (get(&app, &kept).await["state"] == "RUNNING").then_some(())
    })
    .await;
    let mut third = Session::open(&daemon_config(&app, node, "j2", 1))
        .await
        .expect("back with the same journal");
    assert_eq!(
        get(&app, &kept).await["state"],
        "PENDING",
        "taken back, not failed"
    );
    dispatch(&mut dispatcher).await;
    let seen = serve_until_recorded(&mut third, &mut d, &kept).await;
    let types: Vec<&str> = seen.iter().filter_map(|m| m["type"].as_str()).collect();
    assert_eq!(
        types,
        ["command", "recorded"],
        "answered from the journal: no ack, no run"
    );
    let k = get(&app, &kept).await;
    assert_eq!(
        (k["state"].as_str(), k["attempts"].as_i64()),
        (Some("SUCCEEDED"), Some(2))
    );
    assert_eq!(executions(&wiped, &kept), 1, "it ran once");
    third.bye().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombies_change_nothing_and_a_cancelled_command_never_runs() {
    let (app, nodes, mut dispatcher) = setup().await;
    let db = &app.db.db;
    let node = &nodes[0];
    let node_id = NodeId::parse("node", node).expect("node id");
    let mut first = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    let id = run(&app, node, "NOOP", "z", json!({})).await["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let cid = CommandId::parse("id", &id).expect("command id");
    dispatch(&mut dispatcher).await;
    next_command(&mut first).await;
    assert_eq!(
        cmds::ack(db, &node_id, 1, &cid).await.expect("ack"),
        AckAnswer::Proceed
    );
    // A newer session supersedes the first: its gateway's writes at epoch 1 change nothing.
    let second = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open again");
    let report = Report::parse(true, json!({}), None, None).expect("valid Report");
    assert!(
        cmds::finish(db, &node_id, 1, &cid, &report)
            .await
            .expect("finish")
            .is_none(),
        "a zombie session's result is not recorded"
    );
    assert!(matches!(
        cmds::ack(db, &node_id, 1, &cid).await.expect("ack"),
        AckAnswer::Refused(_)
    ));
    assert_eq!(get(&app, &id).await["state"], "PENDING");

    // A zombie dispatcher: its shard lease was taken over; its dispatch writes nothing.
    let shard: i32 = sqlx::query_scalar("SELECT compute_shard($1, 8)")
        .bind(node)
        .fetch_one(db.pool())
        .await
        .expect("shard");
    let name = format!("shard:node_commands:{shard}");
    dispatcher.release_all().await;
    let ttl = Duration::from_secs(15);
    let old = compute_domain::leases::acquire(db, &name, "zombie", ttl)
        .await
        .expect("acquire")
        .expect("free");
    app.db.advance_clock(16).await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    // 16 s of business time without a word is past the gateway's silence limit (15 s): the
    // second session is cut off, and the daemon opens a third.
    let mut second = second;
    let closed = second.closed(WAIT).await.expect("cut off by silence");
    assert_eq!(closed.code, 4408, "{closed:?}");
    let second = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open a third");
    assert_eq!(second.welcome.session_epoch, 3);
    let new = compute_domain::leases::acquire(db, &name, "successor", ttl)
        .await
        .expect("acquire")
        .expect("expired, so taken over");
    assert!(new.epoch > old.epoch);
    let err = cmds::dispatch_node(&db.fenced(&old), &node_id)
        .await
        .expect_err("fenced out");
    assert!(
        matches!(err, compute_domain::Error::LeaseLost(_)),
        "{err:?}"
    );
    assert_eq!(
        get(&app, &id).await["state"],
        "PENDING",
        "the zombie dispatched nothing"
    );

    let cancel =
        "mutation($i: CancelCommandInput!) { cancelCommand(input: $i) { command { state } } }";
    // The first session acknowledged it (the daemon journaled it and may be running it), and
    // the newer session put it back to pending: it can no longer be cancelled.
    let (code, error) = app
        .fails(&app.operator(), cancel, json!({ "i": { "id": id } }))
        .await;
    assert_eq!(code, "CONFLICT", "{error}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("started")),
        "{error}"
    );
    assert_eq!(get(&app, &id).await["state"], "PENDING");

    // Cancelled while dispatched, never acknowledged: the daemon's acknowledgement is refused
    // and it never runs.
    let journal = compute_sim::journal("j1");
    let mut d = Daemon::new(journal.clone(), 1);
    let mut second = second;
    let sent = cmds::dispatch_node(&db.fenced(&new), &node_id)
        .await
        .expect("the successor dispatches");
    assert_eq!(sent.commands.len(), 1);
    serve_until_recorded(&mut second, &mut d, &id).await;
    let fresh = run(&app, node, "NOOP", "fresh", json!({})).await["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let sent = cmds::dispatch_node(&db.fenced(&new), &node_id)
        .await
        .expect("the successor dispatches");
    assert_eq!(sent.commands.len(), 1);
    let command = next_command(&mut second).await;
    let c = app
        .ok(&app.operator(), cancel, json!({ "i": { "id": fresh } }))
        .await;
    assert_eq!(c["cancelCommand"]["command"]["state"], "CANCELLED");
    let c = app
        .ok(&app.operator(), cancel, json!({ "i": { "id": fresh } }))
        .await;
    assert_eq!(
        c["cancelCommand"]["command"]["state"], "CANCELLED",
        "cancelling again is harmless"
    );
    for reply in d.on_message(&command) {
        second.send(reply).await.expect("ack");
    }
    let answer = second
        .next_message(WAIT)
        .await
        .expect("answer")
        .expect("open");
    assert_eq!(answer["type"], "cancelled", "{answer}");
    d.on_message(&answer);
    assert_eq!(
        executions(&journal, &fresh),
        0,
        "a cancelled command never runs"
    );
    assert_eq!(get(&app, &fresh).await["state"], "CANCELLED");
    // A finished command cannot be cancelled.
    let done = run(&app, node, "NOOP", "done", json!({})).await["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    cmds::dispatch_node(&db.fenced(&new), &node_id)
        .await
        .expect("dispatch");
    serve_until_recorded(&mut second, &mut d, &done).await;
    let (code, _) = app
        .fails(&app.operator(), cancel, json!({ "i": { "id": done } }))
        .await;
    assert_eq!(code, "CONFLICT");
    second.bye().await;
}

/// What a daemon reports about a command is checked where it enters, and a NUL (which
/// PostgreSQL's text and jsonb cannot hold) is never an error of ours that closes the session:
/// a `progress` or an `output` holding one is refused with `error` (nothing stored), a
/// `deviceHealth` whose `uuid` holds one too; an `errorMessage`, a diagnostic for people, is
/// kept with the NUL shown as U+FFFD. Before session 42 each of these was INTERNAL and closed
/// the session with 1011, and a daemon resending its result would never get it recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemons_report_holding_a_nul_is_refused_or_cleaned_and_the_session_stays() {
    let (app, nodes, mut dispatcher) = setup().await;
    let node = &nodes[0];
    let get = |id: String| {
        let app = &app;
        async move {
            app.ok(
                &app.operator(),
                "query($id: ID!) { command(id: $id) { state progress result } }",
                json!({ "id": id }),
            )
            .await["command"]
                .clone()
        }
    };
    let mut session = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    let id = run(&app, node, "NOOP", "nul", json!({})).await["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    dispatch(&mut dispatcher).await;
    next_command(&mut session).await;
    session
        .send(json!({ "type": "ack", "commandId": id }))
        .await
        .expect("ack");
    let proceed = reply(&mut session).await;
    assert_eq!(proceed["type"], "proceed", "{proceed}");

    // Each refused report: an `error` about it, the session open, the command as it was.
    let refused = [
        json!({ "type": "progress", "commandId": id, "progress": { "step": "a\u{0}b" } }),
        json!({ "type": "progress", "commandId": id, "progress": { "a\u{0}": 1 } }),
        json!({ "type": "result", "commandId": id, "outcome": "succeeded", "output": { "log": ["x\u{0}"] } }),
        json!({ "type": "deviceHealth", "uuid": "GPU-\u{0}1", "health": "unhealthy" }),
    ];
    for report in refused {
        session.send(report.clone()).await.expect("send");
        refusal(&mut session).await;
        let c = get(id.clone()).await;
        assert_eq!(
            (c["state"].as_str(), &c["result"], &c["progress"]),
            (Some("RUNNING"), &Value::Null, &Value::Null),
            "{report} stored nothing"
        );
    }

    // A progress sent twice is recorded once: one write, one `command.progress` event.
    for _ in 0..2 {
        session
            .send(json!({ "type": "progress", "commandId": id, "progress": { "percent": 50 } }))
            .await
            .expect("send");
    }

    // A failed result whose message holds a NUL: recorded, the NUL shown as U+FFFD.
    session
        .send(json!({
            "type": "result", "commandId": id, "outcome": "failed",
            "errorCode": "RUNTIME_FAILED", "errorMessage": "podman: \u{0}exit 125",
        }))
        .await
        .expect("send");
    let m = reply(&mut session).await;
    assert_eq!(
        (m["type"].as_str(), m["recorded"].as_bool()),
        (Some("recorded"), Some(true)),
        "{m}"
    );
    let c = app
        .ok(
            &app.operator(),
            "query($id: ID!) { command(id: $id) { state errorCode errorMessage } }",
            json!({ "id": id }),
        )
        .await["command"]
        .clone();
    assert_eq!(
        c,
        json!({ "state": "FAILED", "errorCode": "RUNTIME_FAILED", "errorMessage": "podman: \u{FFFD}exit 125" })
    );
    // The gateway answers a session's messages in order: both progress reports were handled
    // before the result's `recorded`.
    assert_eq!(
        get(id.clone()).await["progress"],
        json!({ "percent": 50 }),
        "the progress was recorded"
    );
    let progress_events = command_events(&app, &id)
        .await
        .into_iter()
        .filter(|t| t == "command.progress")
        .count();
    assert_eq!(progress_events, 1, "the repeat wrote nothing");
    session.heartbeat().await.expect("still open");
    session.bye().await;
}

/// Seeds `n` nodes (no GPUs: commands need none) in a pool of their own; their ids.
pub async fn seed_nodes(app: &TestApp, n: usize) -> Vec<String> {
    compute_tests::bench::seed_nodes(&app.db.db, n as i64).await
}

/// A real `compute-worker --role dispatch` process (this package's `test-worker` build).
pub fn dispatch_process(app: &TestApp) -> tokio::process::Child {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    tokio::process::Command::new(env!("CARGO_BIN_EXE_test-worker"))
        .args([
            "--role",
            "dispatch",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .envs(app.db.process_env())
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start a dispatch process")
}

/// Runs a simulated daemon for each of `nodes` (journal `j-<node>`) until the returned sender
/// says stop; their journals.
pub fn daemons(
    app: &TestApp,
    nodes: &[String],
) -> (
    tokio::sync::watch::Sender<bool>,
    std::collections::HashMap<String, SharedJournal>,
) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut journals = std::collections::HashMap::new();
    for node in nodes {
        let j = compute_sim::journal(&format!("j-{node}"));
        journals.insert(node.clone(), j.clone());
        let behaviour = compute_sim::Behaviour {
            journal: Some(j),
            ..compute_sim::Behaviour::default()
        };
        tokio::spawn(compute_sim::run_daemon(
            daemon_config(app, node, &format!("j-{node}"), 0),
            behaviour,
            stopped.clone(),
            |_, _| {},
        ));
    }
    (stop, journals)
}

/// Every command by state.
pub async fn states(app: &TestApp) -> std::collections::BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT state, count(*) FROM commands GROUP BY state")
        .fetch_all(app.db.db.pool())
        .await
        .expect("states")
        .into_iter()
        .collect()
}

/// Moves simulated time `seconds` forward in steps of 10 s, renewing the gateway's lease at
/// each step (as its background renewal would), so its sessions live on.
pub async fn pass_time(app: &TestApp, seconds: i64) {
    let mut left = seconds;
    while left > 0 {
        let s = left.min(10);
        app.db.advance_clock(s).await;
        app.gateway.refresh_lease().await.expect("gateway lease");
        left -= s;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_dispatcher_loses_no_command_and_sends_none_twice() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let nodes = seed_nodes(&app, 20).await;
    let (stop, journals) = daemons(&app, &nodes);
    compute_tests::eventually("every daemon is connected", WAIT, || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM nodes WHERE reachability = 'connected'")
                .fetch_one(app.db.db.pool())
                .await
                .expect("count");
        (n == nodes.len() as i64).then_some(())
    })
    .await;

    // 400 commands arrive while the first dispatcher works; it is SIGKILLed part-way.
    let producer = tokio::spawn({
        let (db, nodes) = (app.db.db.clone(), nodes.clone());
        async move {
            let operator = compute_domain::idempotency::Actor::operator("ops");
            for i in 0..400 {
                let node = NodeId::parse("node", &nodes[i % nodes.len()]).expect("node");
                cmds::run_command(
                    &db,
                    &operator,
                    cmds::CommandRequest::parse(node, cmds::Kind::Noop, json!({}), 0, None)
                        .expect("valid CommandRequest"),
                    &format!("k{i}"),
                )
                .await
                .expect("run");
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }
    });
    let started = std::time::Instant::now();
    let mut first = dispatch_process(&app);
    compute_tests::eventually(
        "the first dispatcher delivers some",
        Duration::from_secs(30),
        || async {
            (states(&app).await.get("succeeded").copied().unwrap_or(0) >= 100).then_some(())
        },
    )
    .await;
    first.kill().await.expect("SIGKILL");
    let at_kill = states(&app).await;
    eprintln!(
        "dispatch SIGKILL: killed after {:?}; commands by state then: {at_kill:?}",
        started.elapsed()
    );
    producer.await.expect("producer");
    let stranded = states(&app).await;
    eprintln!("dispatch SIGKILL: all 400 created, no dispatcher: {stranded:?}");
    assert!(
        stranded.get("pending").copied().unwrap_or(0) > 0,
        "commands wait: {stranded:?}"
    );

    // Its leases (15 s) and claims (60 s) run out; a second process takes the shards.
    pass_time(&app, 70).await;
    let restarted = std::time::Instant::now();
    let _second = dispatch_process(&app);
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM commands")
        .fetch_one(app.db.db.pool())
        .await
        .expect("count");
    // Simulated time moves with the wall clock meanwhile (a claim cut short lapses after 10 s,
    // as in production).
    while states(&app).await.get("succeeded").copied().unwrap_or(0) < total {
        assert!(
            restarted.elapsed() < Duration::from_secs(60),
            "the second dispatcher did not deliver the rest: {:?}",
            states(&app).await
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        app.db.advance_clock(1).await;
    }
    eprintln!(
        "dispatch SIGKILL: the second dispatcher finished the remaining {} commands {:?} after it started",
        total - at_kill.get("succeeded").copied().unwrap_or(0),
        restarted.elapsed()
    );

    // None lost, none sent twice, none run twice.
    let twice: i64 = sqlx::query_scalar("SELECT count(*) FROM commands WHERE attempts <> 1")
        .fetch_one(app.db.db.pool())
        .await
        .expect("count");
    assert_eq!(twice, 0, "every command was dispatched exactly once");
    let events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT subject FROM outbox WHERE type = 'command.dispatched' GROUP BY subject HAVING count(*) > 1) x",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("count");
    assert_eq!(events, 0);
    let mut seen = 0;
    for (node, journal) in &journals {
        for (id, e) in &journal.lock().expect("journal").entries {
            seen += 1;
            assert_eq!((e.received, e.executions), (1, 1), "{node} {id}: {e:?}");
        }
    }
    assert_eq!(seen, total, "every command reached its daemon");
    let _ = stop.send(true);
}

/// A transaction that moves the commands of two workflows wakes them at its commit in key order,
/// whatever order it moved them in: against a finish holding the first workflow's `work_queue`
/// row and reaching for the second's (an instance batch takes its rows in key order), the
/// commit waits for the first row and holds no other, so both go through. Until migration 0042
/// the deferred trigger enqueued in the order the rows moved: the commit took the second
/// workflow's row, waited for the first, and PostgreSQL rolled one of the two back as a deadlock.
#[tokio::test]
async fn commands_of_two_workflows_wake_them_in_key_order_at_commit() {
    let (app, nodes, _) = setup().await;
    let pool = app.db.db.pool();
    for (cmd, workflow) in [("cmd_wf_b", "ins_wf_b"), ("cmd_wf_a", "ins_wf_a")] {
        sqlx::query(
            "INSERT INTO commands (id, node_id, kind, retry_safe, idempotency_key, created_by, workflow_id) \
             VALUES ($1, $2, 'noop', true, 'wf:' || $3 || ':0', 'test', $3)",
        )
        .bind(cmd)
        .bind(&nodes[0])
        .bind(workflow)
        .execute(pool)
        .await
        .expect("a workflow's command");
    }
    sqlx::query("SELECT compute_enqueue('instance', ARRAY['ins_wf_a', 'ins_wf_b'], 8, 0)")
        .execute(pool)
        .await
        .expect("the workflows' rows");
    let generation = || async {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT key, gen FROM work_queue WHERE kind = 'instance' AND key LIKE 'ins_wf_%' ORDER BY key",
        )
        .fetch_all(pool)
        .await
        .expect("generations")
    };
    let before = generation().await;
    // The mover: B's command, then A's.
    let mut mover = pool.begin().await.expect("begin");
    for cmd in ["cmd_wf_b", "cmd_wf_a"] {
        sqlx::query(
            "UPDATE commands SET state = 'cancelled', finished_at = compute_now() WHERE id = $1",
        )
        .bind(cmd)
        .execute(&mut *mover)
        .await
        .expect("a command moves");
    }
    // The finish: A's row first, in key order.
    let mut finish = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM work_queue WHERE kind = 'instance' AND key = 'ins_wf_a' FOR UPDATE")
        .execute(&mut *finish)
        .await
        .expect("A's row");
    let committed = tokio::spawn(mover.commit());
    compute_tests::eventually("the mover's commit waits for A's row", WAIT, || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
              WHERE NOT l.granted AND a.datname = current_database()",
        )
        .fetch_one(pool)
        .await
        .expect("locks");
        (waiting == 1).then_some(())
    })
    .await;
    sqlx::query("SELECT 1 FROM work_queue WHERE kind = 'instance' AND key = 'ins_wf_b' FOR UPDATE")
        .execute(&mut *finish)
        .await
        .expect("B's row: the mover holds no row but the one it waits for");
    finish.commit().await.expect("the finish commits");
    committed
        .await
        .expect("join")
        .expect("the mover commits: no deadlock");
    let after = generation().await;
    assert_eq!(
        after
            .iter()
            .zip(&before)
            .map(|((k, a), (_, b))| (k.as_str(), a - b))
            .collect::<Vec<_>>(),
        [("ins_wf_a", 1), ("ins_wf_b", 1)],
        "each workflow woken once"
    );
    // With the trigger immediate, a moved command still wakes its workflow: the row is
    // gathered before it is enqueued (the gathering trigger's name sorts first).
    let mut immediate = pool.begin().await.expect("begin");
    sqlx::query("SET CONSTRAINTS commands_workflow_due IMMEDIATE")
        .execute(&mut *immediate)
        .await
        .expect("immediate");
    sqlx::query("UPDATE commands SET state = 'pending', finished_at = NULL WHERE id = 'cmd_wf_a'")
        .execute(&mut *immediate)
        .await
        .expect("a command moves");
    immediate.commit().await.expect("commit");
    let last = generation().await;
    assert_eq!(
        last.iter()
            .zip(&after)
            .map(|((k, a), (_, b))| (k.as_str(), a - b))
            .collect::<Vec<_>>(),
        [("ins_wf_a", 1), ("ins_wf_b", 0)],
        "woken in immediate mode too"
    );
}

/// A retired GPU's health, as its daemon reports it, is not recorded: no change, no event. The
/// report of a GPU in service that follows it is (and shows the first was read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemons_health_report_of_a_retired_gpu_changes_nothing() {
    let (app, nodes, _) = setup().await;
    let node = &nodes[0];
    let devices = app
        .ok(
            &app.operator(),
            "query($id: ID!) { node(id: $id) { ... on ComputeNode { devices { id uuid } } } }",
            json!({ "id": node }),
        )
        .await["node"]["devices"]
        .clone();
    let (retired, live) = (&devices[0], &devices[1]);
    app.ok(
        &app.operator(),
        "mutation($i: RetireDeviceInput!) { retireDevice(input: $i) { device { retiredAt } } }",
        json!({ "i": { "id": retired["id"] } }),
    )
    .await;
    let mut session = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    for d in [retired, live] {
        session
            .send(json!({ "type": "deviceHealth", "uuid": d["uuid"], "health": "unhealthy", "reason": "XID 79" }))
            .await
            .expect("send");
    }
    let health = |id: Value| {
        let pool = app.db.db.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT health FROM devices WHERE id = $1")
                .bind(id.as_str().unwrap_or_default().to_owned())
                .fetch_one(&pool)
                .await
                .expect("health")
        }
    };
    compute_tests::eventually("the GPU in service reported unhealthy", WAIT, || async {
        (health(live["id"].clone()).await == "unhealthy").then_some(())
    })
    .await;
    assert_eq!(
        health(retired["id"].clone()).await,
        "healthy",
        "the retired GPU unchanged"
    );
    let events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE type = 'device.health_changed' AND subject = $1",
    )
    .bind(retired["id"].as_str().unwrap_or_default())
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(events, 0, "no event for it");
}

/// An operator's UNHEALTHY mark is the operator's to lift: the node's failing report with
/// another reason does not take it over, and the passing report after it does not clear it. A
/// GPU the operator marked HEALTHY is the node's again when it fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemons_reports_never_lift_an_operators_unhealthy_mark() {
    let (app, nodes, _) = setup().await;
    let node = &nodes[0];
    let op = app.operator();
    let devices = app
        .ok(
            &op,
            "query($id: ID!) { node(id: $id) { ... on ComputeNode { devices { id uuid } } } }",
            json!({ "id": node }),
        )
        .await["node"]["devices"]
        .clone();
    let (marked, other) = (&devices[0], &devices[1]);
    const SET: &str =
        "mutation($i: SetDeviceHealthInput!) { setDeviceHealth(input: $i) { device { health } } }";
    app.ok(
        &op,
        SET,
        json!({ "i": { "id": marked["id"], "health": "UNHEALTHY", "reason": "bad fan" } }),
    )
    .await;
    let row = |id: Value| {
        let pool = app.db.db.pool().clone();
        async move {
            sqlx::query_as::<_, (String, Option<String>, Option<String>)>(
                "SELECT health, health_reason, health_by FROM devices WHERE id = $1",
            )
            .bind(id.as_str().unwrap_or_default().to_owned())
            .fetch_one(&pool)
            .await
            .expect("device")
        }
    };
    let mut session = Session::open(&daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    // A failing report with its own reason, then a passing one (the GPU was reset), then a
    // marker on the other GPU that shows both were read.
    for (d, health, reason) in [
        (marked, "unhealthy", "XID 79"),
        (marked, "healthy", ""),
        (other, "unhealthy", "XID 48"),
    ] {
        session
            .send(json!({ "type": "deviceHealth", "uuid": d["uuid"], "health": health, "reason": reason }))
            .await
            .expect("send");
    }
    compute_tests::eventually("the other GPU reported unhealthy", WAIT, || async {
        (row(other["id"].clone()).await.0 == "unhealthy").then_some(())
    })
    .await;
    assert_eq!(
        row(marked["id"].clone()).await,
        (
            "unhealthy".to_owned(),
            Some("bad fan".to_owned()),
            Some("operator".to_owned())
        ),
        "the operator's mark stands"
    );
    // The operator calls the other GPU healthy; the node's next failure counts again.
    app.ok(
        &op,
        SET,
        json!({ "i": { "id": other["id"], "health": "HEALTHY" } }),
    )
    .await;
    session
        .send(json!({ "type": "deviceHealth", "uuid": other["uuid"], "health": "unhealthy", "reason": "XID 79" }))
        .await
        .expect("send");
    compute_tests::eventually(
        "the node's failure after the operator's HEALTHY",
        WAIT,
        || async {
            let r = row(other["id"].clone()).await;
            (r.0 == "unhealthy" && r.2.as_deref() == Some("node")).then_some(())
        },
    )
    .await;
}
