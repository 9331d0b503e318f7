//! The reservation hot path against its ceiling, in one process and one run (issue 15).
//!
//! A fleet of 1,250 nodes × 8 H100 (10,000 GPUs) in one pool, 100 tenants with quotas. Each
//! request is 1 GPU now for an hour with 4 vCPU and 8 GiB, under a unique idempotency key, from
//! a tenant in turn. At each client count (8 and 32 by default) it runs, on the same fleet
//! reset to empty before each run:
//!
//! * **graphql**: `createReservation` through the API over HTTP (the real server, in this
//!   process), the whole path: JWT, GraphQL, the transaction and `compute_create_reservation`;
//! * **reference**: a hand-written single SQL function (`bench_reference_reserve`, below) doing
//!   the same work a reservation needs, node choice included (idempotency row, quota guard, the
//!   pool's key share, a free atom found from a random node, the node `FOR SHARE`, the booking,
//!   the scalars, the allocation, an outbox row, the work queue, the key's response), called
//!   straight from a client in one round trip;
//! * **random-node**: the database's own limit as issue 35's harness measures it
//!   (`bench_random_node_reserve`): handed a random node by the client, it does the writes
//!   without any search (idempotency row, quota guard, pool and node `FOR SHARE`, a free atom of
//!   that node, the booking, the scalars, the work-queue row, the key's response).
//! * **floor**: the random-node function's work plus the rows a reservation must leave behind
//!   (`bench_floor_reserve`): the reservation, its allocation, three quota rows, the event with
//!   the product's payload, the key written once with its answer. What no implementation that
//!   keeps `consistency.md`'s rules can avoid, given a node: graphql's CPU against it is what
//!   placement and checking cost, its CPU against the random-node function how far issue 35's
//!   1.25× lies below the writes.
//!
//! Every client count runs once with commits flushed and once with `synchronous_commit = off`
//! for every path (`sync=on` or `sync=off` runs one), and prints, beside each path's figures,
//! graphql's ratio to both functions, its PostgreSQL CPU per reservation against the
//! random-node function's, and how each scaled from the fewest clients to the most (issue 35's
//! goals: 0.7× the random-node function at 8 clients, 0.5× at 32, CPU at most 1.25× its, and
//! no plateau). `pools=P nodes=N` sets the fleet (default 1 pool of 1,250 nodes × 8 GPUs; the
//! harness's are `pools=10` and `pools=10 nodes=12500` for 100,000 GPUs).
//!
//! The paths run in turn, in `rounds` rounds (3 unless `rounds=N` is given) of `requests`
//! each (3,000 unless given), the fleet emptied before each, the order swapped every round: this
//! machine's speed drifts by a quarter within a minute, and two paths measured one after the
//! other would be measured on two different machines. A round is what a run was before session
//! 21: the fleet fills to the same point, so the figures compare with earlier ones.
//!
//! Emptying the fleet invalidates every connection's cached plans, so each timed run follows
//! a few requests per client that are not timed (its warm-up), on both paths.
//!
//! It prints, per client count (all rounds together), reservations/s, p50 and p99, the SQL
//! statements per request (counted from sqlx's statement log in a short calibration pass, not
//! while timing), PostgreSQL CPU per reservation (the server's processes, from `/proc`), and
//! the ratio graphql / reference, of all rounds and of each.
//! With `scale-out` among the arguments it then puts PgBouncer (transaction pooling, 20 server
//! connections) in front of the database and runs the graphql path again against one, then two,
//! `compute-api serve` processes (this package's `test-api` build), the requests spread over
//! them in turn: reservations/s with one and with two API processes.
//!
//! `sql=FILE` runs FILE's SQL on the benchmark's database before seeding: a function redefined
//! there is measured without a rebuild (then written as a migration).
//!
//! `db-pool=N` sets the connections every path shares (the API's pool; the API's default, 16,
//! unless given).
//!
//! With `profile` among the arguments it first runs 2,000 requests of graphql and of the
//! random-node function at 8 clients with `track_functions = 'pl'` and prints each PL/pgSQL
//! function's calls and time per request (`pg_stat_user_functions`): where the server's time
//! per reservation goes.
//!
//! Asserts nothing: a benchmark, not a test.
//!
//! ```sh
//! cargo build --release -p compute-tests
//! target/release/bench-reservations [requests per round] [clients…] [rounds=N] [pools=P] [nodes=N] [sync=on|off] [db-pool=N] [sql=FILE] [profile] [scale-out]
//! ```

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use compute_api::auth::Role;
use compute_domain::idempotency::Actor;
use compute_domain::ids::ScopeId;
use compute_domain::quota::{self, QuotaLimits};
use serde_json::json;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const NODES: usize = 1_250;
const GPUS_PER_NODE: usize = 8;
const TENANTS: usize = 100;

/// Whether sqlx's statement log is counted (only in the calibration passes).
static COUNTING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: AtomicUsize = AtomicUsize::new(0);

struct CountStatements;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountStatements {
    fn on_event(
        &self,
        _event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
    }
}

/// The hand-written ceiling: the same work as a create, as one function, called in one round
/// trip. Not the product's code; written here so the comparison cannot drift into measuring the
/// product against itself.
const REFERENCE: &str = r#"
CREATE OR REPLACE FUNCTION bench_reference_reserve(p_tenant text, p_key text, p_pool text, p_ends timestamptz)
    RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_id    text := compute_new_id('rsv');
    v_alloc text := 'alc_' || replace(gen_random_uuid()::text, '-', '');
    v_site  text;
    v_now   timestamptz := compute_now();
    v_atom  record;
    v_start integer;
    v_try   integer := 0;
