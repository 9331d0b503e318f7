//! Instances as workflows of commands, end to end: `createInstance` over HTTP, the workflow and
//! the dispatcher stepped under their shard leases, the real gateway and a simulated daemon
//! (`docs/instances.md`); and the daemon's last line of defence against a double booking.

use std::time::Duration;

use compute_sim::{Daemon, Session};
use compute_tests::TestApp;
use compute_workers::queue::{DISPATCH_KINDS, KINDS, QueueWorker};
use serde_json::{Value, json};

use crate::commands::{dispatch_and_serve, pass_time};
use crate::reservations::{CREATE, input, pool};

const WAIT: Duration = Duration::from_secs(20);
pub const CREATE_INSTANCE: &str = "mutation($i: CreateInstanceInput!) { createInstance(input: $i) { idempotentReplay instance { id state envNames allocationId } } }";
const GET: &str = "query($id: ID!) { instance(id: $id) { state reason startedAt stoppedAt } }";

/// The workflow's and the dispatcher's workers, stepped.
pub struct Workers {
    reconcile: QueueWorker,
    dispatch: QueueWorker,
}

impl Workers {
    pub fn new(app: &TestApp) -> Workers {
        Workers {
            reconcile: QueueWorker::new(app.db.db.clone(), "worker-a", &KINDS),
            dispatch: QueueWorker::new(app.db.db.clone(), "dispatcher-a", &DISPATCH_KINDS)
                .in_family("dispatch"),
        }
    }

    pub async fn step(&mut self) {
        for w in [&mut self.reconcile, &mut self.dispatch] {
            w.rebalance().await.expect("shards");
            w.step().await.expect("step");
        }
    }
}

pub async fn state(app: &TestApp, token: &str, id: &str) -> Value {
    app.ok(token, GET, json!({ "id": id })).await["instance"].clone()
}

