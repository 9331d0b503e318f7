//! The command torture run: 2,000 commands over 200 simulated nodes with random disconnects,
//! journal resets and a SIGKILLed dispatch process, then checks, from the database and from the
//! daemons' journals, that no command ran twice, none was lost, every state change was a legal
//! transition, and every command that was not retry-safe and in flight at a reset failed. The
//! counts go to CI's output (`command-torture-report.txt`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use compute_domain::idempotency::Actor;
use compute_domain::ids::NodeId;
use compute_domain::node_commands::state::{State, TRANSITIONS};
use compute_domain::node_commands::{self as cmds, Kind};
use compute_sim::{Behaviour, DaemonConfig, Partition, SharedJournal};
use serde_json::{Value, json};

use crate::commands::{dispatch_process, pass_time, seed_nodes, states};

const NODES: usize = 200;
const COMMANDS: usize = 2_000;

/// Every journal each node's daemon had, in order.
type Journals = Arc<Mutex<HashMap<String, Vec<SharedJournal>>>>;

fn start_daemon(
    app: &compute_tests::TestApp,
    node: &str,
    generation: usize,
    journals: &Journals,
) -> Running {
    let id = format!("j-{node}-{generation}");
    let journal = compute_sim::journal(&id);
    journals
        .lock()
        .expect("journals")
        .entry(node.to_owned())
        .or_default()
        .push(journal.clone());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let config = DaemonConfig {
        url: app.agent_url(),
        token: app.node_token(node),
        node_id: node.to_owned(),
        daemon_version: "sim/1".into(),
        journal_id: id,
        observed_generation: 0,
    };
    let behaviour = Behaviour {
        reconnect_after: Duration::from_millis(100),
        partition: Some(Partition {
            every: Duration::from_secs(2),
            fraction: 0.05,
            lasts: Duration::from_millis(300),
        }),
        journal: Some(journal),
        command_time: Duration::from_millis(150),
        ..Behaviour::default()
    };
    let task = tokio::spawn(compute_sim::run_daemon(
        config,
        behaviour,
        stopped,
        |_, _| {},
    ));
    (stop, task)
}

/// A running daemon: how to stop it, and its task.
type Running = (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
);