BEGIN
    INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint)
        VALUES (p_tenant, 'bench', p_key, 'reference', '{}');
    SELECT site_id INTO v_site FROM pools WHERE id = p_pool FOR KEY SHARE;
    UPDATE quota_usage SET used = used + 1, version = version + 1
     WHERE tenant_id = p_tenant AND scope_kind = 'pool' AND scope_id = p_pool AND resource = 'gpu' AND used + 1 <= max_amount;
    IF NOT FOUND THEN RAISE EXCEPTION 'over quota'; END IF;
    INSERT INTO reservations (id, tenant_id, created_by, pool_id, state, starts_at, ends_at, charge_gpu, charge_vcpu, charge_memory_mib, charged)
        VALUES (v_id, p_tenant, 'bench', p_pool, 'active', v_now, p_ends, 1, 4, 8192, '[]');
    INSERT INTO allocations (id, reservation_id, ordinal, gpu_kind, gpu_count, vcpu, memory_mib, disk_gib)
        VALUES (v_alloc, v_id, 0, 'gpu', 1, 4, 8192, 0);
    LOOP
        v_start := floor(random() * 1024)::integer;
        SELECT a.name, a.device_id, d.node_id INTO v_atom
          FROM nodes n JOIN devices d ON d.node_id = n.id JOIN device_atoms a ON a.device_id = d.id
         WHERE n.pool_id = p_pool AND n.spread >= v_start AND compute_node_schedulable(n.lifecycle, n.reachability)
           AND a.kind = 'gpu'
           AND NOT EXISTS (SELECT 1 FROM device_bookings b WHERE b.atom = a.name AND b.during && tstzrange(v_now, p_ends))
         ORDER BY n.spread LIMIT 1;
        IF v_atom.name IS NULL THEN
            SELECT a.name, a.device_id, d.node_id INTO v_atom
              FROM nodes n JOIN devices d ON d.node_id = n.id JOIN device_atoms a ON a.device_id = d.id
             WHERE n.pool_id = p_pool AND compute_node_schedulable(n.lifecycle, n.reachability) AND a.kind = 'gpu'
               AND NOT EXISTS (SELECT 1 FROM device_bookings b WHERE b.atom = a.name AND b.during && tstzrange(v_now, p_ends))
             ORDER BY n.spread LIMIT 1;
        END IF;
        IF v_atom.name IS NULL THEN RAISE EXCEPTION 'the fleet is full'; END IF;
        PERFORM 1 FROM nodes WHERE id = v_atom.node_id FOR SHARE;
        INSERT INTO device_bookings (atom, device_id, allocation_id, during)
            VALUES (v_atom.name, v_atom.device_id, v_alloc, tstzrange(v_now, p_ends)) ON CONFLICT DO NOTHING;
        EXIT WHEN FOUND;
        v_try := v_try + 1;
        -- At 32 clients, random starts that fall close together pick the same first free atom;
        -- three lost races in a row happened once in 3,000 requests and ended a run.
        IF v_try >= 8 THEN RAISE EXCEPTION 'lost eight races'; END IF;
    END LOOP;
    UPDATE node_resources SET allocated = allocated + CASE resource WHEN 'vcpu' THEN 4 ELSE 8192 END
     WHERE node_id = v_atom.node_id AND resource IN ('memory_mib', 'vcpu');
    UPDATE allocations SET node_id = v_atom.node_id, atoms = ARRAY[v_atom.name] WHERE id = v_alloc;
    PERFORM compute_emit('reservation.active', p_tenant, v_id, jsonb_build_object('id', v_id, 'atom', v_atom.name));
    PERFORM compute_enqueue('reservation', ARRAY[v_id], 8);
    UPDATE idempotency_keys SET response = jsonb_build_object('reservationId', v_id)
     WHERE tenant_id = p_tenant AND subject = 'bench' AND key = p_key;
    RETURN v_id;
END
$$;
-- As the product's functions do (migrations 0015 and 0017): keep the generic plans, not re-plan
-- each call, and make them index plans whatever the tables' sizes when they were made.
ALTER FUNCTION bench_reference_reserve(text, text, text, timestamptz) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION bench_reference_reserve(text, text, text, timestamptz) SET enable_seqscan = off;
"#;

/// The database's own limit (issue 35): the writes a create needs, handed a random node by the
/// client, so no placement search at all: the idempotency row, the quota guard, the pool and
/// the node `FOR SHARE`, a free atom of that node, the booking, the scalars, the work-queue row
/// and the key's response. No reservation, allocation or outbox row: less than a create writes,
/// by design (it is the harness's function). A node with no free atom (or whose atom another
/// took meanwhile) fails the call, which rolls it back, and the client draws another node.
const RANDOM_NODE: &str = r#"
CREATE OR REPLACE FUNCTION bench_random_node_reserve(p_tenant text, p_key text, p_pool text, p_node text, p_ends timestamptz)
    RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_alloc text := 'alc_' || replace(gen_random_uuid()::text, '-', '');
    v_now   timestamptz := compute_now();
    v_atom  record;