/// Steps the workers until the instance is in `want`.
pub async fn step_until(app: &TestApp, workers: &mut Workers, id: &str, want: &str) {
    let started = tokio::time::Instant::now();
    loop {
        workers.step().await;
        let s = state(app, &app.operator(), id).await;
        if s["state"] == want {
            return;
        }
        assert!(
            started.elapsed() < WAIT,
            "the instance stays {s} (want {want})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn workflow_commands(app: &TestApp, id: &str) -> Vec<(String, String, i32)> {
    sqlx::query_as("SELECT idempotency_key, state, attempts FROM commands WHERE workflow_id = $1 ORDER BY idempotency_key")
        .bind(id)
        .fetch_all(app.db.db.pool())
        .await
        .expect("commands")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_runs_on_its_allocation_and_stops_with_its_reservation() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let p = pool(&app).await;
    let acme = app.member("acme");
    let r = app
        .ok(
            &acme,
            CREATE,
            input(
                &p.pool,
                "r1",
                json!([{ "gpuCount": 1, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]),
            ),
        )
        .await["createReservation"]["reservation"]
        .clone();
    assert_eq!(r["state"], "ACTIVE");
    let allocation = r["allocations"][0]["id"]
        .as_str()
        .expect("allocation")
        .to_owned();
    let node = r["allocations"][0]["computeNodeId"]
        .as_str()
        .expect("node")
        .to_owned();
    let atoms = r["allocations"][0]["atoms"].clone();

    // The node's daemon, answering from its journal.
    let journal = compute_sim::journal("j1");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let daemon = tokio::spawn(compute_sim::run_daemon(
        crate::commands::daemon_config(&app, &node, "j1", 1),
        compute_sim::Behaviour {
            journal: Some(journal.clone()),
            ..compute_sim::Behaviour::default()
        },
        stopped,
        |_, _| {},
    ));
    let mut workers = Workers::new(&app);

    let create = |key: &str| {
        json!({ "i": { "allocationId": allocation, "image": "registry.example/train:1", "command": ["python", "train.py"],
                       "env": [{ "name": "EPOCHS", "value": "3" }], "idempotencyKey": key } })
    };
    let made = app.ok(&acme, CREATE_INSTANCE, create("i1")).await["createInstance"].clone();
    assert_eq!(made["instance"]["state"], "PROVISIONING");
    assert_eq!(made["instance"]["envNames"], json!(["EPOCHS"]));
    let id = made["instance"]["id"].as_str().expect("id").to_owned();
    let again = app.ok(&acme, CREATE_INSTANCE, create("i1")).await["createInstance"].clone();
    assert_eq!(
        (
            again["instance"]["id"].as_str(),
            again["idempotentReplay"].as_bool()
        ),
        (Some(id.as_str()), Some(true))
    );
    let (code, _) = app.fails(&acme, CREATE_INSTANCE, create("i2")).await;
    assert_eq!(code, "CONFLICT", "one live instance per allocation");
    let globex = app.member("globex");
    let (code, _) = app.fails(&globex, CREATE_INSTANCE, create("g1")).await;
    assert_eq!(code, "NOT_FOUND", "another tenant's allocation");
    let (code, _) = app.fails(&globex, GET, json!({ "id": id })).await;
    assert_eq!(code, "NOT_FOUND", "another tenant's instance");
    let (code, _) = app
        .fails(
            &acme,
            CREATE_INSTANCE,
            json!({ "i": { "allocationId": allocation, "image": "", "idempotencyKey": "bad" } }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT");
    // An image is the argument after podman's options: one that reads as an option would run
    // the tenant's command privileged, and a transport would read the host's files.
    for image in [
        "--privileged",
        "--volume=/:/host",
        "dir:/etc",
        "docker-archive:/root/x.tar",
    ] {
        let (code, message) = app
            .fails(
                &acme,
                CREATE_INSTANCE,
                json!({ "i": { "allocationId": allocation, "image": image, "command": ["busybox", "sh"],
                               "idempotencyKey": format!("bad {image}") } }),
            )
            .await;
        assert_eq!(code, "BAD_USER_INPUT", "{image}");
        assert!(
            message["message"]
                .as_str()
                .is_some_and(|m| m.contains("image reference")),
            "{image}: {message}"
        );
    }
    assert_eq!(
        app.count("instances").await,
        1,
        "refused requests wrote nothing"
    );

    // The step that makes the run command runs three times, two at once (a worker that died
    // after its commit, and a second holder): one command.
    let iid = compute_domain::ids::InstanceId::parse("id", &id).expect("instance id");
    let db = &app.db.db;
    let (a, b) = tokio::join!(
        compute_domain::instances::reconcile(db, &iid),
        compute_domain::instances::reconcile(db, &iid)
    );
    a.expect("step");
    b.expect("step");
    compute_domain::instances::reconcile(db, &iid)
        .await
        .expect("step");
    let steps = workflow_commands(&app, &id).await;
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(steps[0].0, format!("wf:{id}:run"));

    step_until(&app, &mut workers, &id, "RUNNING").await;
    let run: Value = sqlx::query_scalar("SELECT args FROM commands WHERE idempotency_key = $1")
        .bind(format!("wf:{id}:run"))
        .fetch_one(db.pool())
        .await
        .expect("args");
    assert_eq!(run["devices"], atoms, "the allocation's atoms");
    assert_eq!(run["image"], "registry.example/train:1");
    // The environment's values go to the daemon, and to no one else: an operator reading the
    // command sees the names, and the command's events carry no value.
    assert_eq!(run["env"], json!({ "EPOCHS": "3" }), "what the daemon gets");
    let (run_id,): (String,) = sqlx::query_as("SELECT id FROM commands WHERE idempotency_key = $1")
        .bind(format!("wf:{id}:run"))
        .fetch_one(db.pool())
        .await
        .expect("the run command");
    let shown = app
        .ok(
            &app.operator(),
            "query($id: ID!) { command(id: $id) { args } }",
            json!({ "id": run_id }),
        )
        .await;
    assert_eq!(
        shown["command"]["args"]["env"],
        json!({ "EPOCHS": null }),
        "{shown}"
    );
    assert_eq!(
        shown["command"]["args"]["image"],
        "registry.example/train:1"
    );
    let (with_env, with_value): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE data->'command'->'args' ? 'env'),                 count(*) FILTER (WHERE data->'command'->'args'->'env'->>'EPOCHS' IS NOT NULL)            FROM outbox WHERE subject = $1",
    )
    .bind(&run_id)
    .fetch_one(db.pool())
    .await
    .expect("the command's events");
    assert!(with_env >= 1, "the events name the variables");
    assert_eq!(with_value, 0, "no event carries a value");

    // The reservation ends (02:00): the workflow stops the workload.
    pass_time(&app, 2 * 3600).await;
    let mut reconciler = compute_workers::Reconciler::new(db.clone(), "worker-resync");
    reconciler.pass().await.expect("the reservation expires");
    step_until(&app, &mut workers, &id, "STOPPED").await;
    let s = state(&app, &acme, &id).await;
    assert!(
        s["reason"]
            .as_str()
            .expect("reason")
            .contains("reservation ended"),
        "{s}"
    );
    assert!(s["startedAt"].is_string() && s["stoppedAt"].is_string());
    let steps = workflow_commands(&app, &id).await;
    assert_eq!(
        steps,
        [
            (format!("wf:{id}:run"), "succeeded".to_owned(), 1),
            (format!("wf:{id}:stop"), "succeeded".to_owned(), 1)
        ]
    );
    {
        let j = journal.lock().expect("journal");
        let runs: Vec<(String, u32)> = j
            .entries
            .values()
            .map(|e| (e.kind.clone(), e.executions))
            .collect();
        assert_eq!(
            runs.iter()
                .filter(|(k, n)| k == "run_instance" && *n == 1)
                .count(),
            1,
            "{runs:?}"
        );
        assert_eq!(
            runs.iter()
                .filter(|(k, n)| k == "stop_instance" && *n == 1)
                .count(),
            1,
            "{runs:?}"
        );
        assert!(runs.iter().all(|(_, n)| *n == 1), "each ran once: {runs:?}");
        assert!(j.devices.is_empty(), "the daemon released the devices");
    }
    let events: Vec<String> =
        sqlx::query_scalar("SELECT type FROM outbox WHERE subject = $1 ORDER BY txid, seq")
            .bind(&id)
            .fetch_all(db.pool())
            .await
            .expect("events");
    assert_eq!(
        events,
        [
            "instance.provisioning",
            "instance.running",
            "instance.stopping",
            "instance.stopped"
        ]
    );
    let _ = stop.send(true);
    let _ = daemon.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_refuses_an_overlapping_device_assignment() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let nodes = crate::commands::seed_nodes(&app, 1).await;
    let node = &nodes[0];
    let journal = compute_sim::journal("j1");
    let mut d = Daemon::new(journal.clone(), 1);
    let mut session = Session::open(&crate::commands::daemon_config(&app, node, "j1", 1))
        .await
        .expect("open");
    let mut dispatcher =
        QueueWorker::new(app.db.db.clone(), "dispatcher-a", &DISPATCH_KINDS).in_family("dispatch");
    // An operator (or a bug) assigns the same GPU to two workloads.
    let outcome = |instance: &'static str| {
        let app = &app;
        let node = node.clone();
        async move {
            let run = "mutation($i: RunCommandInput!) { runCommand(input: $i) { command { id } } }";
            let c = app
                .ok(&app.operator(), run, json!({ "i": { "computeNodeId": node, "kind": "RUN_INSTANCE", "idempotencyKey": instance,
                    "args": { "instanceId": instance, "devices": ["GPU-0"] } } }))
                .await;
            c["runCommand"]["command"]["id"]
                .as_str()
                .expect("id")
                .to_owned()
        }
    };
    let first = outcome("a").await;
    dispatch_and_serve(&mut dispatcher, &mut session, &mut d, &first).await;
    let second = outcome("b").await;
    dispatch_and_serve(&mut dispatcher, &mut session, &mut d, &second).await;
    let get = "query($id: ID!) { command(id: $id) { state errorCode } }";
    let a = app.ok(&app.operator(), get, json!({ "id": first })).await;
    let b = app.ok(&app.operator(), get, json!({ "id": second })).await;
    assert_eq!(a["command"]["state"], "SUCCEEDED");
    assert_eq!(
        (
            b["command"]["state"].as_str(),
            b["command"]["errorCode"].as_str()
        ),
        (Some("FAILED"), Some("DEVICE_OVERLAP")),
        "the daemon refused to share GPU-0"
    );
    // Without the defence, the daemon would have shared it.
    d.refuse_overlaps = false;
    let third = outcome("c").await;
    dispatch_and_serve(&mut dispatcher, &mut session, &mut d, &third).await;
    let c = app.ok(&app.operator(), get, json!({ "id": third })).await;
    assert_eq!(c["command"]["state"], "SUCCEEDED");
    assert_eq!(
        journal
            .lock()
            .expect("journal")
            .devices
            .get("GPU-0")
            .map(String::as_str),
        Some("c")
    );
    session.bye().await;
}

/// Back-to-back tenants on the same GPUs: the next tenant's run is not sent while the previous
/// tenant's instance still holds them (its stop not yet done), so the daemon never sees the two
/// overlap and refuses (`DEVICE_OVERLAP` would fail the next tenant's reservation). The previous
/// instance's end wakes the waiting one, which then runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_tenants_instance_waits_for_the_previous_one_to_leave_its_gpus() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let p = pool(&app).await;
    crate::reservations::quota_for(&app, "globex", &p.pool).await;
    // Both GPUs of h100-a, for one tenant and then the other.
    let both = |token: String, key: &'static str| {
        let (app, pool) = (&app, p.pool.clone());
        async move {
            let r = app
                .ok(
                    &token,
                    CREATE,
                    input(
                        &pool,
                        key,
                        json!([{ "gpuCount": 2, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]),
                    ),
                )
                .await["createReservation"]["reservation"]
                .clone();
            assert_eq!(r["state"], "ACTIVE", "{r}");
            r
        }
    };
    let (acme, globex) = (app.member("acme"), app.member("globex"));
    let first = both(acme.clone(), "first").await;
    let node = first["allocations"][0]["computeNodeId"]
        .as_str()
        .expect("node")
        .to_owned();
    let journal = compute_sim::journal("j1");
    let (stop, daemon) = spawn_daemon(&app, &node, "j1", &journal);
    let mut workers = Workers::new(&app);
    let ia = train(&app, &acme, &first["allocations"][0]["id"], "ia").await;
    step_until(&app, &mut workers, &ia, "RUNNING").await;
    // Acme releases; globex books the same two GPUs at once and starts its instance. Its
    // workflow runs before acme's has sent the stop.
    app.ok(
        &acme,
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": first["id"] } }),
    )
    .await;
    let second = both(globex.clone(), "second").await;
    assert_eq!(
        second["allocations"][0]["atoms"],
        first["allocations"][0]["atoms"]
    );
    let ib = train(&app, &globex, &second["allocations"][0]["id"], "ib").await;
    let ib_id = compute_domain::ids::InstanceId::parse("id", &ib).expect("id");
    compute_domain::instances::reconcile(&app.db.db, &ib_id)
        .await
        .expect("a step of globex's instance");
    assert_eq!(
        workflow_commands(&app, &ib).await,
        vec![],
        "no run while acme's instance holds the GPUs"
    );
    assert_eq!(state(&app, &globex, &ib).await["state"], "PROVISIONING");
    // Acme's workflow sends its stop. A workflow's step is the workflow's: an operator cannot
    // cancel it (a cancelled stop left the workload running).
    let ia_id = compute_domain::ids::InstanceId::parse("id", &ia).expect("id");
    compute_domain::instances::reconcile(&app.db.db, &ia_id)
        .await
        .expect("a step of acme's instance");
    let (stop_step,): (String,) = sqlx::query_as(
        "SELECT id FROM commands WHERE workflow_id = $1 AND idempotency_key LIKE '%:stop'",
    )
    .bind(&ia)
    .fetch_one(app.db.db.pool())
    .await
    .expect("the stop step");
    let (code, error) = app
        .fails(
            &app.operator(),
            "mutation($i: CancelCommandInput!) { cancelCommand(input: $i) { command { state } } }",
            json!({ "i": { "id": stop_step } }),
        )
        .await;
    assert_eq!(code, "CONFLICT", "{error}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("stopInstance")),
        "{error}"
    );
    // Acme's instance stops, which wakes globex's: it runs, and its reservation stays active.
    step_until(&app, &mut workers, &ib, "RUNNING").await;
    assert_eq!(state(&app, &acme, &ia).await["state"], "STOPPED");
    let r = app
        .ok(
            &globex,
            "query($id: ID!) { reservation(id: $id) { state } }",
            json!({ "id": second["id"] }),
        )
        .await;
    assert_eq!(r["reservation"]["state"], "ACTIVE");
    let _ = stop.send(true);
    let _ = daemon.await;
}

/// Only an earlier holder holds a run back: the next tenant's instance, made early for a
/// reservation that starts later on the same GPUs, waits for its own start and does not keep
/// the current tenant's workload from running.
#[tokio::test]
async fn an_instance_made_early_for_a_later_reservation_does_not_hold_back_the_current_one() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    crate::reservations::quota_for(&app, "globex", &p.pool).await;
    let both = json!([{ "gpuCount": 2, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]);
    let (acme, globex) = (app.member("acme"), app.member("globex"));
    let now = app
        .ok(&acme, CREATE, input(&p.pool, "now", both.clone()))
        .await["createReservation"]["reservation"]
        .clone();
    let later = app
        .ok(
            &globex,
            CREATE,
            json!({ "i": { "poolId": p.pool, "startsAt": "2031-01-01T02:00:00Z", "endsAt": "2031-01-01T03:00:00Z",
                           "allocations": both, "idempotencyKey": "later" } }),
        )
        .await["createReservation"]["reservation"]
        .clone();
    assert_eq!(later["state"], "SCHEDULED");
    assert_eq!(
        later["allocations"][0]["atoms"],
        now["allocations"][0]["atoms"]
    );
    let make = |token: String, allocation: Value, key: &'static str| {
        let app = &app;
        async move {
            let id = train(app, &token, &allocation, key).await;
            let parsed = compute_domain::ids::InstanceId::parse("id", &id).expect("id");
            compute_domain::instances::reconcile(&app.db.db, &parsed)
                .await
                .expect("a step");
            id
        }
    };
    // Globex's first: it waits for its start at 02:00, sending nothing.
    let early = make(
        globex.clone(),
        later["allocations"][0]["id"].clone(),
        "early",
    )
    .await;
    assert_eq!(workflow_commands(&app, &early).await, vec![]);
    // Acme's, on the same GPUs now: its run is sent.
    let current = make(acme.clone(), now["allocations"][0]["id"].clone(), "current").await;
    let steps = workflow_commands(&app, &current).await;
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert!(steps[0].0.ends_with(":run"), "{steps:?}");
}

