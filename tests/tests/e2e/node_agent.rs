//! The real node daemon, `compute-agent`, as a child process (`CARGO_BIN_EXE_test-agent`)
//! against the real gateway: workloads run by the process runtime on exactly their
//! allocation's devices, exits reported, SIGKILL at every step of a command, an emptied state
//! directory, and the daemon's own refusal of overlapping devices (`docs/agent.md`). The
//! workflow and the dispatcher are stepped; the database's clock is simulated.

use std::path::{Path, PathBuf};
use std::time::Duration;

use compute_tests::TestApp;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::commands::pass_time;
use crate::instances::{CREATE_INSTANCE, Workers, state, step_until};
use crate::reservations::pool;

const WAIT: Duration = Duration::from_secs(30);
const STOP: &str =
    "mutation($i: StopInstanceInput!) { stopInstance(input: $i) { instance { id state } } }";
const RUN: &str =
    "mutation($i: RunCommandInput!) { runCommand(input: $i) { command { id state } } }";
const COMMAND: &str =
    "query($id: ID!) { command(id: $id) { state errorCode errorMessage result } }";
const INSTANCE: &str =
    "query($id: ID!) { instance(id: $id) { state reason exitCode exitSignal exitedAt } }";

/// A fresh directory for one test's agent and its workloads.
fn test_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir()
        .join("compute-agent-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("out")).expect("test dir");
    d
}

/// Starts `compute-agent` for `node` with its state in `state`, logging to `<state>.log`.
fn start_agent(app: &TestApp, node: &str, state: &Path, fault: Option<&str>) -> Child {
    start_agent_with(app, node, state, fault, &[])
}

/// [`start_agent`] with more flags.
fn start_agent_with(
    app: &TestApp,
    node: &str,
    state: &Path,
    fault: Option<&str>,
    extra: &[&str],
) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.with_extension("log"))
        .expect("agent log");
    let mut c = Command::new(env!("CARGO_BIN_EXE_test-agent"));
    c.args(["--url", &app.agent_url(), "--node-id", node])
        .arg("--state-dir")
        .arg(state)
        .args(["--listen", "127.0.0.1:0", "--stop-grace-seconds", "3"])
        .env("COMPUTE_AGENT_TOKEN", app.node_token(node))
        .env_remove("COMPUTE_AGENT_FAULT")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .args(extra)
        .kill_on_drop(true);
    if let Some(f) = fault {
        c.args(["--fault", f]);
    }
    c.spawn().expect("compute-agent starts")
}

/// The journal id of `node`'s open session, once the agent has one.
async fn connected(app: &TestApp, node: &str) -> String {
    compute_tests::eventually("the agent's session opens", WAIT, || async {
        sqlx::query_scalar::<_, String>(
            "SELECT journal_id FROM node_sessions WHERE node_id = $1 AND closed_at IS NULL",
        )
        .bind(node)
        .fetch_optional(app.db.db.pool())
        .await
        .expect("session")
    })
    .await
}

/// Stops an agent with SIGTERM, as systemd does; it must exit cleanly.
async fn stop_agent(mut agent: Child) {
    let pid = agent.id().expect("pid") as i32;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let status = tokio::time::timeout(WAIT, agent.wait())
        .await
        .expect("the agent stops on SIGTERM")
        .expect("status");
    assert!(status.success(), "compute-agent exited with {status}");
}

/// Whether process `pid` runs (a zombie has ended).
fn alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// The pids a workload wrote to `file` as it started, one line each start.
fn starts(file: &Path) -> Vec<i64> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// A reservation of one GPU of node h100-a: (node, allocation, atoms).
async fn one_gpu(app: &TestApp, member: &str, key: &str) -> (String, String, Value) {
    let p = pool(app).await;
    one_gpu_in(app, &p.pool, member, key).await
}

/// [`one_gpu`] in pool `pool`, made already.
async fn one_gpu_in(app: &TestApp, pool: &str, member: &str, key: &str) -> (String, String, Value) {
    let r =
        crate::agent::on_h100_a(app, member, pool, key).await["createReservation"]["reservation"]
            .clone();
    assert_eq!(r["state"], "ACTIVE", "{r}");
    let a = &r["allocations"][0];
    (
        a["computeNodeId"].as_str().expect("node").to_owned(),
        a["id"].as_str().expect("allocation").to_owned(),
        a["atoms"].clone(),
    )
}

async fn setup() -> TestApp {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    app
}

/// `createInstance` on `allocation` of `image` running `command` with `env`; the instance's id.
async fn create(
    app: &TestApp,
    member: &str,
    allocation: &str,
    image: &str,
    command: Value,
    env: Value,
) -> String {
    app.ok(
        member,
        CREATE_INSTANCE,
        json!({ "i": { "allocationId": allocation, "image": image, "command": command, "env": env,
                       "idempotencyKey": format!("i-{allocation}") } }),
    )
    .await["createInstance"]["instance"]["id"]
        .as_str()
        .expect("id")
        .to_owned()
}

/// `createInstance` of a shell script with `OUT` set to `out`; the instance's id.
async fn instance(
    app: &TestApp,
    member: &str,
    allocation: &str,
    script: &str,
    out: &Path,
) -> String {
    let env = json!([{ "name": "OUT", "value": out.display().to_string() }]);
    create(
        app,
        member,
        allocation,
        "local/none",
        json!(["/bin/sh", "-c", script]),
        env,
    )
    .await
}

/// Steps the workers until instance `id` is `FAILED`; asserts its reason names each of `why`.
async fn failed_because(
    app: &TestApp,
    workers: &mut Workers,
    member: &str,
    id: &str,
    why: &[&str],
) {
    step_until(app, workers, id, "FAILED").await;
    let s = state(app, member, id).await;
    let reason = s["reason"].as_str().unwrap_or_default();
    assert!(why.iter().all(|w| reason.contains(w)), "{s}");
}