BEGIN
    INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint)
        VALUES (p_tenant, 'bench', p_key, 'random-node', '{}');
    UPDATE quota_usage SET used = used + 1, version = version + 1
     WHERE tenant_id = p_tenant AND scope_kind = 'pool' AND scope_id = p_pool AND resource = 'gpu' AND used + 1 <= max_amount;
    IF NOT FOUND THEN RAISE EXCEPTION 'over quota'; END IF;
    PERFORM 1 FROM pools WHERE id = p_pool FOR SHARE;
    PERFORM 1 FROM nodes WHERE id = p_node FOR SHARE;
    SELECT a.name, a.device_id INTO v_atom
      FROM devices d JOIN device_atoms a ON a.device_id = d.id
     WHERE d.node_id = p_node AND a.kind = 'gpu'
       AND NOT EXISTS (SELECT 1 FROM device_bookings b WHERE b.atom = a.name AND b.during && tstzrange(v_now, p_ends))
     LIMIT 1;
    IF v_atom.name IS NULL THEN RAISE EXCEPTION 'node full'; END IF;
    INSERT INTO device_bookings (atom, device_id, allocation_id, during)
        VALUES (v_atom.name, v_atom.device_id, v_alloc, tstzrange(v_now, p_ends)) ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN RAISE EXCEPTION 'node full'; END IF;
    UPDATE node_resources SET allocated = allocated + CASE resource WHEN 'vcpu' THEN 4 ELSE 8192 END
     WHERE node_id = p_node AND resource IN ('memory_mib', 'vcpu');
    PERFORM compute_enqueue('reservation', ARRAY[v_alloc], 8);
    UPDATE idempotency_keys SET response = jsonb_build_object('allocationId', v_alloc)
     WHERE tenant_id = p_tenant AND subject = 'bench' AND key = p_key;
    RETURN v_alloc;
END
$$;
ALTER FUNCTION bench_random_node_reserve(text, text, text, text, timestamptz) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION bench_random_node_reserve(text, text, text, text, timestamptz) SET enable_seqscan = off;
"#;

/// The floor under any create that keeps `consistency.md`'s rules, given a node (issue 35): the
/// random-node function's work plus the rows a reservation must leave behind, each written once
/// and as simply as it can be: the key with its answer, the tenant's three quota rows of the pool
/// (GPUs, memory, vCPU) in one guarded update, the reservation, its allocation (node and atom
/// included, so never updated), the booking, the scalars, the event with the product's own
/// payload (`compute_reservation_payload`) and the work-queue row. No search, no savepoints, no
/// replans, no site quota: what no implementation can avoid, so graphql's CPU against it is the
/// part that is placement and checking, and its CPU against the random-node function is how far
/// below the writes issue 35's 1.25× lies.
const FLOOR: &str = r#"
CREATE OR REPLACE FUNCTION bench_floor_reserve(p_tenant text, p_key text, p_pool text, p_node text, p_ends timestamptz)
    RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_id    text := compute_new_id('rsv');
    v_alloc text := 'alc_' || replace(gen_random_uuid()::text, '-', '');
    v_now   timestamptz := compute_now();
    v_atom  record;
    v_n     integer;
BEGIN
    INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint, response)
        VALUES (p_tenant, 'bench', p_key, 'floor', '{}', jsonb_build_object('id', v_id));
    UPDATE quota_usage SET used = used + CASE resource WHEN 'gpu' THEN 1 WHEN 'vcpu' THEN 4 ELSE 8192 END, version = version + 1
     WHERE tenant_id = p_tenant AND scope_kind = 'pool' AND scope_id = p_pool AND resource IN ('gpu', 'memory_mib', 'vcpu')
       AND used + CASE resource WHEN 'gpu' THEN 1 WHEN 'vcpu' THEN 4 ELSE 8192 END <= max_amount;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n <> 3 THEN RAISE EXCEPTION 'over quota'; END IF;
    PERFORM 1 FROM pools WHERE id = p_pool FOR SHARE;
    PERFORM 1 FROM nodes WHERE id = p_node FOR SHARE;
    SELECT a.name, a.device_id INTO v_atom
      FROM devices d JOIN device_atoms a ON a.device_id = d.id
     WHERE d.node_id = p_node AND a.kind = 'gpu'
       AND NOT EXISTS (SELECT 1 FROM device_bookings b WHERE b.atom = a.name AND b.during && tstzrange(v_now, p_ends))
     LIMIT 1;
    IF v_atom.name IS NULL THEN RAISE EXCEPTION 'node full'; END IF;
    INSERT INTO reservations (id, tenant_id, created_by, pool_id, state, starts_at, ends_at, charge_gpu, charge_vcpu, charge_memory_mib, charged)
        VALUES (v_id, p_tenant, 'bench', p_pool, 'active', v_now, p_ends, 1, 4, 8192, '[]');
    INSERT INTO allocations (id, reservation_id, ordinal, gpu_kind, gpu_count, model, vcpu, memory_mib, disk_gib, node_id, atoms)
        VALUES (v_alloc, v_id, 0, 'gpu', 1, 'H100', 4, 8192, 0, p_node, ARRAY[v_atom.name]);
    INSERT INTO device_bookings (atom, device_id, pool_id, allocation_id, during)
        VALUES (v_atom.name, v_atom.device_id, p_pool, v_alloc, tstzrange(v_now, p_ends)) ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN RAISE EXCEPTION 'node full'; END IF;
    UPDATE node_resources SET allocated = allocated + CASE resource WHEN 'vcpu' THEN 4 ELSE 8192 END
     WHERE node_id = p_node AND resource IN ('memory_mib', 'vcpu');
    PERFORM compute_emit('reservation.active', p_tenant, v_id, compute_reservation_payload(v_id)),
            compute_enqueue('reservation', ARRAY[v_id], 8);
    RETURN v_id;