/// The state an event of type `t` leaves a command in (`None`: no change).
fn state_after(t: &str) -> Option<State> {
    Some(match t {
        "command.created" | "command.requeued" => State::Pending,
        "command.dispatched" => State::Dispatched,
        "command.running" => State::Running,
        "command.succeeded" => State::Succeeded,
        "command.failed" => State::Failed,
        "command.cancelled" => State::Cancelled,
        _ => return None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_torture_no_command_runs_twice_or_is_lost() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let nodes = seed_nodes(&app, NODES).await;
    let journals: Journals = Arc::default();
    let mut running: HashMap<String, Running> = nodes
        .iter()
        .map(|n| (n.clone(), start_daemon(&app, n, 0, &journals)))
        .collect();
    let started = std::time::Instant::now();

    // The commands: a quarter each of noop and drain (retry-safe), reset_gpu and
    // set_mig_layout (not), spread over the nodes, created while everything else goes on.
    let producer = tokio::spawn({
        let (db, nodes) = (app.db.db.clone(), nodes.clone());
        async move {
            let operator = Actor::operator("ops");
            let kinds = [
                Kind::Noop,
                Kind::DrainWorkloads,
                Kind::ResetGpu,
                Kind::SetMigLayout,
            ];
            for i in 0..COMMANDS {
                let node = NodeId::parse("node", &nodes[(i * 7) % nodes.len()]).expect("node");
                cmds::run_command(
                    &db,
                    &operator,
                    cmds::CommandRequest::parse(node, kinds[i % kinds.len()], json!({}), 0, None)
                        .expect("valid CommandRequest"),
                    &format!("t{i}"),
                )
                .await
                .expect("run");
                if i % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    });

    // The dispatcher, SIGKILLed once part-way; meanwhile, every 300 ms three daemons are wiped
    // and come back with a new journal. Two of the three are nodes with a command that is not
    // retry-safe in flight (dispatched or running) when there are any, so every run puts resets
    // in the middle of such commands (left to chance, a CI run once wiped 90 daemons and hit
    // none); the third is drawn from the node list.
    let mut first = dispatch_process(&app);
    let mut wiped = 0;
    for round in 0..30usize {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut targets: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT node_id FROM commands
              WHERE state IN ('dispatched', 'running') AND NOT retry_safe
              LIMIT 2",
        )
        .fetch_all(app.db.db.pool())
        .await
        .expect("nodes with commands in flight");
        let mut k = 0;
        while targets.len() < 3 {
            let drawn = nodes[(round * 37 + k * 61) % nodes.len()].clone();
            if !targets.contains(&drawn) {
                targets.push(drawn);
            }
            k += 1;
        }
        for (k, node) in targets.into_iter().enumerate() {
            // The old daemon is gone (wiped) before the new one starts.
            if let Some((stop, task)) = running.remove(&node) {
                let _ = stop.send(true);
                let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
            }
            running.insert(
                node.clone(),
                start_daemon(&app, &node, round * 3 + k + 1, &journals),
            );
            wiped += 1;
        }
        if round == 12 {
            first.kill().await.expect("SIGKILL");
            eprintln!(
                "command torture: dispatcher SIGKILLed at {:?}: {:?}",
                started.elapsed(),
                states(&app).await
            );
            pass_time(&app, 70).await;
            first = dispatch_process(&app);
        }
    }
    producer.await.expect("producer");
    // Simulated time moves with the wall clock from here on, as real time would: a dispatcher's
    // run that was cut short leaves its claims until they lapse (`DISPATCH_CLAIM`, 10 s), and
    // with a frozen clock they never would.
    let waited = std::time::Instant::now();
    let mut moved = 0;
    loop {
        let s = states(&app).await;
        let open: i64 = ["pending", "dispatched", "running"]
            .iter()
            .map(|k| s.get(*k).copied().unwrap_or(0))
            .sum();
        if open == 0 {
            break;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(120),
            "commands still open after 120 s: {s:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        app.db.advance_clock(1).await;
        moved += 1;
    }
    eprintln!(
        "command torture: the last commands ended {moved} s (simulated, as wall) after the producer"
    );
    let elapsed = started.elapsed();
    for (_, (stop, _)) in running {
        let _ = stop.send(true);
    }
    drop(first);

    // The checks.
    let db = app.db.db.pool();
    let rows: Vec<(String, String, bool, String, Option<String>, i32)> =
        sqlx::query_as("SELECT id, node_id, retry_safe, state, error_code, attempts FROM commands")
            .fetch_all(db)
            .await
            .expect("commands");
    let operators: i64 =
        sqlx::query_scalar("SELECT count(*) FROM commands WHERE created_by = 'ops'")
            .fetch_one(db)
            .await
            .expect("count");
    assert_eq!(
        operators, COMMANDS as i64,
        "every runCommand made one command"
    );
    let events: Vec<(String, String, Value)> = sqlx::query_as(
        "SELECT subject, type, data FROM outbox WHERE type LIKE 'command.%' ORDER BY txid, seq",
    )
    .fetch_all(db)
    .await
    .expect("events");
    let mut by_command: HashMap<&str, Vec<(&str, &Value)>> = HashMap::new();
    for (subject, t, data) in &events {
        by_command.entry(subject).or_default().push((t, data));
    }
    let journals = journals.lock().expect("journals").clone();
    let mut problems = Vec::new();
    let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
    for (id, node, retry_safe, state, error_code, attempts) in &rows {
        *counts.entry(state.as_str()).or_default() += 1;
        // Legal moves only, ending where the row is.
        let mut at: Option<State> = None;
        let mut dispatched_journals = Vec::new();
        for (t, data) in by_command
            .get(id.as_str())
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            if *t == "command.dispatched" {
                dispatched_journals.push(
                    data["command"]["journalId"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned(),
                );
            }
            let Some(next) = state_after(t) else { continue };
            match at {
                None if next == State::Pending => {}
                None => problems.push(format!("{id}: first event {t}")),
                Some(from)
                    if TRANSITIONS
                        .iter()
                        .any(|(_, f, to)| *f == from && *to == next) => {}
                Some(from) => problems.push(format!("{id}: {from} -> {next} is not a transition")),
            }
            at = Some(next);
        }
        if at.map(State::as_str) != Some(state.as_str()) {
            problems.push(format!("{id}: events end at {at:?}, the row is {state}"));
        }
        // Runs, from the daemons' journals.
        let runs: Vec<u32> = journals
            .get(node)
            .map(|js| {
                js.iter()
                    .map(|j| {
                        j.lock()
                            .expect("journal")
                            .entries
                            .get(id)
                            .map_or(0, |e| e.executions)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let total: u32 = runs.iter().sum();
        if runs.iter().any(|r| *r > 1) {
            problems.push(format!(
                "{id}: ran more than once under one journal: {runs:?}"
            ));
        }
        if !retry_safe && total > 1 {
            problems.push(format!("{id}: not retry-safe, ran {total} times"));
        }
        if state == "succeeded" && total == 0 {
            problems.push(format!("{id}: succeeded without running"));
        }
        // A command that is not retry-safe is never sent to a second journal: a reset fails it.
        dispatched_journals.dedup();
        if !retry_safe && dispatched_journals.len() > 1 {
            problems.push(format!(
                "{id}: not retry-safe, dispatched to journals {dispatched_journals:?}"
            ));
        }
        if state == "failed" && (*retry_safe || error_code.as_deref() != Some("JOURNAL_RESET")) {
            problems.push(format!(
                "{id}: failed with {error_code:?} (retry-safe: {retry_safe})"
            ));
        }
        if *attempts < 1 {
            problems.push(format!("{id}: ended without a dispatch"));
        }
    }
    // At most once per session, from the daemons' side.
    let mut deliveries = 0;
    for js in journals.values() {
        for j in js {
            for (id, e) in &j.lock().expect("journal").entries {
                deliveries += e.received;
                let mut s = e.sessions.clone();
                s.sort_unstable();
                let n = s.len();
                s.dedup();
                if s.len() != n {
                    problems.push(format!(
                        "{id}: received twice in one session: {:?}",
                        e.sessions
                    ));
                }
            }
        }
    }
    let resets = rows
        .iter()
        .filter(|r| r.4.as_deref() == Some("JOURNAL_RESET"))
        .count();
    let redispatched = rows.iter().filter(|r| r.5 > 1).count();
    let report = format!(
        "command torture: {} commands ({operators} operators', the rest apply_spec) over {NODES} nodes in {:.1} s; \
         journal resets {wiped}, a dispatcher SIGKILL; end states {counts:?}; failed JOURNAL_RESET {resets}; \
         dispatched more than once (to a newer session) {redispatched}; deliveries to daemons {deliveries}; \
         the last ended {moved} s after the producer; violations {}\n",
        rows.len(),
        elapsed.as_secs_f64(),
        problems.len()
    );
    // The violations too, so a failed run in CI can be read from the report CI prints.
    let report = problems
        .iter()
        .take(30)
        .fold(report, |r, p| format!("{r}  {p}\n"));
    eprint!("{report}");
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("command-torture-report.txt"),
        &report,
    );
    assert!(
        problems.is_empty(),
        "{:#?}",
        &problems[..problems.len().min(30)]
    );
    assert!(resets > 0, "the run exercised journal resets");
}