/// The output of the instance's run command.
async fn run_output(app: &TestApp, id: &str) -> Value {
    sqlx::query_scalar("SELECT result FROM commands WHERE idempotency_key = $1")
        .bind(format!("wf:{id}:run"))
        .fetch_one(app.db.db.pool())
        .await
        .expect("run command")
}

/// How many times each kind of command's work began in the agent's journal.
fn executions(state: &Path) -> Vec<(String, i64)> {
    let j = compute_agent::journal::Journal::open(state).expect("the agent's journal");
    j.executions()
        .expect("executions")
        .into_iter()
        .map(|(_, kind, n)| (kind, n))
        .collect()
}

const SLEEPER: &str = "echo $$ >> \"$OUT/starts\"; env > \"$OUT/env\"; exec sleep 300";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_runs_on_exactly_its_allocation_and_stops_with_its_reservation() {
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, atoms) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("runs");
    let out = dir.join("out");
    let state_dir = dir.join("state");
    let agent = start_agent(&app, &node, &state_dir, None);
    let journal = connected(&app, &node).await;
    assert!(journal.starts_with("jrn_"), "{journal}");
    let mut workers = Workers::new(&app);
    let id = instance(&app, &acme, &allocation, SLEEPER, &out).await;
    step_until(&app, &mut workers, &id, "RUNNING").await;

    let env_file = out.join("env");
    let env = compute_tests::eventually("the workload writes its environment", WAIT, || async {
        let text = std::fs::read_to_string(&env_file).ok()?;
        text.contains("COMPUTE_INSTANCE_ID").then_some(text)
    })
    .await;
    let vars: std::collections::HashMap<&str, &str> =
        env.lines().filter_map(|l| l.split_once('=')).collect();
    let want = atoms[0].as_str().expect("atom");
    assert_eq!(vars.get("CUDA_VISIBLE_DEVICES"), Some(&want), "{env}");
    assert_eq!(vars.get("NVIDIA_VISIBLE_DEVICES"), Some(&want), "{env}");
    assert_eq!(vars.get("COMPUTE_INSTANCE_ID"), Some(&id.as_str()));
    assert_eq!(vars.get("OUT"), Some(&out.to_str().expect("path")));
    assert!(
        !vars.keys().any(|k| k.contains("TOKEN")),
        "the node's credential leaked into the workload: {env}"
    );
    let pids = starts(&out.join("starts"));
    assert_eq!(pids.len(), 1, "started once: {pids:?}");
    assert!(alive(pids[0]));
    assert_eq!(run_output(&app, &id).await["pid"], json!(pids[0]));
    assert!(
        state_dir.join("logs").join(format!("{id}.log")).exists(),
        "a per-instance log file"
    );

    // The reservation ends (02:00): the workflow stops the workload, which is gone.
    pass_time(&app, 2 * 3600).await;
    let mut reconciler = compute_workers::Reconciler::new(app.db.db.clone(), "worker-resync");
    reconciler.pass().await.expect("the reservation expires");
    step_until(&app, &mut workers, &id, "STOPPED").await;
    assert!(
        !alive(pids[0]),
        "the workload is gone when stop_instance succeeds"
    );
    // Each command ran once (the node's spec, apply_spec, too).
    let mut runs = executions(&state_dir);
    runs.sort();
    assert_eq!(
        runs,
        [
            ("apply_spec".to_owned(), 1),
            ("run_instance".to_owned(), 1),
            ("stop_instance".to_owned(), 1)
        ],
        "each command ran once"
    );
    // The agent's own metrics count them.
    let addr = std::fs::read_to_string(state_dir.join("listen-address")).expect("address");
    let metrics = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("body");
    assert!(
        metrics.contains(
            "compute_agent_commands_total{kind=\"run_instance\",outcome=\"succeeded\"} 1"
        ),
        "{metrics}"
    );
    let health: Value = reqwest::get(format!("http://{addr}/healthz"))
        .await
        .expect("GET /healthz")
        .json()
        .await
        .expect("json");
    assert_eq!(health["journalId"], json!(journal));
    assert_eq!(health["connected"], json!(true));
    stop_agent(agent).await;
}

/// A workload whose leader exits on its own takes the rest of its process group with it: a
/// process it left in the background does not run on after the instance is `EXITED` and its
/// GPUs are free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_whose_leader_exits_leaves_no_process_behind() {
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, _) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("leader-exits");
    let out = dir.join("out");
    let agent = start_agent(&app, &node, &dir.join("state"), None);
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(
        &app,
        &acme,
        &allocation,
        "sleep 300 & echo $! > \"$OUT/bg\"; exit 0",
        &out,
    )
    .await;
    step_until(&app, &mut workers, &id, "EXITED").await;
    let bg: i64 = std::fs::read_to_string(out.join("bg"))
        .expect("the background pid")
        .trim()
        .parse()
        .expect("a pid");
    compute_tests::eventually("the background process is gone", WAIT, || async {
        (!alive(bg)).then_some(())
    })
    .await;
    stop_agent(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_that_exits_with_code_3_shows_it_on_its_instance() {
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, _) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("exit3");
    let agent = start_agent(&app, &node, &dir.join("state"), None);
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(&app, &acme, &allocation, "exit 3", &dir.join("out")).await;
    step_until(&app, &mut workers, &id, "EXITED").await;
    let i = app.ok(&acme, INSTANCE, json!({ "id": id })).await["instance"].clone();
    assert_eq!(i["exitCode"], json!(3), "{i}");
    assert_eq!(i["exitSignal"], Value::Null);
    assert!(i["exitedAt"].is_string(), "{i}");
    assert!(
        i["reason"].as_str().is_some_and(|r| r.contains("code 3")),
        "{i}"
    );
    let events: Vec<(String, Value)> = sqlx::query_as(
        "SELECT type, data FROM outbox WHERE subject = $1 AND type = 'instance.exited'",
    )
    .bind(&id)
    .fetch_all(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].1["instance"]["exitCode"], json!(3));
    // The workflow does not start it again: one run command, and it stays exited.
    for _ in 0..5 {
        workers.step().await;
    }
    assert_eq!(state(&app, &acme, &id).await["state"], "EXITED");
    let runs: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM commands WHERE workflow_id = $1 AND kind = 'run_instance'",
    )
    .bind(&id)
    .fetch_one(app.db.db.pool())
    .await
    .expect("count");
    assert_eq!(runs, 1);
    stop_agent(agent).await;
}