END
$$;
ALTER FUNCTION bench_floor_reserve(text, text, text, text, timestamptz) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION bench_floor_reserve(text, text, text, text, timestamptz) SET enable_seqscan = off;
"#;

const CREATE: &str = "mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { id state } } }";

/// The variables of one benchmark request: 1 H100 now with 4 vCPU and 8 GiB, under `key`.
fn request(pool_id: &str, ends_at: &str, key: &str) -> serde_json::Value {
    json!({ "i": {
        "poolId": pool_id, "endsAt": ends_at,
        "allocations": [{ "gpuCount": 1, "model": "H100", "vcpu": 4, "memoryMib": 8192 }],
        "idempotencyKey": key,
    }})
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// CPU seconds of the PostgreSQL server: the postmaster and its children (`/proc`, in ticks of
/// 1/100 s).
fn postgres_cpu(postmaster: u32) -> f64 {
    let ticks = |stat: &str| -> Option<(u32, u64)> {
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some((
            f.get(1)?.parse().ok()?,
            f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?,
        ))
    };
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some((ppid, t)) = ticks(&stat)
            && (pid == postmaster || ppid == postmaster)
        {
            total += t;
        }
    }
    total as f64 / 100.0
}

/// With `profile`: 2,000 requests of `path` at 8 clients with `track_functions = 'pl'`, then
/// each PL/pgSQL function's calls and time (its own, and with what it calls) per request, from
/// `pg_stat_user_functions`: where the server's time per reservation goes.
async fn profile<F, Fut>(db: &compute_domain::db::Db, postmaster: u32, path: &str, warm: F, one: F)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    reset(db).await;
    run(64, 8, postmaster, warm).await;
    for sql in [
        "ALTER SYSTEM SET track_functions = 'pl'",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::raw_sql(sql).execute(db.pool()).await.expect(sql);
    }
    // Let every backend see the new setting and flush what it counted (at most once a second).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sqlx::query("SELECT pg_stat_reset()")
        .execute(db.pool())
        .await
        .expect("reset");
    let n = 2000;
    let r = run(n, 8, postmaster, one).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let rows: Vec<(String, i64, f64, f64)> = sqlx::query_as(
        "SELECT funcname::text, calls, self_time, total_time FROM pg_stat_user_functions ORDER BY self_time DESC",
    )
    .fetch_all(db.pool())
    .await
    .expect("pg_stat_user_functions");
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "\nprofile of {path}: {n} requests at 8 clients, {:.0}/s, PostgreSQL CPU {:.2} ms per request\n\
         function                              calls/request  self ms/request  total ms/request",
        r.rate(),
        r.cpu_ms()
    );
    for (name, calls, own, total) in rows {
        let _ = writeln!(
            out,
            "{name:<38}  {:>12.2}  {:>15.3}  {:>16.3}",
            calls as f64 / n as f64,
            own / n as f64,
            total / n as f64
        );
    }
    drop(out);
    for sql in [
        "ALTER SYSTEM RESET track_functions",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::raw_sql(sql).execute(db.pool()).await.expect(sql);
    }
}

struct Run {
    /// Every request's latency, in no particular order.
    latencies: Vec<Duration>,
    seconds: f64,
    pending: usize,
    /// PostgreSQL's CPU seconds over the run.
    cpu: f64,
    /// Commits, rollbacks and deadlocks during the run (the statistics lag by up to half a
    /// second: indicative).
    transactions: (i64, i64, i64),
}

impl Run {
    fn rate(&self) -> f64 {
        self.latencies.len() as f64 / self.seconds
    }

    fn cpu_ms(&self) -> f64 {
        self.cpu * 1000.0 / self.latencies.len() as f64
    }

    /// p50 and p99.
    fn percentiles(&self) -> (Duration, Duration) {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        (percentile(&sorted, 0.5), percentile(&sorted, 0.99))
    }

    /// Two runs as one: their requests, their times and their costs added up.
    fn merge(mut self, other: Run) -> Run {
        self.latencies.extend(other.latencies);
        self.seconds += other.seconds;
        self.pending += other.pending;
        self.cpu += other.cpu;
        self.transactions = (
            self.transactions.0 + other.transactions.0,
            self.transactions.1 + other.transactions.1,
            self.transactions.2 + other.transactions.2,
        );
        self
    }
}

async fn reset(db: &compute_domain::db::Db) {
    sqlx::raw_sql(
        "TRUNCATE device_bookings, allocations, reservations, idempotency_keys, outbox, work_queue CASCADE;
         UPDATE node_resources SET allocated = 0; UPDATE quota_usage SET used = 0;",
    )
    .execute(db.pool())
    .await
    .expect("reset");
    sqlx::raw_sql("VACUUM ANALYZE")
        .execute(db.pool())
        .await
        .expect("vacuum");
}