/// Creates an instance running `train` on `allocation` as `token` (idempotency key `key`); its
/// id.
async fn train(app: &TestApp, token: &str, allocation: &Value, key: &str) -> String {
    app.ok(
        token,
        CREATE_INSTANCE,
        json!({ "i": { "allocationId": allocation, "image": "registry.example/train:1",
                       "command": ["train"], "idempotencyKey": key } }),
    )
    .await["createInstance"]["instance"]["id"]
        .as_str()
        .expect("id")
        .to_owned()
}

/// A reservation of one GPU of h100-a for `acme` (key `key`), active at once: its allocation and
/// node.
async fn reserve_on_h100_a(app: &TestApp, pool: &str, key: &str) -> (String, String) {
    let r = app
        .ok(
            &app.member("acme"),
            CREATE,
            input(
                pool,
                key,
                json!([{ "gpuCount": 1, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]),
            ),
        )
        .await["createReservation"]["reservation"]
        .clone();
    let id = |field: &str| {
        r["allocations"][0][field]
            .as_str()
            .expect("the allocation")
            .to_owned()
    };
    (id("id"), id("computeNodeId"))
}

/// A simulated daemon of `node` answering from `journal` (`journal_id`), until the returned
/// sender says stop.
fn spawn_daemon(
    app: &TestApp,
    node: &str,
    journal_id: &str,
    journal: &compute_sim::SharedJournal,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let handle = tokio::spawn(compute_sim::run_daemon(
        crate::commands::daemon_config(app, node, journal_id, 1),
        compute_sim::Behaviour {
            journal: Some(journal.clone()),
            ..compute_sim::Behaviour::default()
        },
        stopped,
        |_, _| {},
    ));
    (stop, handle)
}

/// Level-triggered for every kind of work: with every work-queue row lost (deleted by hand), an
/// instance's workflow and a command's dispatch stall, whatever the workers do; the
/// reconciler's resync finds both again, and both finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resync_finds_a_command_and_an_instance_whose_queue_rows_were_lost() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let p = pool(&app).await;
    let acme = app.member("acme");
    let (allocation, node) = reserve_on_h100_a(&app, &p.pool, "r-resync").await;
    let (_stop, _daemon) = spawn_daemon(&app, &node, "j1", &compute_sim::journal("j1"));
    let mut workers = Workers::new(&app);
    let made = app
        .ok(
            &acme,
            CREATE_INSTANCE,
            json!({ "i": { "allocationId": allocation, "image": "registry.example/train:1",
                           "command": ["true"], "idempotencyKey": "i-resync" } }),
        )
        .await["createInstance"]["instance"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let command = app
        .ok(
            &app.operator(),
            crate::commands::RUN,
            json!({ "i": { "computeNodeId": node, "kind": "NOOP", "idempotencyKey": "c-resync" } }),
        )
        .await["runCommand"]["command"]["id"]
        .as_str()
        .expect("command")
        .to_owned();
    let lost = sqlx::query("DELETE FROM work_queue")
        .execute(app.db.db.pool())
        .await
        .expect("lose the queue rows")
        .rows_affected();
    assert!(
        lost >= 2,
        "the instance's and the node's rows were there: {lost}"
    );
    let command_state = || async {
        app.ok(
            &app.operator(),
            "query($id: ID!) { command(id: $id) { state } }",
            json!({ "id": command }),
        )
        .await["command"]["state"]
            .as_str()
            .expect("state")
            .to_owned()
    };
    for _ in 0..5 {
        workers.step().await;
    }
    assert_eq!(
        state(&app, &acme, &made).await["state"],
        "PROVISIONING",
        "stalled"
    );
    assert_eq!(command_state().await, "PENDING", "stalled");
    assert!(
        workflow_commands(&app, &made).await.is_empty(),
        "no step of the workflow ran"
    );

    let mut reconciler = compute_workers::Reconciler::new(app.db.db.clone(), "reconciler-resync");
    let pass = reconciler.pass().await.expect("a pass");
    assert!(pass.held);
    let queued: Vec<(String, String)> =
        sqlx::query_as("SELECT kind, key FROM work_queue WHERE kind IN ('node_commands', 'instance') ORDER BY kind")
            .fetch_all(app.db.db.pool())
            .await
            .expect("queue");
    assert_eq!(
        queued,
        vec![
            ("instance".to_owned(), made.clone()),
            ("node_commands".to_owned(), node.clone())
        ],
        "the resync enqueued exactly the unsettled instance and the node with a waiting command"
    );
    step_until(&app, &mut workers, &made, "RUNNING").await;
    let started = tokio::time::Instant::now();
    while command_state().await != "SUCCEEDED" {
        assert!(
            started.elapsed() < WAIT,
            "the command stays {}",
            command_state().await
        );
        workers.step().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A running instance whose reservation is still active has nothing to do: the next resync
    // leaves it alone.
    let mut again = compute_workers::Reconciler::new(app.db.db.clone(), "reconciler-again");
    sqlx::query("DELETE FROM work_queue")
        .execute(app.db.db.pool())
        .await
        .expect("clear");
    again.pass().await.expect("a pass");
    let queued: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM work_queue WHERE kind IN ('node_commands', 'instance')",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("queue");
    assert_eq!(queued, 0, "nothing unsettled to enqueue");
}

/// An instance across a disconnect: its node's daemon goes away, the node becomes
/// `DISCONNECTED` then `UNREACHABLE`, and the daemon comes back with its journal. The instance
/// stays `RUNNING` throughout, no command stops or starts it again (its workflow has only its
/// run command), and its allocation is billed for every second of the windows the outage spans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_instance_survives_its_node_going_unreachable_and_back() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let db = &app.db.db;
    compute_domain::usage::set_window(db, 60)
        .await
        .expect("one-minute windows");
    let p = pool(&app).await;
    let acme = app.member("acme");
    let (allocation, node) = reserve_on_h100_a(&app, &p.pool, "r-outage").await;
    let journal = compute_sim::journal("j-outage");
    let start_daemon = || spawn_daemon(&app, &node, "j-outage", &journal);
    let (stop, daemon) = start_daemon();
    let mut workers = Workers::new(&app);
    let id = app
        .ok(
            &acme,
            CREATE_INSTANCE,
            json!({ "i": { "allocationId": allocation, "image": "registry.example/train:1",
                           "command": ["train"], "idempotencyKey": "i-outage" } }),
        )
        .await["createInstance"]["instance"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    step_until(&app, &mut workers, &id, "RUNNING").await;
    let started = state(&app, &acme, &id).await["startedAt"].clone();
    let reachability = || async {
        sqlx::query_scalar::<_, String>("SELECT reachability FROM nodes WHERE id = $1")
            .bind(&node)
            .fetch_one(db.pool())
            .await
            .expect("node")
    };

    // The daemon goes away; the liveness reconciler runs as time passes.
    stop.send(true).expect("stop the daemon");
    let _ = daemon.await;
    compute_tests::eventually("the session closes", Duration::from_secs(10), || async {
        (reachability().await == "disconnected").then_some(())
    })
    .await;
    let mut reconciler = compute_workers::Reconciler::new(db.clone(), "reconciler-outage");
    let mut meter = compute_workers::usage::UsageMeter::new(db.clone(), "meter-outage");
    for _ in 0..6 {
        crate::commands::pass_time(&app, 10).await;
        reconciler.pass().await.expect("pass");
        meter.pass().await.expect("meter pass");
        workers.step().await;
    }
    assert_eq!(reachability().await, "unreachable");
    assert_eq!(
        state(&app, &acme, &id).await["state"],
        "RUNNING",
        "unreachable: still running"
    );

    // It comes back with its journal.
    let (_stop, _daemon) = start_daemon();
    compute_tests::eventually("the node reconnects", Duration::from_secs(10), || async {
        (reachability().await == "connected").then_some(())
    })
    .await;
    for _ in 0..8 {
        crate::commands::pass_time(&app, 10).await;
        reconciler.pass().await.expect("pass");
        meter.pass().await.expect("meter pass");
        workers.step().await;
    }
    let s = state(&app, &acme, &id).await;
    assert_eq!(s["state"], "RUNNING");
    assert_eq!(s["startedAt"], started, "not started again");
    let steps: Vec<String> = workflow_commands(&app, &id)
        .await
        .into_iter()
        .map(|(key, state, _)| format!("{key} {state}"))
        .collect();
    assert_eq!(
        steps,
        vec![format!("wf:{id}:run succeeded")],
        "nothing stopped or ran it again"
    );

    // Billing went on through the outage: every closed one-minute window of the allocation
    // (the reservation started at a window's start) is billed in full.
    for _ in 0..3 {
        crate::commands::pass_time(&app, 60).await;
        meter.pass().await.expect("meter pass");
    }
    let rest = compute_domain::usage::settle(db, Duration::from_millis(20), WAIT)
        .await
        .expect("settle the meter");
    assert!(!rest.more, "the meter settled");
    let windows: Vec<(f64,)> = sqlx::query_as(
        "SELECT booked_seconds::float8 FROM usage_records \
          WHERE allocation_id = $1 AND kind = 'window' ORDER BY window_start",
    )
    .bind(&allocation)
    .fetch_all(db.pool())
    .await
    .expect("usage");
    assert!(
        windows.len() >= 3,
        "windows closed across the outage: {windows:?}"
    );
    for (seconds,) in &windows {
        assert_eq!(*seconds, 60.0, "{windows:?}");
    }
}

/// A daemon that refuses an instance's devices (`DEVICE_OVERLAP`: a workload it runs holds one)
/// fails the instance and then, at the reconciler's next pass, the reservation: quota and vCPU
/// come back and a `reservation.failed` event carries the `DeviceOverlap` condition, but the
/// atom stays booked (`overlap_hold`, no allocation, so never billed) until the end of the
/// reservation's window, and is bookable again only then.
/// A reservation of one GPU of h100-a whose instance the daemon refused (`DEVICE_OVERLAP`): a
/// stray workload an operator ran by hand holds its GPU. The instance is `FAILED`; the
/// reconciler has not run.
struct Refused {
    rsv: String,
    atom: String,
    node: String,
    one_on_a: Value,
    _daemon: tokio::task::JoinHandle<()>,
    _stop: tokio::sync::watch::Sender<bool>,
}

async fn refused_overlap(app: &TestApp, p: &crate::reservations::Pool, acme: &str) -> Refused {
    let one_on_a =
        json!([{ "gpuCount": 1, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]);
    let r = app
        .ok(acme, CREATE, input(&p.pool, "r1", one_on_a.clone()))
        .await["createReservation"]["reservation"]
        .clone();
    assert_eq!(r["state"], "ACTIVE");
    let rsv = r["id"].as_str().expect("id").to_owned();
    let allocation = r["allocations"][0]["id"]
        .as_str()
        .expect("allocation")
        .to_owned();
    let node = r["allocations"][0]["computeNodeId"]
        .as_str()
        .expect("node")
        .to_owned();
    let atom = r["allocations"][0]["atoms"][0]
        .as_str()
        .expect("atom")
        .to_owned();

    let journal = compute_sim::journal("j1");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let daemon = tokio::spawn(compute_sim::run_daemon(
        crate::commands::daemon_config(app, &node, "j1", 1),
        compute_sim::Behaviour {
            journal: Some(journal.clone()),
            ..compute_sim::Behaviour::default()
        },
        stopped,
        |_, _| {},
    ));
    let mut workers = Workers::new(app);
    // A workload the reservation does not know already runs on its GPU (an operator's, or a
    // leak): the daemon holds the atom for it. Its name is long, and the daemon's refusal names
    // it: the command keeps 2,000 characters of the message, and the instance's reason (step,
    // state and code before it) must still fit its own 2,000 (it failed at every retry).
    let stray_name = format!("stray-{}", "x".repeat(2100));
    let run = "mutation($i: RunCommandInput!) { runCommand(input: $i) { command { id } } }";
    let stray = app
        .ok(
            &app.operator(),
            run,
            json!({ "i": { "computeNodeId": node, "kind": "RUN_INSTANCE", "idempotencyKey": "stray",
            "args": { "instanceId": stray_name, "devices": [atom] } } }),
        )
        .await["runCommand"]["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let started = tokio::time::Instant::now();
    loop {
        workers.step().await;
        let c = app
            .ok(
                &app.operator(),
                "query($id: ID!) { command(id: $id) { state } }",
                json!({ "id": stray }),
            )
            .await;
        if c["command"]["state"] == "SUCCEEDED" {
            break;
        }
        assert!(started.elapsed() < WAIT, "the stray workload runs: {c}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let made = app
        .ok(acme, CREATE_INSTANCE, json!({ "i": { "allocationId": allocation, "image": "registry.example/train:1", "idempotencyKey": "i1" } }))
        .await["createInstance"]["instance"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    step_until(app, &mut workers, &made, "FAILED").await;
    let s = state(app, acme, &made).await;
    let reason = s["reason"].as_str().expect("reason");
    assert!(
        reason.contains(&format!(
            "DEVICE_OVERLAP {atom} is held by workload stray-xxx"
        )) && reason.ends_with("xx…")
            && reason.chars().count() == 2000,
        "the reason, cut to 2,000 characters: {s}"
    );
    Refused {
        rsv,
        atom,
        node,
        one_on_a,
        _daemon: daemon,
        _stop: stop,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_overlap_fails_the_reservation_and_holds_its_devices_until_its_end() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let p = pool(&app).await;
    let acme = app.member("acme");
    let Refused {
        rsv,
        atom,
        node,
        one_on_a,
        _daemon,
        _stop,
    } = refused_overlap(&app, &p, &acme).await;
    let db = &app.db.db;

    let mut reconciler = compute_workers::Reconciler::new(db.clone(), "worker-overlap");
    let pass = reconciler.pass().await.expect("pass");
    assert_eq!(pass.failed, 1, "{pass:?}");
    let got = app
        .ok(
            &acme,
            "query($id: ID!) { reservation(id: $id) { state conditions { type status reason message } } }",
            json!({ "id": rsv }),
        )
        .await;
    assert_eq!(got["reservation"]["state"], "FAILED", "{got}");
    let condition = &got["reservation"]["conditions"][0];
    assert_eq!(
        (condition["type"].as_str(), condition["reason"].as_str()),
        (Some("DeviceOverlap"), Some("DaemonRefused")),
        "{got}"
    );
    let message = condition["message"].as_str().expect("message");
    assert!(
        message.contains(&atom) && message.contains("2031-01-01T02:00:00"),
        "names the atom held and until when: {message}"
    );
    // Quota and vCPU came back; the atom did not.
    let (quota, vcpu): (f64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(used), 0)::float8 FROM quota_usage WHERE tenant_id = 'acme'), \
                (SELECT coalesce(sum(allocated), 0)::bigint FROM node_resources WHERE resource = 'vcpu')",
    )
    .fetch_one(db.pool())
    .await
    .expect("counters");
    assert_eq!((quota, vcpu), (0.0, 0));
    let held: Vec<(String, bool, String)> = sqlx::query_as(
        "SELECT reason, allocation_id IS NULL, to_char(upper(during) AT TIME ZONE 'UTC', 'HH24:MI') \
           FROM device_bookings WHERE atom = $1 AND upper(during) > compute_now()",
    )
    .bind(&atom)
    .fetch_all(db.pool())
    .await
    .expect("bookings");
    assert_eq!(
        held,
        [("overlap_hold".to_owned(), true, "02:00".to_owned())]
    );
    let failed: Vec<Value> = sqlx::query_scalar(
        "SELECT data FROM outbox WHERE subject = $1 AND type = 'reservation.failed'",
    )
    .bind(&rsv)
    .fetch_all(db.pool())
    .await
    .expect("events");
    assert_eq!(failed.len(), 1, "one event says so: {failed:?}");
    assert!(
        failed[0].to_string().contains("DeviceOverlap"),
        "{}",
        failed[0]
    );
    // Placement does not hand the held GPU out: every GPU of h100-a but the held one can be
    // reserved, and then h100-a has none left.
    let gpus: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM devices WHERE node_id = $1 AND retired_at IS NULL",
    )
    .bind(&node)
    .fetch_one(db.pool())
    .await
    .expect("gpus");
    for k in 1..gpus {
        let d = app
            .ok(
                &acme,
                CREATE,
                input(&p.pool, &format!("after-{k}"), one_on_a.clone()),
            )
            .await;
        let placed = &d["createReservation"]["reservation"];
        assert_eq!(placed["state"], "ACTIVE", "{d}");
        assert_ne!(
            placed["allocations"][0]["atoms"][0].as_str(),
            Some(atom.as_str())
        );
    }
    let d = app
        .ok(
            &acme,
            CREATE,
            input(&p.pool, "after-last", one_on_a.clone()),
        )
        .await;
    assert_eq!(
        d["createReservation"]["reservation"]["state"], "PENDING",
        "{d}"
    );
    // A second pass changes nothing more.
    assert_eq!(reconciler.pass().await.expect("pass").failed, 0);
    let _ = _stop.send(true);
    let _ = _daemon.await;
}

/// A reservation whose instance a daemon refused (`DEVICE_OVERLAP`), released by its tenant
/// before the reconciler's pass fails it: its GPU is still held (`overlap_hold`) to the end of
/// the window it was booked for, so placement does not hand it to the next tenant, whose
/// instance would meet the same stray workload. (Released, its bookings ended and nothing held
/// the GPU: the pass skips released reservations.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_overlap_released_before_the_pass_still_holds_its_devices() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let p = pool(&app).await;
    let acme = app.member("acme");
    let refused = refused_overlap(&app, &p, &acme).await;
    let released = app
        .ok(
            &acme,
            "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
            json!({ "i": { "id": refused.rsv } }),
        )
        .await;
    assert_eq!(
        released["releaseReservation"]["reservation"]["state"],
        "RELEASED"
    );
    let db = &app.db.db;
    let held: Vec<(String, bool, String)> = sqlx::query_as(
        "SELECT reason, allocation_id IS NULL, to_char(upper(during) AT TIME ZONE 'UTC', 'HH24:MI') \
           FROM device_bookings WHERE atom = $1 AND upper(during) > compute_now()",
    )
    .bind(&refused.atom)
    .fetch_all(db.pool())
    .await
    .expect("bookings");
    assert_eq!(
        held,
        [("overlap_hold".to_owned(), true, "02:00".to_owned())]
    );
    let mut reconciler = compute_workers::Reconciler::new(db.clone(), "worker-overlap");
    let pass = reconciler.pass().await.expect("pass");
    assert_eq!(pass.failed, 0, "released, not failed: {pass:?}");
    // Placement gives out every other GPU of h100-a, never the held one.
    let gpus: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM devices WHERE node_id = $1 AND retired_at IS NULL",
    )
    .bind(&refused.node)
    .fetch_one(db.pool())
    .await
    .expect("gpus");
    for k in 0..gpus {
        let d = app
            .ok(
                &acme,
                CREATE,
                input(&p.pool, &format!("next-{k}"), refused.one_on_a.clone()),
            )
            .await;
        let placed = &d["createReservation"]["reservation"];
        assert_ne!(
            placed["allocations"][0]["atoms"][0].as_str(),
            Some(refused.atom.as_str()),
            "{d}"
        );
    }
}