/// SIGKILLs the agent at `point` of the instance's `run_instance`, starts it again with the
/// same state directory, and checks that the workload started at most once, the result
/// reached the control plane, and a running workload was adopted.
async fn killed_at(point: &str) {
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, _) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir(point);
    let out = dir.join("out");
    let state_dir = dir.join("state");
    let mut agent = start_agent(
        &app,
        &node,
        &state_dir,
        Some(&format!("{point}:run_instance")),
    );
    let journal = connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(&app, &acme, &allocation, SLEEPER, &out).await;
    let started = tokio::time::Instant::now();
    let status = loop {
        workers.step().await;
        if let Some(status) = agent.try_wait().expect("wait") {
            break status;
        }
        assert!(started.elapsed() < WAIT, "the agent did not reach {point}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "killed at {point}: {status}");

    let agent = start_agent(&app, &node, &state_dir, None);
    assert_eq!(connected(&app, &node).await, journal, "the same journal");
    if point == "after-start-recorded" {
        // The work had not begun: not retry-safe, so it is not begun again.
        failed_because(&app, &mut workers, &acme, &id, &["INTERRUPTED"]).await;
        assert!(starts(&out.join("starts")).is_empty(), "it never started");
    } else {
        step_until(&app, &mut workers, &id, "RUNNING").await;
        let pids = compute_tests::eventually("the workload wrote its pid", WAIT, || async {
            let p = starts(&out.join("starts"));
            (!p.is_empty()).then_some(p)
        })
        .await;
        assert_eq!(pids.len(), 1, "the workload started once: {pids:?}");
        assert!(alive(pids[0]), "adopted, still running");
        assert_eq!(
            run_output(&app, &id).await["pid"],
            json!(pids[0]),
            "the same process"
        );
        // The adopted workload is stopped like any other.
        app.ok(&acme, STOP, json!({ "i": { "id": id } })).await;
        step_until(&app, &mut workers, &id, "STOPPED").await;
        assert!(!alive(pids[0]), "stopped after adoption");
    }
    let runs = executions(&state_dir);
    assert_eq!(
        runs.iter()
            .filter(|(k, _)| k == "run_instance")
            .map(|(_, n)| *n)
            .collect::<Vec<_>>(),
        [1],
        "run_instance began once in the journal: {runs:?}"
    );
    stop_agent(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_ack() {
    killed_at("after-ack").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_start_is_recorded() {
    killed_at("after-start-recorded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_workload_started() {
    killed_at("after-workload-started").await;
}

/// The daemon acknowledged `run_instance` and started the workload, then died before it
/// reported; the tenant stops the instance while it is down. When it comes back, the new
/// session puts the acknowledged command back to pending: that is not "never started" (the
/// instance was once marked stopped with its workload still running on the GPUs). The stop
/// waits for the command's outcome, then stops the workload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_daemon_is_down_after_it_started_the_workload_stops_it() {
    let point = "after-workload-started";
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, _) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("stop-while-down");
    let out = dir.join("out");
    let state_dir = dir.join("state");
    let mut agent = start_agent(
        &app,
        &node,
        &state_dir,
        Some(&format!("{point}:run_instance")),
    );
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(&app, &acme, &allocation, SLEEPER, &out).await;
    let started = tokio::time::Instant::now();
    while agent.try_wait().expect("wait").is_none() {
        workers.step().await;
        assert!(started.elapsed() < WAIT, "the agent did not reach {point}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pids = starts(&out.join("starts"));
    assert_eq!(pids.len(), 1, "the workload started: {pids:?}");
    app.ok(&acme, STOP, json!({ "i": { "id": id } })).await;
    workers.step().await;
    let agent = start_agent(&app, &node, &state_dir, None);
    connected(&app, &node).await;
    step_until(&app, &mut workers, &id, "STOPPED").await;
    assert!(
        !alive(pids[0]),
        "the workload was stopped, not left on the GPUs"
    );
    let stops: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM commands WHERE workflow_id = $1 AND kind = 'stop_instance' AND state = 'succeeded'",
    )
    .bind(&id)
    .fetch_one(app.db.db.pool())
    .await
    .expect("count");
    assert_eq!(stops, 1, "stopped by a stop_instance");
    stop_agent(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_outcome_is_recorded() {
    killed_at("after-outcome-recorded").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emptied_state_directory_is_a_new_journal() {
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, _) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("wiped");
    let out = dir.join("out");
    let state_dir = dir.join("state");
    let mut agent = start_agent(&app, &node, &state_dir, Some("after-ack:run_instance"));
    let first = connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(&app, &acme, &allocation, SLEEPER, &out).await;
    let started = tokio::time::Instant::now();
    while agent.try_wait().expect("wait").is_none() {
        workers.step().await;
        assert!(started.elapsed() < WAIT, "the agent did not die");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    std::fs::remove_dir_all(&state_dir).expect("wipe");
    let agent = start_agent(&app, &node, &state_dir, None);
    let second = compute_tests::eventually("a session with a new journal", WAIT, || async {
        let j = connected(&app, &node).await;
        (j != first).then_some(j)
    })
    .await;
    assert!(second.starts_with("jrn_"));
    // The run command was in flight and is not retry-safe: JOURNAL_RESET, never sent again.
    failed_because(&app, &mut workers, &acme, &id, &["JOURNAL_RESET"]).await;
    assert!(starts(&out.join("starts")).is_empty(), "it never ran");
    let runs = executions(&state_dir);
    assert!(
        !runs.iter().any(|(k, _)| k == "run_instance"),
        "the new journal never ran the workload: {runs:?}"
    );
    stop_agent(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_devices_a_running_workload_holds() {
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, atoms) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("overlap");
    let out = dir.join("out");
    let agent = start_agent(&app, &node, &dir.join("state"), None);
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(&app, &acme, &allocation, SLEEPER, &out).await;
    step_until(&app, &mut workers, &id, "RUNNING").await;
    let first = compute_tests::eventually("the first workload runs", WAIT, || async {
        starts(&out.join("starts")).first().copied()
    })
    .await;

    // An operator sends a run_instance for the same GPU by hand.
    let cmd = app
        .ok(
            &app.operator(),
            RUN,
            json!({ "i": { "computeNodeId": node, "kind": "RUN_INSTANCE", "idempotencyKey": "by-hand",
                           "args": { "instanceId": "ins_byhand", "image": "local/none", "devices": atoms,
                                     "command": ["/bin/sh", "-c", "echo $$ >> \"$OUT/intruder\"; exec sleep 300"],
                                     "env": { "OUT": out.display().to_string() } } } }),
        )
        .await["runCommand"]["command"]["id"]
        .as_str()
        .expect("command")
        .to_owned();
    let done = command_end(&app, &mut workers, &cmd).await;
    assert_eq!(done["state"], "FAILED", "{done}");
    assert_eq!(done["errorCode"], "DEVICE_OVERLAP", "{done}");
    assert!(alive(first), "the first workload keeps running");
    assert!(
        starts(&out.join("intruder")).is_empty(),
        "the overlapping workload never started"
    );
    assert_eq!(state(&app, &acme, &id).await["state"], "RUNNING");
    app.ok(&acme, STOP, json!({ "i": { "id": id } })).await;
    step_until(&app, &mut workers, &id, "STOPPED").await;

    // A by-hand workload of no instance that exits: its exit is answered, not recorded, and
    // the session stays open (it once closed it with 4400, again at every reconnection).
    let epoch = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT session_epoch FROM node_sessions WHERE node_id = $1 AND closed_at IS NULL",
        )
        .bind(&node)
        .fetch_optional(app.db.db.pool())
        .await
        .expect("session")
    };
    let before = epoch().await;
    let cmd = app
        .ok(
            &app.operator(),
            RUN,
            json!({ "i": { "computeNodeId": node, "kind": "RUN_INSTANCE", "idempotencyKey": "no-instance",
                           "args": { "instanceId": "not-an-instance", "image": "local/none", "command": ["/bin/sh", "-c", "exit 0"] } } }),
        )
        .await["runCommand"]["command"]["id"]
        .as_str()
        .expect("command")
        .to_owned();
    let done = command_end(&app, &mut workers, &cmd).await;
    assert_eq!(done["state"], "SUCCEEDED", "{done}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(epoch().await, before, "the session stayed open");
    stop_agent(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_that_ended_while_the_agent_was_down_is_reported_when_it_comes_back() {
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, _) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("down");
    let out = dir.join("out");
    let state_dir = dir.join("state");
    let mut agent = start_agent(&app, &node, &state_dir, None);
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(&app, &acme, &allocation, SLEEPER, &out).await;
    step_until(&app, &mut workers, &id, "RUNNING").await;
    let pid = compute_tests::eventually("the workload runs", WAIT, || async {
        starts(&out.join("starts")).first().copied()
    })
    .await;
    agent.start_kill().expect("SIGKILL the agent");
    agent.wait().await.expect("gone");
    // While it is down, the workload dies.
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    compute_tests::eventually("the workload is gone", WAIT, || async {
        (!alive(pid)).then_some(())
    })
    .await;
    let agent = start_agent(&app, &node, &state_dir, None);
    step_until(&app, &mut workers, &id, "EXITED").await;
    let i = app.ok(&acme, INSTANCE, json!({ "id": id })).await["instance"].clone();
    assert_eq!(i["exitCode"], Value::Null, "its parent was gone: no code");
    assert!(
        i["reason"].as_str().is_some_and(|r| r.contains("away")),
        "{i}"
    );
    assert_eq!(starts(&out.join("starts")).len(), 1, "never started again");
    stop_agent(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_program_fails_its_instance_and_a_drain_ends_the_others() {
    let app = setup().await;
    let acme = app.member("acme");
    let p = pool(&app).await;
    let (node, first, _) = one_gpu_in(&app, &p.pool, &acme, "r1").await;
    let (_, second, _) = one_gpu_in(&app, &p.pool, &acme, "r2").await;
    let dir = test_dir("drain");
    let out = dir.join("out");
    let agent = start_agent(&app, &node, &dir.join("state"), None);
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let made = create(
        &app,
        &acme,
        &first,
        "host",
        json!(["/nonexistent/train"]),
        json!([]),
    )
    .await;
    failed_because(
        &app,
        &mut workers,
        &acme,
        &made,
        &["EXECUTABLE_NOT_FOUND", "/nonexistent/train"],
    )
    .await;

    let id = instance(&app, &acme, &second, SLEEPER, &out).await;
    step_until(&app, &mut workers, &id, "RUNNING").await;
    let pid = compute_tests::eventually("the workload runs", WAIT, || async {
        starts(&out.join("starts")).first().copied()
    })
    .await;
    let cmd = drain(&app, &node, 2).await;
    let done = command_end(&app, &mut workers, &cmd).await;
    assert_eq!(done["state"], "SUCCEEDED", "{done}");
    assert_eq!(done["result"]["stopped"], json!([id]), "{done}");
    assert!(!alive(pid), "drained");
    // Its instance did not ask to stop: it hears that its workload ended (SIGTERM).
    step_until(&app, &mut workers, &id, "EXITED").await;
    let i = app.ok(&acme, INSTANCE, json!({ "id": id })).await["instance"].clone();
    assert_eq!(i["exitSignal"], json!(15), "{i}");
    stop_agent(agent).await;
}

/// A small tmpfs mounted at `dir` (this project's machines run their tests as root), unmounted
/// when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(dir).expect("mount point");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("mount");
        assert!(
            out.status.success(),
            "the full-disk test mounts a tmpfs (it runs as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk(dir.to_owned())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_command_and_never_acknowledges_it() {
    let app = setup().await;
    let p = pool(&app).await;
    let node = p.nodes[0].clone();
    let dir = test_dir("full");
    let disk = SmallDisk::mount(&dir.join("disk"), "2m");
    let state_dir = disk.0.join("state");
    let agent = start_agent(&app, &node, &state_dir, None);
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    // The node's spec first, so that nothing else is in flight.
    let settle = tokio::time::Instant::now();
    loop {
        workers.step().await;
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM commands WHERE node_id = $1 AND state NOT IN ('succeeded', 'failed', 'cancelled')",
        )
        .bind(&node)
        .fetch_one(app.db.db.pool())
        .await
        .expect("count");
        if open == 0 {
            break;
        }
        assert!(settle.elapsed() < WAIT, "the spec is not applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Fill the disk to the last byte.
    {
        use std::io::Write;
        let mut filler = std::fs::File::create(disk.0.join("filler")).expect("filler");
        let block = vec![0u8; 64 * 1024];
        while filler.write_all(&block).is_ok() {}
        while filler.write_all(&[0]).is_ok() {}
    }
    let cmd = app
        .ok(
            &app.operator(),
            RUN,
            json!({ "i": { "computeNodeId": node, "kind": "NOOP", "idempotencyKey": "full" } }),
        )
        .await["runCommand"]["command"]["id"]
        .as_str()
        .expect("command")
        .to_owned();
    let done = command_end(&app, &mut workers, &cmd).await;
    assert_eq!(done["state"], "FAILED", "{done}");
    assert_eq!(done["errorCode"], "JOURNAL_UNWRITABLE", "{done}");
    let events: Vec<String> =
        sqlx::query_scalar("SELECT type FROM outbox WHERE subject = $1 ORDER BY txid, seq")
            .bind(&cmd)
            .fetch_all(app.db.db.pool())
            .await
            .expect("events");
    assert!(
        !events.iter().any(|e| e == "command.running"),
        "never acknowledged: {events:?}"
    );
    stop_agent(agent).await;
    std::fs::remove_file(disk.0.join("filler")).expect("room again");
    let runs = executions(&state_dir);
    assert!(
        !runs.iter().any(|(k, _)| k == "noop"),
        "the journal holds no trace of it: {runs:?}"
    );
    drop(disk);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_as_starts_the_workload_as_that_user_and_keeps_the_state_private() {
    use std::os::unix::fs::PermissionsExt;
    let app = setup().await;
    let acme = app.member("acme");
    let (node, allocation, _) = one_gpu(&app, &acme, "r1").await;
    let dir = test_dir("run-as");
    let out = dir.join("out");
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let state_dir = dir.join("state");
    let agent = start_agent_with(&app, &node, &state_dir, None, &["--run-as", "65534:65534"]);
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let id = instance(
        &app,
        &acme,
        &allocation,
        "id -u > \"$OUT/uid\"; touch \"$HOME/mine\"; exec sleep 300",
        &out,
    )
    .await;
    step_until(&app, &mut workers, &id, "RUNNING").await;
    let uid = compute_tests::eventually("the workload wrote its uid", WAIT, || async {
        std::fs::read_to_string(out.join("uid"))
            .ok()
            .filter(|t| t.ends_with('\n'))
    })
    .await;
    assert_eq!(uid.trim(), "65534");
    assert!(
        compute_tests::eventually("its working directory is its own", WAIT, || async {
            state_dir
                .join("work")
                .join(&id)
                .join("mine")
                .exists()
                .then_some(true)
        })
        .await
    );
    let mode = |p: PathBuf| {
        std::fs::metadata(&p)
            .expect("metadata")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(state_dir.join("journal.sqlite3")), 0o600);
    assert_eq!(mode(state_dir.join("journal.sqlite3-wal")), 0o600);
    assert_eq!(mode(state_dir.join("logs")), 0o700);
    assert_eq!(
        mode(state_dir.join("logs").join(format!("{id}.log"))),
        0o600
    );
    assert_eq!(mode(state_dir.clone()), 0o711);
    app.ok(&acme, STOP, json!({ "i": { "id": id } })).await;
    step_until(&app, &mut workers, &id, "STOPPED").await;
    stop_agent(agent).await;
}

/// An operator's `drain_workloads` of `node` with `grace` seconds; the command's id.
async fn drain(app: &TestApp, node: &str, grace: u32) -> String {
    app.ok(
        &app.operator(),
        RUN,
        json!({ "i": { "computeNodeId": node, "kind": "DRAIN_WORKLOADS", "idempotencyKey": "drain", "args": { "graceSeconds": grace } } }),
    )
    .await["runCommand"]["command"]["id"]
    .as_str()
    .expect("command")
    .to_owned()
}

/// Steps the workers until command `id` ends; the command.
async fn command_end(app: &TestApp, workers: &mut Workers, id: &str) -> Value {
    let started = tokio::time::Instant::now();
    loop {
        workers.step().await;
        let c = app.ok(&app.operator(), COMMAND, json!({ "id": id })).await["command"].clone();
        if c["state"] == "FAILED" || c["state"] == "SUCCEEDED" {
            return c;
        }
        assert!(started.elapsed() < WAIT, "the command stays {c}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_commands_fail_unsupported_on_a_host_without_the_nvidia_tool() {
    let app = setup().await;
    let p = pool(&app).await;
    let node = p.nodes[0].clone();
    let dir = test_dir("unsupported");
    let agent = start_agent_with(
        &app,
        &node,
        &dir.join("state"),
        None,
        &["--nvidia-smi", "/nonexistent/nvidia-smi"],
    );
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    for (kind, args) in [
        ("RESET_GPU", json!({ "device": "GPU-A0" })),
        (
            "SET_MIG_LAYOUT",
            json!({ "device": "GPU-A0", "layout": ["1g.10gb"] }),
        ),
    ] {
        let cmd = app
            .ok(
                &app.operator(),
                RUN,
                json!({ "i": { "computeNodeId": node, "kind": kind, "idempotencyKey": kind, "args": args } }),
            )
            .await["runCommand"]["command"]["id"]
            .as_str()
            .expect("command")
            .to_owned();
        let done = command_end(&app, &mut workers, &cmd).await;
        assert_eq!(
            done["state"], "FAILED",
            "{kind}: never success for work not done: {done}"
        );
        assert_eq!(done["errorCode"], "UNSUPPORTED", "{kind}: {done}");
        assert!(
            done["errorMessage"]
                .as_str()
                .is_some_and(|m| m.contains("/nonexistent/nvidia-smi")),
            "{done}"
        );
    }
    stop_agent(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_state_directory_stops_the_agent_at_start_naming_the_path() {
    let dir = test_dir("broken");
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a directory").expect("file");
    let corrupt = dir.join("corrupt");
    std::fs::create_dir_all(&corrupt).expect("dir");
    std::fs::write(
        corrupt.join("journal.sqlite3"),
        b"this is not a database at all, not even close to one",
    )
    .expect("garbage");
    for state in [file.join("state"), corrupt.clone()] {
        let out = Command::new(env!("CARGO_BIN_EXE_test-agent"))
            .args([
                "--url",
                "ws://127.0.0.1:9/agent",
                "--node-id",
                "node_x",
                "--token",
                "t",
            ])
            .arg("--state-dir")
            .arg(&state)
            .args(["--listen", "off"])
            .output()
            .await
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&state.display().to_string()),
            "the message names the path: {stderr}"
        );
    }
}

/// The podman flags of hosts like this project's machines (Debian's podman 4.3 with runc and
/// cgroupfs: the default crun refuses hybrid cgroups, and the default ulimits exceed the hard
/// limits); nothing can be pulled here.
const PODMAN_GLOBAL: &str = "--runtime runc --cgroup-manager=cgroupfs";
const PODMAN_RUN: &str =
    "--network none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --pull=never";
const IMAGE: &str = "localhost/compute-test-busybox:1";

fn podman(args: &[&str]) -> std::process::Output {
    std::process::Command::new("podman")
        .args(PODMAN_GLOBAL.split_whitespace())
        .args(args)
        .output()
        .expect("podman is installed (.ci/run installs podman, runc and busybox-static)")
}

/// A local image of Debian's static busybox (`podman import` of a small root file system).
fn busybox_image(dir: &Path) {
    if podman(&["image", "exists", IMAGE]).status.success() {
        return;
    }
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("bin")).expect("rootfs");
    std::fs::copy("/bin/busybox", root.join("bin/busybox"))
        .expect("/bin/busybox (Debian's busybox-static)");
    for tool in ["sh", "sleep", "env", "echo", "cat"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(tool)).expect("link");
    }
    let tar = dir.join("rootfs.tar");
    let ok = std::process::Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .expect("tar");
    assert!(ok.success());
    let out = podman(&["import", &tar.display().to_string(), IMAGE]);
    assert!(
        out.status.success() || podman(&["image", "exists", IMAGE]).status.success(),
        "podman import: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_podman_runtime_runs_a_container_on_exactly_its_allocation() {
    let app = setup().await;
    let acme = app.member("acme");
    let p = pool(&app).await;
    let (node, allocation, atoms) = one_gpu_in(&app, &p.pool, &acme, "r1").await;
    let (_, other, _) = one_gpu_in(&app, &p.pool, &acme, "r2").await;
    let dir = test_dir("podman");
    busybox_image(&dir);
    let state_dir = dir.join("state");
    let agent = start_agent_with(
        &app,
        &node,
        &state_dir,
        None,
        &[
            "--runtime",
            "podman",
            "--podman-global-args",
            PODMAN_GLOBAL,
            "--podman-run-args",
            PODMAN_RUN,
            "--keep-ended-seconds",
            "5",
        ],
    );
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    // A missing image fails the run with a stable code, and nothing is left running.
    let missing = create(
        &app,
        &acme,
        &other,
        "localhost/not-here:1",
        json!(["/bin/sh"]),
        json!([]),
    )
    .await;
    failed_because(&app, &mut workers, &acme, &missing, &["IMAGE_NOT_FOUND"]).await;

    let made = create(
        &app,
        &acme,
        &allocation,
        IMAGE,
        json!(["/bin/sh", "-c", "env; exec sleep 300"]),
        json!([{ "name": "EPOCHS", "value": "3" }]),
    )
    .await;
    step_until(&app, &mut workers, &made, "RUNNING").await;
    let container = run_output(&app, &made).await["containerId"]
        .as_str()
        .expect("a container id")
        .to_owned();
    let labelled = podman(&[
        "ps",
        "--filter",
        &format!("label=compute.instance={made}"),
        "--format",
        "{{.ID}}",
        "--no-trunc",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&labelled.stdout).trim(),
        container,
        "the container carries the instance's label"
    );
    let log = state_dir.join("logs").join(format!("{made}.log"));
    let want = atoms[0].as_str().expect("atom");
    let text = compute_tests::eventually("the container prints its environment", WAIT, || async {
        let t = std::fs::read_to_string(&log).ok()?;
        t.contains("COMPUTE_INSTANCE_ID").then_some(t)
    })
    .await;
    assert!(
        text.contains(&format!("CUDA_VISIBLE_DEVICES={want}")),
        "{text}"
    );
    assert!(
        text.contains(&format!("NVIDIA_VISIBLE_DEVICES={want}")),
        "{text}"
    );
    assert!(text.contains("EPOCHS=3"), "{text}");
    assert!(
        text.contains(&format!("COMPUTE_INSTANCE_ID={made}")),
        "{text}"
    );
    assert!(!text.contains("TOKEN"), "{text}");

    // Stopped: the shell as pid 1 ignores SIGTERM, so podman kills it after the 3 s grace.
    app.ok(&acme, STOP, json!({ "i": { "id": made } })).await;
    step_until(&app, &mut workers, &made, "STOPPED").await;
    let running = podman(&[
        "inspect",
        "--format",
        "{{.State.Running}} {{.State.ExitCode}}",
        &container,
    ]);
    assert_eq!(
        String::from_utf8_lossy(&running.stdout).trim(),
        "false 137",
        "gone, killed after the grace"
    );
    // Kept 5 s for inspection, then removed with its writable layer; its log too.
    compute_tests::eventually("the ended container is removed", WAIT, || async {
        let all = podman(&[
            "ps",
            "--all",
            "--filter",
            &format!("label=compute.instance={made}"),
            "--format",
            "{{.ID}}",
        ]);
        (all.status.success()
            && String::from_utf8_lossy(&all.stdout).trim().is_empty()
            && !log.exists())
        .then_some(())
    })
    .await;
    stop_agent(agent).await;
}

/// A gateway that opens the session and then falls silent (a partition, a host gone without a
/// FIN): the agent's pings go unanswered, and it connects again within its silence limit (three
/// heartbeats, at least 15 s) instead of writing into a dead socket until TCP gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_connects_again_when_its_gateway_falls_silent() {
    use futures_util::{SinkExt, StreamExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("ws://{}/agent", listener.local_addr().expect("addr"));
    let (opened_tx, mut opened) = tokio::sync::mpsc::unbounded_channel::<std::time::Instant>();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            let opened_tx = opened_tx.clone();
            #[expect(clippy::result_large_err, reason = "tungstenite's callback type")]
            let callback = |_: &tokio_tungstenite::tungstenite::handshake::server::Request,
                            mut res: tokio_tungstenite::tungstenite::handshake::server::Response| {
                res.headers_mut().insert(
                    "Sec-WebSocket-Protocol",
                    compute_protocol::PROTOCOL.parse().expect("header"),
                );
                Ok(res)
            };
            let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
                continue;
            };
            // The hello, a welcome with a 1 s heartbeat, then silence: nothing is read again.
            let _hello = ws.next().await;
            let welcome = json!({ "type": "welcome", "sessionEpoch": 1, "gatewayId": "silent",
                                  "heartbeatSeconds": 1.0, "protocol": compute_protocol::PROTOCOL });
            let _ = ws
                .send(tokio_tungstenite::tungstenite::Message::Text(
                    welcome.to_string().into(),
                ))
                .await;
            let _ = opened_tx.send(std::time::Instant::now());
            held.push(ws);
        }
    });
    let dir = test_dir("silent-gateway");
    let _agent = Command::new(env!("CARGO_BIN_EXE_test-agent"))
        .args([
            "--url",
            &url,
            "--node-id",
            "node_00000000000000000000000000000001",
        ])
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--listen", "127.0.0.1:0"])
        .env("COMPUTE_AGENT_TOKEN", "not-checked-here")
        .env_remove("COMPUTE_AGENT_FAULT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("compute-agent starts");
    let first = tokio::time::timeout(WAIT, opened.recv())
        .await
        .expect("the first session")
        .expect("opened");
    let second = tokio::time::timeout(Duration::from_secs(40), opened.recv())
        .await
        .expect("a second session after the silence")
        .expect("opened");
    let after = second - first;
    assert!(
        after >= Duration::from_secs(14) && after < Duration::from_secs(35),
        "connected again after {after:?} of silence (limit 15 s)"
    );
}

/// A drain that finds a workload still starting (here a podman that takes 4 s to create the
/// container, as a pull would) answers only once that workload is stopped: answered at once,
/// it said `stopped` of a container that began to run on the GPUs seconds later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_finds_a_workload_starting_answers_once_it_is_stopped() {
    let app = setup().await;
    let acme = app.member("acme");
    let p = pool(&app).await;
    let (node, allocation, _) = one_gpu_in(&app, &p.pool, &acme, "r1").await;
    let dir = test_dir("slow-start");
    busybox_image(&dir);
    let real = std::process::Command::new("sh")
        .args(["-c", "command -v podman"])
        .output()
        .expect("sh");
    let real = String::from_utf8_lossy(&real.stdout).trim().to_owned();
    assert!(!real.is_empty(), "podman is on the PATH");
    let slow = dir.join("slow-podman");
    std::fs::write(
        &slow,
        format!(
            "#!/bin/sh\nfor a in \"$@\"; do if [ \"$a\" = run ]; then sleep 4; break; fi; done\nexec {real} \"$@\"\n"
        ),
    )
    .expect("wrapper");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let state_dir = dir.join("state");
    let agent = start_agent_with(
        &app,
        &node,
        &state_dir,
        None,
        &[
            "--runtime",
            "podman",
            "--podman",
            &slow.display().to_string(),
            "--podman-global-args",
            PODMAN_GLOBAL,
            "--podman-run-args",
            PODMAN_RUN,
        ],
    );
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let made = create(
        &app,
        &acme,
        &allocation,
        IMAGE,
        json!(["/bin/sh", "-c", "exec sleep 300"]),
        json!([]),
    )
    .await;
    // Until the daemon's journal has the workload starting (podman is still in its sleep).
    let started = tokio::time::Instant::now();
    loop {
        workers.step().await;
        let j = compute_agent::journal::Journal::open(&state_dir).expect("the agent's journal");
        if j.workload(&made)
            .expect("journal")
            .is_some_and(|w| w.state == compute_agent::journal::WorkloadState::Starting)
        {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "the workload never started starting"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cmd = drain(&app, &node, 2).await;
    let done = command_end(&app, &mut workers, &cmd).await;
    assert_eq!(done["state"], "SUCCEEDED", "{done}");
    assert_eq!(done["result"]["stopped"], json!([made]), "{done}");
    // Answered after the start: the container was made, and it no longer runs.
    let label = format!("label=compute.instance={made}");
    let seen = podman(&[
        "ps",
        "--all",
        "--filter",
        &label,
        "--format",
        "{{.ID}} {{.State}}",
    ]);
    let seen = String::from_utf8_lossy(&seen.stdout).trim().to_owned();
    assert!(
        !seen.is_empty(),
        "the drain answered before the container was even made"
    );
    assert!(
        !seen.contains("running"),
        "the drain answered while the container ran: {seen}"
    );
    // Nothing of it runs later either.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let running = podman(&["ps", "--filter", &label, "--format", "{{.ID}}"]);
    assert_eq!(String::from_utf8_lossy(&running.stdout).trim(), "");
    let _ = podman(&[
        "rm",
        "--force",
        seen.split_whitespace().next().unwrap_or_default(),
    ]);
    stop_agent(agent).await;
}

/// An ended workload's working directory, log and journal row are removed once it has been
/// over for `--keep-ended-seconds` (here 2) and the control plane holds its end, with the
/// finished commands whose result was recorded; a live workload's are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_workload_is_cleaned_up_after_its_keep_time_and_a_live_one_is_not() {
    let app = setup().await;
    let acme = app.member("acme");
    let p = pool(&app).await;
    let (node, first, _) = one_gpu_in(&app, &p.pool, &acme, "r1").await;
    let (_, second, _) = one_gpu_in(&app, &p.pool, &acme, "r2").await;
    let dir = test_dir("clean");
    let state_dir = dir.join("state");
    let agent = start_agent_with(
        &app,
        &node,
        &state_dir,
        None,
        &["--keep-ended-seconds", "2"],
    );
    connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let ended = instance(&app, &acme, &first, SLEEPER, &dir.join("out")).await;
    let live = instance(&app, &acme, &second, SLEEPER, &dir.join("out")).await;
    step_until(&app, &mut workers, &ended, "RUNNING").await;
    step_until(&app, &mut workers, &live, "RUNNING").await;
    let work = |id: &str| state_dir.join("work").join(id);
    let log = |id: &str| state_dir.join("logs").join(format!("{id}.log"));
    assert!(work(&ended).is_dir() && log(&ended).is_file());
    app.ok(&acme, STOP, json!({ "i": { "id": ended } })).await;
    step_until(&app, &mut workers, &ended, "STOPPED").await;
    compute_tests::eventually("the ended workload is cleaned up", WAIT, || async {
        let j = compute_agent::journal::Journal::open(&state_dir).expect("journal");
        let gone = !work(&ended).exists()
            && !log(&ended).exists()
            && j.workload(&ended).expect("journal").is_none();
        gone.then_some(())
    })
    .await;
    let j = compute_agent::journal::Journal::open(&state_dir).expect("journal");
    // The run and stop commands of the ended instance were recorded: forgotten too.
    let left: Vec<String> = executions(&state_dir)
        .into_iter()
        .map(|(kind, _)| kind)
        .collect();
    assert_eq!(
        left.iter().filter(|k| *k == "stop_instance").count(),
        0,
        "the recorded stop is forgotten: {left:?}"
    );
    // The live one keeps everything.
    assert!(work(&live).is_dir(), "the live workload's directory stays");
    assert!(log(&live).is_file(), "the live workload's log stays");
    assert_eq!(
        j.workload(&live).expect("journal").map(|w| w.state),
        Some(compute_agent::journal::WorkloadState::Running)
    );
    stop_agent(agent).await;
}

/// A daemon SIGKILLed in the middle of a drain: one workload ended at its SIGTERM, the other
/// ignores it and waits out the grace. Started again, the daemon reports the first one's end
/// (it was recorded as a drained exit, not a stop its instance asked for, so it is among the
/// unreported exits) and the drain, run again, ends the second: both instances hear that
/// their workload ended. (The first was recorded `stopped` and never reported: its instance
/// stayed `RUNNING` with nothing running.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_in_the_middle_of_a_drain_reports_every_drained_workload() {
    let app = setup().await;
    let acme = app.member("acme");
    let p = pool(&app).await;
    let (node, first, _) = one_gpu_in(&app, &p.pool, &acme, "r1").await;
    let (_, second, _) = one_gpu_in(&app, &p.pool, &acme, "r2").await;
    let dir = test_dir("drain-killed");
    let out = dir.join("out");
    let state_dir = dir.join("state");
    let mut agent = start_agent(&app, &node, &state_dir, None);
    let journal = connected(&app, &node).await;
    let mut workers = Workers::new(&app);
    let quick = instance(&app, &acme, &first, SLEEPER, &out).await;
    let stubborn = instance(
        &app,
        &acme,
        &second,
        "trap '' TERM; echo $$ >> \"$OUT/stubborn\"; while :; do sleep 1; done",
        &out,
    )
    .await;
    step_until(&app, &mut workers, &quick, "RUNNING").await;
    step_until(&app, &mut workers, &stubborn, "RUNNING").await;
    let cmd = drain(&app, &node, 6).await;
    // Until the quick one has ended in the journal (the stubborn one waits out its grace).
    let started = tokio::time::Instant::now();
    loop {
        workers.step().await;
        let j = compute_agent::journal::Journal::open(&state_dir).expect("journal");
        if j.workload(&quick)
            .expect("journal")
            .is_some_and(|w| !w.state.is_live())
        {
            break;
        }
        assert!(started.elapsed() < WAIT, "the quick workload never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    agent.start_kill().expect("SIGKILL");
    agent.wait().await.expect("killed");
    let agent = start_agent(&app, &node, &state_dir, None);
    assert_eq!(connected(&app, &node).await, journal, "the same journal");
    let done = command_end(&app, &mut workers, &cmd).await;
    assert_eq!(done["state"], "SUCCEEDED", "{done}");
    step_until(&app, &mut workers, &quick, "EXITED").await;
    step_until(&app, &mut workers, &stubborn, "EXITED").await;
    let i = app.ok(&acme, INSTANCE, json!({ "id": stubborn })).await["instance"].clone();
    assert_eq!(i["exitSignal"], json!(9), "killed after the grace: {i}");
    stop_agent(agent).await;
}