/// Runs `requests` requests from `clients` concurrent clients; `one(i)` makes request `i` and
/// says whether it went pending.
async fn run<F, Fut>(requests: usize, clients: usize, postmaster: u32, one: F) -> Run
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let one = Arc::new(one);
    let next = Arc::new(AtomicUsize::new(0));
    let cpu = postgres_cpu(postmaster);
    let stats = database_stats(&DB.get().expect("set").clone()).await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (one, next) = (one.clone(), next.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests {
                        return out;
                    }
                    let t = Instant::now();
                    let pending = one(i).await;
                    out.push((t.elapsed(), pending));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("a client"));
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = postgres_cpu(postmaster) - cpu;
    let after = database_stats(&DB.get().expect("set").clone()).await;
    Run {
        latencies: all.iter().map(|x| x.0).collect(),
        seconds,
        pending: all.iter().filter(|x| x.1).count(),
        cpu,
        transactions: (after.0 - stats.0, after.1 - stats.1, after.2 - stats.2),
    }
}

/// The benchmark's database, for [`database_stats`].
static DB: std::sync::OnceLock<compute_domain::db::Db> = std::sync::OnceLock::new();

/// Commits, rollbacks and deadlocks of the database so far (`pg_stat_database`).
async fn database_stats(db: &compute_domain::db::Db) -> (i64, i64, i64) {
    sqlx::query_as::<_, (i64, i64, i64)>(
        "SELECT xact_commit, xact_rollback, deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(db.pool())
    .await
    .expect("pg_stat_database")
}

#[tokio::main]
async fn main() {
    // With `OTEL_EXPORTER_OTLP_ENDPOINT` set, the in-process API traces as `compute-api` does
    // (what tracing costs; docs/performance.md), and statements are not counted.
    let telemetry =
        match compute_telemetry::trace_config() {
            Ok(compute_telemetry::TraceConfig::Otlp { .. }) => Some(
                compute_telemetry::init(
                    "bench-reservations",
                    compute_telemetry::LogFormat::Pretty,
                    "warn",
                )
                .expect("tracing"),
            ),
            _ => {
                let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
                tracing_subscriber::registry()
                    .with(tracing_subscriber::fmt::layer().with_filter(filter))
                    .with(CountStatements.with_filter(
                        tracing_subscriber::filter::dynamic_filter_fn(|meta, _| {
                            meta.target() == "sqlx::query" && COUNTING.load(Ordering::Relaxed)
                        }),
                    ))
                    .init();
                None
            }
        };
    let args: Vec<String> = std::env::args().collect();
    let requests: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3000);
    let scale_out = args.iter().any(|a| a == "scale-out");
    let named = |name: &str, default: usize| -> usize {
        args.iter()
            .find_map(|a| a.strip_prefix(name)?.strip_prefix('='))
            .and_then(|s| s.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(default)
    };
    let rounds = named("rounds", 3);
    let pool_count = named("pools", 1);
    let node_count = named("nodes", NODES);
    // `sync=on`, `sync=off` or (the default) both: commits flushed, then with
    // `synchronous_commit = off` for every path (the disk out of the comparison).
    let sync_modes: Vec<&str> = match args.iter().find_map(|a| a.strip_prefix("sync=")) {
        Some("on") => vec!["on"],
        Some("off") => vec!["off"],
        _ => vec!["on", "off"],
    };
    let mut client_counts: Vec<usize> = args[2.min(args.len())..]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    if client_counts.is_empty() {
        client_counts = vec![8, 32];
    }
    // `db-pool=N`: the connections every path shares; by default the API's own default
    // (`PoolSettings`, 16), which served more than one per client (fewer backends contend less
    // for the two cores: docs/performance.md).
    let db_pool = named(
        "db-pool",
        compute_domain::db::PoolSettings::default().max_connections as usize,
    );
    let test_db = compute_tests::test_db_on_wall_clock_with(db_pool as u32).await;
    let app = Arc::new(compute_tests::TestApp::builder().on(test_db).start().await);
    let db = app.db.db.clone();
    let _ = DB.set(db.clone());
    for f in [REFERENCE, RANDOM_NODE, FLOOR] {
        sqlx::raw_sql(f)
            .execute(db.pool())
            .await
            .expect("the reference functions");
    }
    // `sql=FILE`: SQL run on the benchmark's database before the fleet is seeded (a function
    // redefined to measure a change without rebuilding the benchmark).
    if let Some(file) = args.iter().find_map(|a| a.strip_prefix("sql=")) {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file}: {e}"));
        sqlx::raw_sql(&text)
            .execute(db.pool())
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
    }
    let postmaster: u32 = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
        .fetch_one(db.pool())
        .await
        .map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s[s.rfind(')')? + 2..]
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                })
                .unwrap_or(0)
        })
        .expect("backend pid");

    let seeding = Instant::now();
    let operator = Actor::operator("bench");
    let pool_ids =
        compute_tests::bench::gpu_fleet(&db, pool_count, node_count / pool_count, GPUS_PER_NODE)
            .await;
    // Nodes come up connected, as a fleet in service does.
    sqlx::query("UPDATE nodes SET reachability = 'connected'")
        .execute(db.pool())
        .await
        .expect("connected");
    let tenants: Vec<String> = (0..TENANTS).map(|t| format!("tenant-{t}")).collect();
    for t in &tenants {
        for pool_id in &pool_ids {
            quota::set_quota(
                &db,
                &operator,
                &compute_tests::tenant(t),
                &ScopeId::Pool(pool_id.clone()),
                QuotaLimits {
                    gpus: Some(100_000.0),
                    vcpu: Some(10_000_000),
                    memory_mib: Some(10_000_000_000),
                },
            )
            .await
            .expect("quota");
        }
    }
    let pools: Arc<Vec<String>> = Arc::new(pool_ids.iter().map(|p| p.to_string()).collect());
    // Each pool's nodes, for the random-node function's draws.
    let mut nodes_of: Vec<Vec<String>> = vec![Vec::new(); pools.len()];
    for (node, pool) in
        sqlx::query_as::<_, (String, String)>("SELECT id, pool_id FROM nodes ORDER BY id")
            .fetch_all(db.pool())
            .await
            .expect("nodes")
    {
        if let Some(k) = pools.iter().position(|p| *p == pool) {
            nodes_of[k].push(node);
        }
    }
    let nodes_of = Arc::new(nodes_of);
    let tokens: Arc<Vec<String>> = Arc::new(
        tenants
            .iter()
            .map(|t| app.token(&format!("bench@{t}"), Some(t), &[Role::Member]))
            .collect(),
    );
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "fleet: {} nodes × {GPUS_PER_NODE} H100 = {} GPUs in {} pool(s), {TENANTS} tenants (seeded in {:.1} s); \
         {requests} requests per path in each of {rounds} rounds, each 1 GPU now for 1 h with 4 vCPU and 8 GiB \
         in the pools in turn, unique keys; {db_pool} pooled connections",
        nodes_of.iter().map(Vec::len).sum::<usize>(),
        nodes_of.iter().map(Vec::len).sum::<usize>() * GPUS_PER_NODE,
        pools.len(),
        seeding.elapsed().as_secs_f64()
    );
    drop(out);

    let ends_at = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    let graphql = {
        let (app, tokens, pools, ends_at) =
            (app.clone(), tokens.clone(), pools.clone(), ends_at.clone());
        move |run: usize| {
            let (app, tokens, pools, ends_at) =
                (app.clone(), tokens.clone(), pools.clone(), ends_at.clone());
            move |i: usize| {
                let (app, tokens, pools, ends_at) =
                    (app.clone(), tokens.clone(), pools.clone(), ends_at.clone());
                async move {
                    let vars = request(&pools[i % pools.len()], &ends_at, &format!("g{run}-{i}"));
                    let (status, body) =
                        app.graphql(CREATE, vars, Some(&tokens[i % TENANTS])).await;
                    assert!(
                        status == 200 && body.get("errors").is_none(),
                        "createReservation failed: {body}"
                    );
                    body["data"]["createReservation"]["reservation"]["state"] == "PENDING"
                }
            }
        }
    };
    let reference = {
        let (db, pools, tenants) = (db.clone(), pools.clone(), tenants.clone());
        move |run: usize| {
            let (db, pools, tenants) = (db.clone(), pools.clone(), tenants.clone());
            move |i: usize| {
                let (db, pool_id, tenant) = (
                    db.clone(),
                    pools[i % pools.len()].clone(),
                    tenants[i % TENANTS].clone(),
                );
                async move {
                    sqlx::query("SELECT bench_reference_reserve($1, $2, $3, compute_now() + interval '1 hour')")
                        .bind(tenant)
                        .bind(format!("r{run}-{i}"))
                        .bind(pool_id)
                        .execute(db.pool())
                        .await
                        .expect("the reference");
                    false
                }
            }
        }
    };
    // The random-node function, or (`sql` naming the floor) the floor: the same draws.
    let on_a_drawn_node = |sql: &'static str, prefix: &'static str| {
        let (db, pools, tenants, nodes_of) =
            (db.clone(), pools.clone(), tenants.clone(), nodes_of.clone());
        move |run: usize| {
            let (db, pools, tenants, nodes_of) =
                (db.clone(), pools.clone(), tenants.clone(), nodes_of.clone());
            move |i: usize| {
                let (db, pools, tenant, nodes_of) = (
                    db.clone(),
                    pools.clone(),
                    tenants[i % TENANTS].clone(),
                    nodes_of.clone(),
                );
                async move {
                    let k = i % pools.len();
                    let nodes = &nodes_of[k];
                    // A node drawn from the request's number (a multiplicative hash: spread,
                    // and the same on every run); a full node draws again.
                    for attempt in 0..64u64 {
                        let draw = ((run as u64) << 32 | i as u64)
                            .wrapping_add(attempt)
                            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        let node = &nodes[(draw >> 33) as usize % nodes.len()];
                        match sqlx::query(sql)
                            .bind(&tenant)
                            .bind(format!("{prefix}{run}-{i}"))
                            .bind(&pools[k])
                            .bind(node)
                            .execute(db.pool())
                            .await
                        {
                            Ok(_) => return false,
                            Err(e) if e.to_string().contains("node full") => continue,
                            Err(e) => panic!("{sql}: {e}"),
                        }
                    }
                    panic!("64 full nodes drawn in a row")
                }
            }
        }
    };
    let random_node = on_a_drawn_node(
        "SELECT bench_random_node_reserve($1, $2, $3, $4, compute_now() + interval '1 hour')",
        "n",
    );
    let floor = on_a_drawn_node(
        "SELECT bench_floor_reserve($1, $2, $3, $4, compute_now() + interval '1 hour')",
        "f",
    );

    // Statements per request, counted in a short pass of each (not timed).
    reset(&db).await;
    let statements =
        |before: usize, n: usize| (STATEMENTS.load(Ordering::Relaxed) - before) as f64 / n as f64;
    COUNTING.store(true, Ordering::Relaxed);
    let before = STATEMENTS.load(Ordering::Relaxed);
    run(100, 1, postmaster, graphql(1000)).await;
    let graphql_statements = statements(before, 100);
    let before = STATEMENTS.load(Ordering::Relaxed);
    run(100, 1, postmaster, reference(1000)).await;
    let reference_statements = statements(before, 100);
    let before = STATEMENTS.load(Ordering::Relaxed);
    run(100, 1, postmaster, random_node(1000)).await;
    let random_statements = statements(before, 100);
    COUNTING.store(false, Ordering::Relaxed);

    let mut out = std::io::stdout().lock();
    if telemetry.is_some() {
        let _ = writeln!(
            out,
            "tracing is on (OTEL_EXPORTER_OTLP_ENDPOINT): the API's spans are exported; statements are not counted"
        );
    } else {
        let _ = writeln!(
            out,
            "SQL statements per request (sent by the client; BEGIN and COMMIT included): graphql {graphql_statements:.1}, \
             reference {reference_statements:.1}, random-node {random_statements:.1}"
        );
    }
    drop(out);
    if args.iter().any(|a| a == "profile") {
        profile(&db, postmaster, "graphql", graphql(2001), graphql(2000)).await;
        profile(
            &db,
            postmaster,
            "random-node",
            random_node(2001),
            random_node(2000),
        )
        .await;
    }
    const PATHS: [&str; 4] = ["graphql", "reference", "random-node", "floor"];
    // Each client count runs the four paths in `rounds` rounds of `requests`, in turn (the
    // order rotated every round) and each on an emptied fleet: this machine's speed drifts by a
    // quarter within a minute, and paths measured one after the other would see different
    // machines. The figures are of all rounds together; each round's ratios are printed too.
    for (m, &mode) in sync_modes.iter().enumerate() {
        // Two statements: ALTER SYSTEM cannot run in the transaction a multi-statement string is.
        for sql in [
            format!("ALTER SYSTEM SET synchronous_commit = '{mode}'"),
            "SELECT pg_reload_conf()".to_owned(),
        ] {
            sqlx::raw_sql(&sql)
                .execute(db.pool())
                .await
                .expect("synchronous_commit (the benchmark's cluster is its own)");
        }
        let _ = writeln!(
            std::io::stdout().lock(),
            "\nsynchronous_commit = {mode}\n\
             clients  path         reservations/s   p50        p99        pending  PostgreSQL CPU/reservation"
        );
        let mut rates: Vec<(usize, f64, f64)> = Vec::new();
        for (k, &clients) in client_counts.iter().enumerate() {
            let mut all: [Option<Run>; 4] = [None, None, None, None];
            let mut round_ratios = Vec::new();
            for round in 0..rounds {
                let id = 1000 * m + 100 * k + round;
                let mut this: [Option<Run>; 4] = [None, None, None, None];
                for step in 0..4 {
                    let path = (round + step) % 4;
                    // Emptying the fleet invalidates every connection's cached plans: a few
                    // requests per client, not timed, make them again before the timed ones.
                    reset(&db).await;
                    let warm = 4 * clients;
                    this[path] = Some(match path {
                        0 => {
                            run(warm, clients, postmaster, graphql(10_000 + id)).await;
                            run(requests, clients, postmaster, graphql(id)).await
                        }
                        1 => {
                            run(warm, clients, postmaster, reference(10_000 + id)).await;
                            run(requests, clients, postmaster, reference(id)).await
                        }
                        2 => {
                            run(warm, clients, postmaster, random_node(10_000 + id)).await;
                            run(requests, clients, postmaster, random_node(id)).await
                        }
                        _ => {
                            run(warm, clients, postmaster, floor(10_000 + id)).await;
                            run(requests, clients, postmaster, floor(id)).await
                        }
                    });
                }
                let [g, r, n, f] = this.map(|x| x.expect("every path ran"));
                round_ratios.push(format!(
                    "{:.2}/{:.2}",
                    g.rate() / r.rate(),
                    g.rate() / n.rate()
                ));
                for (slot, x) in all.iter_mut().zip([g, r, n, f]) {
                    *slot = Some(match slot.take() {
                        Some(a) => a.merge(x),
                        None => x,
                    });
                }
            }
            let [g, r, n, f] = all.map(|x| x.expect("a round"));
            let mut out = std::io::stdout().lock();
            for (name, x) in PATHS.iter().zip([&g, &r, &n, &f]) {
                let (p50, p99) = x.percentiles();
                let _ = writeln!(
                    out,
                    "{clients:>7}  {name:<11}  {:>14.0}   {:>8.1?}  {:>8.1?}  {:>7}  {:.2} ms  (commits {}, rollbacks {}, deadlocks {})",
                    x.rate(),
                    p50,
                    p99,
                    x.pending,
                    x.cpu_ms(),
                    x.transactions.0,
                    x.transactions.1,
                    x.transactions.2
                );
            }
            let _ = writeln!(
                out,
                "{clients:>7}  ratio graphql / reference {:.2}, graphql / random-node {:.2} (goal: {}); \
                 PostgreSQL CPU graphql / random-node {:.2}× (goal ≤ 1.25×)  (rounds of {requests}, reference/random-node: {})",
                g.rate() / r.rate(),
                g.rate() / n.rate(),
                if clients <= 8 { "≥ 0.7" } else { "≥ 0.5" },
                g.cpu_ms() / n.cpu_ms(),
                round_ratios.join(", ")
            );
            let _ = writeln!(
                out,
                "{clients:>7}  the floor (the writes a create cannot avoid, on a drawn node): PostgreSQL CPU floor / random-node {:.2}×, \
                 graphql / floor {:.2}×; rate graphql / floor {:.2}",
                f.cpu_ms() / n.cpu_ms(),
                g.cpu_ms() / f.cpu_ms(),
                g.rate() / f.rate()
            );
            rates.push((clients, g.rate(), n.rate()));
        }
        // Scaling from the fewest clients to the most: wherever the function's rate grows by
        // 1.5× or more, graphql's must grow by 1.3× or more (no plateau).
        if let (Some(lo), Some(hi)) = (rates.first(), rates.last())
            && hi.0 > lo.0
        {
            let (gs, ns) = (hi.1 / lo.1, hi.2 / lo.2);
            let _ = writeln!(
                std::io::stdout().lock(),
                "scaling {} → {} clients: graphql {gs:.2}×, random-node {ns:.2}× ({})",
                lo.0,
                hi.0,
                if ns >= 1.5 {
                    if gs >= 1.3 {
                        "the function scaled and graphql followed: no plateau"
                    } else {
                        "the function scaled and graphql did not: a plateau"
                    }
                } else {
                    "the function did not scale 1.5× here, so the plateau rule does not apply"
                }
            );
        }
    }
    for sql in [
        "ALTER SYSTEM RESET synchronous_commit",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::raw_sql(sql)
            .execute(db.pool())
            .await
            .expect("synchronous_commit back");
    }
    if let Some(t) = telemetry {
        let s = compute_telemetry::stats();
        let _ = writeln!(
            std::io::stdout().lock(),
            "spans exported {}, dropped: queue full {}, export failed {}",
            s.exported,
            s.dropped_queue_full,
            s.dropped_export_failed
        );
        t.shutdown().await;
    }
    if !scale_out {
        return;
    }
    // The same graphql requests over HTTP to separate API processes, through PgBouncer.
    let pooled = compute_tests::pgbouncer_for(&app.db, 20).await;
    let binary = compute_tests::bench::sibling("test-api");
    let http = reqwest::Client::new();
    let _ = writeln!(
        std::io::stdout().lock(),
        "\nthrough PgBouncer {} (transaction pooling, 20 server connections), `compute-api serve` processes, requests spread over them in turn:\n\
         processes  clients  reservations/s   p50        p99        pending  PostgreSQL CPU/reservation",
        compute_embedded_pg::pgbouncer::find_binary()
            .map(|b| b.display().to_string())
            .unwrap_or_default()
    );
    for processes in [1usize, 2] {
        let mut apis = Vec::new();
        let mut bases = Vec::new();
        for _ in 0..processes {
            let port = compute_tests::bench::free_port();
            apis.push(
                compute_tests::bench::spawn_api(&binary, &pooled.process_env(), port, &[]).await,
            );
            bases.push(format!("http://127.0.0.1:{port}/graphql"));
        }
        let bases = Arc::new(bases);
        for (k, &clients) in client_counts.iter().enumerate() {
            reset(&db).await;
            let (http, bases, tokens, pools, ends_at) = (
                http.clone(),
                bases.clone(),
                tokens.clone(),
                pools.clone(),
                ends_at.clone(),
            );
            let run_id = 100 * processes + k;
            let over_http = move |i: usize| {
                let (http, bases, tokens, pools, ends_at) = (
                    http.clone(),
                    bases.clone(),
                    tokens.clone(),
                    pools.clone(),
                    ends_at.clone(),
                );
                async move {
                    // The pools in turn, as the in-process paths do (with `pools=10`, one pool
                    // alone would fill after a tenth of the requests and leave the rest pending).
                    let vars =
                        request(&pools[i % pools.len()], &ends_at, &format!("p{run_id}-{i}"));
                    let body: serde_json::Value = http
                        .post(&bases[i % bases.len()])
                        .bearer_auth(&tokens[i % TENANTS])
                        .json(&json!({ "query": CREATE, "variables": vars }))
                        .send()
                        .await
                        .expect("the API answers")
                        .json()
                        .await
                        .expect("JSON");
                    assert!(
                        body.get("errors").is_none(),
                        "createReservation failed: {body}"
                    );
                    body["data"]["createReservation"]["reservation"]["state"] == "PENDING"
                }
            };
            let x = run(requests, clients, postmaster, over_http).await;
            let (p50, p99) = x.percentiles();
            let _ = writeln!(
                std::io::stdout().lock(),
                "{processes:>9}  {clients:>7}  {:>14.0}   {:>8.1?}  {:>8.1?}  {:>7}  {:.2} ms  (commits {}, rollbacks {}, deadlocks {})",
                x.rate(),
                p50,
                p99,
                x.pending,
                x.cpu_ms(),
                x.transactions.0,
                x.transactions.1,
                x.transactions.2
            );
        }
        drop(apis);
    }
}
