//! The journal: what this daemon was asked to do, what it did, and the workloads it started,
//! in SQLite (`<state dir>/journal.sqlite3`, WAL, `synchronous=FULL`: a committed write is on
//! the disk before the call returns). Each step of a command is committed before the message
//! that depends on it is sent (`docs/agent.md`):
//!
//! | step | journal | then |
//! | --- | --- | --- |
//! | `command` arrives | `received` | `ack` |
//! | `proceed` arrives | `started` (executions + 1) | the work starts |
//! | the work ended | `finished` with its `result` | `result` |
//!
//! The journal's id is made when the file is created and kept in it: an emptied state
//! directory is a new journal.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use compute_protocol::{CommandKind, FromDaemon};
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::sys::now;

/// A journal write or read that failed: the disk is full, the file is corrupt or unwritable.
#[derive(Debug)]
pub struct JournalError(pub String);

impl std::fmt::Display for JournalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JournalError {}

impl From<rusqlite::Error> for JournalError {
    fn from(e: rusqlite::Error) -> Self {
        JournalError(e.to_string())
    }
}

type Result<T> = std::result::Result<T, JournalError>;

/// Where a command is in the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Recorded and acknowledged; waits for `proceed`.
    Received,
    /// `proceed` arrived and the work began: a crash now leaves it without an outcome.
    Started,
    /// Its outcome is recorded.
    Finished,
}

impl Step {
    fn parse(s: &str) -> Step {
        match s {
            "started" => Step::Started,
            "finished" => Step::Finished,
            _ => Step::Received,
        }
    }
}

/// One command in the journal.
#[derive(Debug, Clone)]
pub struct Entry {
    pub id: String,
    pub kind: CommandKind,
    pub args: serde_json::Value,
    pub retry_safe: bool,
    pub step: Step,
    /// How many times its work began under this journal.
    pub executions: i64,
    /// The `result` message, once finished.
    pub result: Option<FromDaemon>,
}

/// Where a workload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkloadState {
    /// Being started: it may or may not exist yet (a crash here is settled by looking for it).
    Starting,
    /// Running, followed by the agent.
    Running,
    /// Asked to stop by `stop_instance` or `drain_workloads`.
    Stopping,
    /// It ended on its own (reported to the control plane with `exited`).
    Exited,
    /// It was stopped on request.
    Stopped,
}

impl WorkloadState {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadState::Starting => "starting",
            WorkloadState::Running => "running",
            WorkloadState::Stopping => "stopping",
            WorkloadState::Exited => "exited",
            WorkloadState::Stopped => "stopped",
        }
    }

    fn parse(s: &str) -> WorkloadState {
        match s {
            "running" => WorkloadState::Running,
            "stopping" => WorkloadState::Stopping,
            "exited" => WorkloadState::Exited,
            "stopped" => WorkloadState::Stopped,
            _ => WorkloadState::Starting,
        }
    }

    /// Whether it holds its devices.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            WorkloadState::Starting | WorkloadState::Running | WorkloadState::Stopping
        )
    }
}

/// A workload this daemon started.
#[derive(Debug, Clone)]
pub struct Workload {
    pub instance_id: String,
    pub command_id: String,
    /// `process` or `podman`.
    pub runtime: String,
    /// The allocation's atoms.
    pub devices: Vec<String>,
    /// The process (its own process group's leader), for the process runtime.
    pub pid: Option<i32>,
    /// The process's start time (`/proc/<pid>/stat`, field 22): a reused pid has another.
    pub start_time: Option<u64>,
    /// The container, for the podman runtime.
    pub container_id: Option<String>,
    pub state: WorkloadState,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// When it ended (seconds since the Unix epoch, by this machine's clock).
    pub ended_at: Option<f64>,
    /// Whether the control plane answered `exitRecorded` for it.
    pub exit_reported: bool,
    pub log_path: Option<String>,
}

/// The journal. Cheap calls: each is one SQLite transaction on a local file.
pub struct Journal {
    path: PathBuf,
    conn: Mutex<Connection>,
    id: String,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT;
CREATE TABLE IF NOT EXISTS commands (
    id          TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,
    args        TEXT NOT NULL,
    retry_safe  INTEGER NOT NULL,
    step        TEXT NOT NULL CHECK (step IN ('received', 'started', 'finished')),
    executions  INTEGER NOT NULL DEFAULT 0,
    result      TEXT,
    received_at REAL NOT NULL,
    finished_at REAL,
    -- The control plane answered `recorded` to its result: it never sends the command again.
    recorded    INTEGER NOT NULL DEFAULT 0,
    CHECK ((step = 'finished') = (result IS NOT NULL))
) STRICT;
CREATE TABLE IF NOT EXISTS workloads (
    instance_id   TEXT PRIMARY KEY,
    command_id    TEXT NOT NULL,
    runtime       TEXT NOT NULL,
    devices       TEXT NOT NULL,
    pid           INTEGER,
    start_time    INTEGER,
    container_id  TEXT,
    state         TEXT NOT NULL CHECK (state IN ('starting', 'running', 'stopping', 'exited', 'stopped')),
    exit_code     INTEGER,
    signal        INTEGER,
    ended_at      REAL,
    exit_reported INTEGER NOT NULL DEFAULT 0,
    log_path      TEXT,
    -- The `drain_workloads` command that is stopping it: its end is an exit its instance hears
    -- of (it did not ask), recorded as such even if the agent dies before the drain ends.
    drained_by    TEXT
) STRICT;
";

impl Journal {
    /// Opens (or creates) the journal in `dir`; an error names the path and what is wrong.
    pub fn open(dir: &Path) -> Result<Journal> {
        let path = dir.join("journal.sqlite3");
        let named = |e: rusqlite::Error| JournalError(format!("{}: {e}", path.display()));
        let conn = Connection::open(&path).map_err(named)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(named)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(named)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(named)?;
        let check: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(named)?;
        if check != "ok" {
            return Err(JournalError(format!(
                "{}: the journal is corrupt ({check}); move it away to start a new journal",
                path.display()
            )));
        }
        conn.execute_batch(SCHEMA).map_err(named)?;
        // A journal made by an earlier daemon gets the columns added since (its finished
        // commands count as not recorded: kept until recorded again; its workloads as not
        // drained).
        for (table, column, declaration) in [
            ("commands", "recorded", "INTEGER NOT NULL DEFAULT 0"),
            ("workloads", "drained_by", "TEXT"),
        ] {
            let has: bool = conn
                .query_row(
                    "SELECT count(*) > 0 FROM pragma_table_info(?1) WHERE name = ?2",
                    params![table, column],
                    |r| r.get(0),
                )
                .map_err(named)?;
            if !has {
                conn.execute_batch(&format!(
                    "ALTER TABLE {table} ADD COLUMN {column} {declaration}"
                ))
                .map_err(named)?;
            }
        }
        // It holds the commands' args, tenants' environment values among them: the agent's
        // alone, and so are its -wal and -shm files.
        for suffix in ["", "-wal", "-shm"] {
            use std::os::unix::fs::PermissionsExt;
            let file = PathBuf::from(format!("{}{suffix}", path.display()));
            match std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(JournalError(format!("{}: {e}", file.display())));
                }
                _ => {}
            }
        }

        let id: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = 'journal_id'", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(named)?;
        let id = match id {
            Some(id) => id,
            None => {
                let id = format!("jrn_{}", uuid::Uuid::now_v7().simple());
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('journal_id', ?1), ('created_at', ?2)",
                    // check-sql-now: allow (the agent's own SQLite journal; the control plane gets ages)
                    params![id, now().to_string()],
                )
                .map_err(named)?;
                id
            }
        };
        Ok(Journal {
            path,
            conn: Mutex::new(conn),
            id,
        })
    }

    /// The journal's id (`hello.journalId`).
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The node spec generation applied, as recorded.
    pub fn observed_generation(&self) -> Result<i64> {
        let v: Option<String> = self
            .conn()
            .query_row(
                "SELECT value FROM meta WHERE key = 'observed_generation'",
                [],
                |r| r.get(0),
            )
            .optional()?;
        Ok(v.and_then(|v| v.parse().ok()).unwrap_or(0))
    }

    pub fn set_observed_generation(&self, generation: i64) -> Result<()> {
        self.conn().execute(
            "INSERT INTO meta (key, value) VALUES ('observed_generation', ?1)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![generation.to_string()],
        )?;
        Ok(())
    }

    /// The command `id`, if the journal holds it.
    pub fn command(&self, id: &str) -> Result<Option<Entry>> {
        let conn = self.conn();
        let row = conn
            .query_row(
                "SELECT id, kind, args, retry_safe, step, executions, result FROM commands WHERE id = ?1",
                params![id],
                |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, bool>(3)?,
                        r.get::<_, String>(4)?,
                        r.get::<_, i64>(5)?,
                        r.get::<_, Option<String>>(6)?,
                    ))
                },
            )
            .optional()?;
        let Some((id, kind, args, retry_safe, step, executions, result)) = row else {
            return Ok(None);
        };
        let corrupt = |what: &str| JournalError(format!("command {id}: its {what} is unreadable"));
        Ok(Some(Entry {
            kind: CommandKind::parse(&kind).ok_or_else(|| corrupt("kind"))?,
            args: serde_json::from_str(&args).map_err(|_| corrupt("args"))?,
            retry_safe,
            step: Step::parse(&step),
            executions,
            result: result
                .map(|r| serde_json::from_str(&r).map_err(|_| corrupt("result")))
                .transpose()?,
            id,
        }))
    }

    /// Records a command that arrived (before its `ack`). One already there is left as it is.
    pub fn receive(
        &self,
        id: &str,
        kind: CommandKind,
        args: &serde_json::Value,
        retry_safe: bool,
    ) -> Result<()> {
        self.conn().execute(
            "INSERT INTO commands (id, kind, args, retry_safe, step, received_at)
             VALUES (?1, ?2, ?3, ?4, 'received', ?5) ON CONFLICT (id) DO NOTHING",
            // check-sql-now: allow (the agent's own SQLite journal; the control plane gets ages)
            params![id, kind.as_str(), args.to_string(), retry_safe, now()],
        )?;
        Ok(())
    }

    /// Marks a command started (before its work begins); `false` when it is not `received`
    /// (already started or finished: it must not begin again).
    pub fn start(&self, id: &str) -> Result<bool> {
        let n = self.conn().execute(
            "UPDATE commands SET step = 'started', executions = executions + 1
             WHERE id = ?1 AND step = 'received'",
            params![id],
        )?;
        Ok(n == 1)
    }

    /// Records a command's outcome (before its `result` is sent). An outcome already recorded
    /// is kept: the first one is the answer.
    pub fn finish(&self, id: &str, result: &FromDaemon) -> Result<FromDaemon> {
        let conn = self.conn();
        conn.execute(
            "UPDATE commands SET step = 'finished', result = ?2, finished_at = ?3
             WHERE id = ?1 AND step <> 'finished'",
            // check-sql-now: allow (the agent's own SQLite journal; the control plane gets ages)
            params![id, result.to_text(), now()],
        )?;
        let kept: Option<String> = conn
            .query_row(
                "SELECT result FROM commands WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?
            .flatten();
        Ok(kept
            .and_then(|k| serde_json::from_str(&k).ok())
            .unwrap_or_else(|| result.clone()))
    }

    /// The control plane holds command `id`'s result (`recorded`): it will not send the command
    /// again, so the row may go once it is old (`forget_recorded_commands`).
    pub fn result_recorded(&self, id: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE commands SET recorded = 1 WHERE id = ?1 AND step = 'finished'",
            params![id],
        )?;
        Ok(())
    }

    /// Deletes the finished commands whose result the control plane recorded, finished before
    /// `before` (seconds since the Unix epoch); how many. A command whose result is not
    /// recorded stays: sent again, it is answered from here, never run twice.
    pub fn forget_recorded_commands(&self, before: f64) -> Result<usize> {
        Ok(self.conn().execute(
            "DELETE FROM commands WHERE step = 'finished' AND recorded = 1 AND finished_at < ?1",
            params![before],
        )?)
    }

    /// The workloads that ended before `before` and that the control plane holds the end of
    /// (stopped at its request, or an exit it recorded): their container, working directory,
    /// log and row may go.
    pub fn ended_before(&self, before: f64) -> Result<Vec<Workload>> {
        self.workloads_where(
            "state IN ('stopped', 'exited') AND (state = 'stopped' OR exit_reported = 1) AND ended_at < ?1",
            params![before],
        )
    }

    /// Deletes an ended workload's row (after its files are gone).
    pub fn forget_workload(&self, instance: &str) -> Result<()> {
        self.conn().execute(
            "DELETE FROM workloads WHERE instance_id = ?1 AND state IN ('stopped', 'exited')",
            params![instance],
        )?;
        Ok(())
    }

    /// Forgets a command the gateway cancelled before it started.
    pub fn forget(&self, id: &str) -> Result<()> {
        self.conn().execute(
            "DELETE FROM commands WHERE id = ?1 AND step = 'received'",
            params![id],
        )?;
        Ok(())
    }

    /// How many times each command's work began (the proof that none ran twice).
    pub fn executions(&self) -> Result<Vec<(String, String, i64)>> {
        let conn = self.conn();
        let mut st = conn.prepare("SELECT id, kind, executions FROM commands ORDER BY id")?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    /// Records a workload about to start (before it is started).
    pub fn workload_starting(
        &self,
        instance: &str,
        command: &str,
        runtime: &str,
        devices: &[String],
        log_path: &str,
    ) -> Result<()> {
        let devices = serde_json::to_string(devices).unwrap_or_else(|_| "[]".into());
        self.conn().execute(
            "INSERT INTO workloads (instance_id, command_id, runtime, devices, state, log_path)
             VALUES (?1, ?2, ?3, ?4, 'starting', ?5)
             ON CONFLICT (instance_id) DO UPDATE SET command_id = excluded.command_id,
                 runtime = excluded.runtime, devices = excluded.devices, state = 'starting',
                 pid = NULL, start_time = NULL, container_id = NULL, exit_code = NULL,
                 signal = NULL, ended_at = NULL, exit_reported = 0, log_path = excluded.log_path",
            params![instance, command, runtime, devices, log_path],
        )?;
        Ok(())
    }

    /// Records that a workload runs, and how to find it again: `true` when it was `starting`.
    /// One stopped meanwhile (a drain or a stop found it starting, with nothing to signal yet)
    /// keeps its state, and only how to find it is recorded: the caller stops it.
    pub fn workload_running(
        &self,
        instance: &str,
        pid: Option<i32>,
        start_time: Option<u64>,
        container: Option<&str>,
    ) -> Result<bool> {
        let start_time = start_time.map(|t| t as i64);
        let n = self.conn().execute(
            "UPDATE workloads SET state = 'running', pid = ?2, start_time = ?3, container_id = ?4
             WHERE instance_id = ?1 AND state = 'starting'",
            params![instance, pid, start_time, container],
        )?;
        if n == 0 {
            self.conn().execute(
                "UPDATE workloads SET pid = ?2, start_time = ?3, container_id = ?4 WHERE instance_id = ?1",
                params![instance, pid, start_time, container],
            )?;
        }
        Ok(n == 1)
    }

    /// Moves a starting or running workload to `stopping` for drain `drain`: its end will be
    /// an exit (`workload_ended`). `false` when it was not starting or running (a stop its
    /// instance asked for is already under way: that one ends `stopped`).
    pub fn workload_draining(&self, instance: &str, drain: &str) -> Result<bool> {
        let n = self.conn().execute(
            "UPDATE workloads SET state = 'stopping', drained_by = ?2
              WHERE instance_id = ?1 AND state IN ('starting', 'running')",
            params![instance, drain],
        )?;
        Ok(n == 1)
    }

    /// Moves a workload to `state`; `false` when it was not in one of `from`.
    pub fn workload_move(
        &self,
        instance: &str,
        from: &[WorkloadState],
        state: WorkloadState,
    ) -> Result<bool> {
        let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        // An end (a start that failed, or never happened) gets its time, as `workload_ended`
        // records it: the cleanup finds ended workloads by it.
        let n = self.conn().execute(
            "UPDATE workloads SET state = ?2,
                    ended_at = CASE WHEN ?2 IN ('stopped', 'exited') THEN coalesce(ended_at, ?4) ELSE ended_at END
              WHERE instance_id = ?1 AND state IN (SELECT value FROM json_each(?3))",
            // check-sql-now: allow (the agent's own SQLite journal; the control plane gets ages)
            params![
                instance,
                state.as_str(),
                serde_json::to_string(&from).unwrap_or_default(),
                now()
            ],
        )?;
        Ok(n == 1)
    }

    /// Records that a workload ended: `stopped` when its instance asked it to stop, otherwise
    /// `exited` (on its own, or drained). The state it moved to; `None` when it had already ended.
    pub fn workload_ended(
        &self,
        instance: &str,
        exit_code: Option<i32>,
        signal: Option<i32>,
        ended_at: f64,
    ) -> Result<Option<WorkloadState>> {
        let state: Option<String> = self
            .conn()
            .query_row(
                "UPDATE workloads
                    SET state = CASE WHEN state = 'stopping' AND drained_by IS NULL THEN 'stopped' ELSE 'exited' END,
                        exit_code = ?2, signal = ?3, ended_at = ?4
                  WHERE instance_id = ?1 AND state IN ('starting', 'running', 'stopping')
              RETURNING state",
                params![instance, exit_code, signal, ended_at],
                |r| r.get(0),
            )
            .optional()?;
        Ok(state.map(|s| WorkloadState::parse(&s)))
    }

    /// The control plane holds a workload's exit.
    pub fn exit_reported(&self, instance: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE workloads SET exit_reported = 1 WHERE instance_id = ?1",
            params![instance],
        )?;
        Ok(())
    }

    pub fn workload(&self, instance: &str) -> Result<Option<Workload>> {
        Ok(self
            .workloads_where("instance_id = ?1", params![instance])?
            .pop())
    }

    /// The workloads that hold their devices.
    pub fn live_workloads(&self) -> Result<Vec<Workload>> {
        self.workloads_where("state IN ('starting', 'running', 'stopping')", [])
    }

    /// Exits the control plane has not confirmed.
    pub fn unreported_exits(&self) -> Result<Vec<Workload>> {
        self.workloads_where("state = 'exited' AND exit_reported = 0", [])
    }

    /// Every workload, for the metrics.
    pub fn all_workloads(&self) -> Result<Vec<Workload>> {
        self.workloads_where("1 = 1", [])
    }

    fn workloads_where(
        &self,
        condition: &str,
        params: impl rusqlite::Params,
    ) -> Result<Vec<Workload>> {
        let conn = self.conn();
        let mut st = conn.prepare(&format!(
            "SELECT instance_id, command_id, runtime, devices, pid, start_time, container_id, state,
                    exit_code, signal, ended_at, exit_reported, log_path
               FROM workloads WHERE {condition} ORDER BY instance_id"
        ))?;
        let rows = st.query_map(params, |r| {
            Ok(Workload {
                instance_id: r.get(0)?,
                command_id: r.get(1)?,
                runtime: r.get(2)?,
                devices: serde_json::from_str(&r.get::<_, String>(3)?).unwrap_or_default(),
                pid: r.get(4)?,
                start_time: r.get::<_, Option<i64>>(5)?.map(|t| t as u64),
                container_id: r.get(6)?,
                state: WorkloadState::parse(&r.get::<_, String>(7)?),
                exit_code: r.get(8)?,
                signal: r.get(9)?,
                ended_at: r.get(10)?,
                exit_reported: r.get(11)?,
                log_path: r.get(12)?,
            })
        })?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "compute-agent-journal-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    #[test]
    fn the_id_is_kept_until_the_directory_is_emptied() {
        let d = dir("id");
        let first = Journal::open(&d).expect("open").id().to_owned();
        assert!(first.starts_with("jrn_"));
        assert_eq!(Journal::open(&d).expect("again").id(), first);
        std::fs::remove_dir_all(&d).expect("empty");
        std::fs::create_dir_all(&d).expect("dir");
        assert_ne!(Journal::open(&d).expect("new").id(), first);
    }

    /// A workload stopped while it started (a drain found it `starting`, with nothing to signal)
    /// does not come back to `running` when its start completes: the journal says so, and keeps
    /// how to find it, so the agent stops it.
    #[test]
    fn a_workload_stopped_while_starting_is_not_running_again() {
        let d = dir("stopped-while-starting");
        let j = Journal::open(&d).expect("open");
        j.workload_starting("ins_1", "cmd_1", "process", &[], "/tmp/x.log")
            .expect("starting");
        assert!(
            j.workload_move("ins_1", &[WorkloadState::Starting], WorkloadState::Stopped)
                .expect("move")
        );
        assert!(
            !j.workload_running("ins_1", Some(42), Some(7), None)
                .expect("running")
        );
        let w = j.workload("ins_1").expect("read").expect("row");
        assert_eq!((w.state, w.pid), (WorkloadState::Stopped, Some(42)));
        j.workload_starting("ins_2", "cmd_2", "process", &[], "/tmp/y.log")
            .expect("starting");
        assert!(
            j.workload_running("ins_2", Some(43), Some(8), None)
                .expect("running")
        );
        assert_eq!(
            j.workload("ins_2").expect("read").expect("row").state,
            WorkloadState::Running
        );
    }

    #[test]
    fn a_command_starts_once_and_keeps_its_first_outcome() {
        let d = dir("steps");
        let j = Journal::open(&d).expect("open");
        j.receive("cmd_1", CommandKind::Noop, &serde_json::json!({}), false)
            .expect("receive");
        assert!(j.start("cmd_1").expect("start"));
        assert!(!j.start("cmd_1").expect("again"), "started twice");
        let first = FromDaemon::succeeded("cmd_1", serde_json::json!({ "n": 1 }));
        assert_eq!(j.finish("cmd_1", &first).expect("finish"), first);
        let second = FromDaemon::failed("cmd_1", "INTERRUPTED", "x");
        assert_eq!(j.finish("cmd_1", &second).expect("finish"), first);
        drop(j);
        let j = Journal::open(&d).expect("reopen");
        let e = j.command("cmd_1").expect("read").expect("held");
        assert_eq!(e.step, Step::Finished);
        assert_eq!(e.executions, 1);
        assert_eq!(e.result, Some(first));
    }

    /// What the cleanup may forget: finished commands whose result the control plane recorded,
    /// and ended workloads whose end it holds, both older than the cut; never a command whose
    /// result it may ask for again, a live workload, or an exit not yet reported.
    #[test]
    fn only_what_the_control_plane_holds_and_is_old_is_forgotten() {
        let d = dir("forget");
        let j = Journal::open(&d).expect("open");
        for id in ["cmd_recorded", "cmd_unrecorded", "cmd_running"] {
            j.receive(id, CommandKind::Noop, &serde_json::json!({}), false)
                .expect("receive");
            assert!(j.start(id).expect("start"));
        }
        for id in ["cmd_recorded", "cmd_unrecorded"] {
            j.finish(id, &FromDaemon::succeeded(id, serde_json::json!({})))
                .expect("finish");
        }
        j.result_recorded("cmd_recorded").expect("recorded");
        j.result_recorded("cmd_running")
            .expect("not finished: no effect");
        assert_eq!(
            j.forget_recorded_commands(now() - 60.0).expect("forget"),
            0,
            "nothing is old yet"
        );
        assert_eq!(j.forget_recorded_commands(now() + 60.0).expect("forget"), 1);
        assert!(j.command("cmd_recorded").expect("read").is_none());
        assert!(j.command("cmd_unrecorded").expect("read").is_some());
        assert!(j.command("cmd_running").expect("read").is_some());

        // A start that failed: moved from `starting` to `stopped`, with its end's time.
        j.workload_starting("failed_start", "c0", "process", &[], "/tmp/x.log")
            .expect("starting");
        assert!(
            j.workload_move(
                "failed_start",
                &[WorkloadState::Starting],
                WorkloadState::Stopped
            )
            .expect("move")
        );
        for (id, cmd) in [
            ("stopped", "c1"),
            ("exited_reported", "c2"),
            ("exited_unreported", "c3"),
            ("live", "c4"),
        ] {
            j.workload_starting(id, cmd, "process", &[], "/tmp/x.log")
                .expect("starting");
            assert!(
                j.workload_running(id, Some(1), Some(1), None)
                    .expect("running")
            );
        }
        j.workload_move(
            "stopped",
            &[WorkloadState::Running],
            WorkloadState::Stopping,
        )
        .expect("stopping");
        for id in ["stopped", "exited_reported", "exited_unreported"] {
            j.workload_ended(id, Some(0), None, now()).expect("ended");
        }
        j.exit_reported("exited_reported").expect("reported");
        let old: Vec<String> = j
            .ended_before(now() + 60.0)
            .expect("ended")
            .into_iter()
            .map(|w| w.instance_id)
            .collect();
        assert_eq!(old, ["exited_reported", "failed_start", "stopped"]);
        assert!(j.ended_before(now() - 60.0).expect("ended").is_empty());
        j.forget_workload("stopped").expect("forget");
        j.forget_workload("live").expect("a live one is kept");
        assert!(j.workload("stopped").expect("read").is_none());
        assert!(j.workload("live").expect("read").is_some());
    }

    /// A drained workload's end is an exit (its instance did not ask), recorded so at once and
    /// left unreported until the control plane confirms it, so a daemon that dies in the
    /// middle of a drain still reports it; one whose instance asked to stop ends `stopped`.
    #[test]
    fn a_drained_workload_ends_as_an_exit() {
        let d = dir("drained");
        let j = Journal::open(&d).expect("open");
        for (id, cmd) in [("drained", "c1"), ("asked", "c2")] {
            j.workload_starting(id, cmd, "process", &[], "/tmp/x.log")
                .expect("starting");
            assert!(
                j.workload_running(id, Some(1), Some(1), None)
                    .expect("running")
            );
        }
        assert!(
            j.workload_move("asked", &[WorkloadState::Running], WorkloadState::Stopping)
                .expect("stop")
        );
        assert!(j.workload_draining("drained", "cmd_drain").expect("drain"));
        assert!(
            !j.workload_draining("asked", "cmd_drain").expect("drain"),
            "its own stop goes on"
        );
        assert_eq!(
            j.workload_ended("drained", None, Some(15), now())
                .expect("ended"),
            Some(WorkloadState::Exited)
        );
        assert_eq!(
            j.workload_ended("asked", None, Some(15), now())
                .expect("ended"),
            Some(WorkloadState::Stopped)
        );
        let unreported: Vec<String> = j
            .unreported_exits()
            .expect("unreported")
            .into_iter()
            .map(|w| w.instance_id)
            .collect();
        assert_eq!(unreported, ["drained"]);
    }

    /// A journal written before `commands.recorded` and `workloads.drained_by` existed opens,
    /// and gains both columns.
    #[test]
    fn a_journal_from_before_the_recorded_column_opens() {
        let d = dir("old-schema");
        {
            let c = Connection::open(d.join("journal.sqlite3")).expect("sqlite");
            c.execute_batch(
                "CREATE TABLE commands (id TEXT PRIMARY KEY, kind TEXT NOT NULL, args TEXT NOT NULL,
                    retry_safe INTEGER NOT NULL, step TEXT NOT NULL CHECK (step IN ('received', 'started', 'finished')),
                    executions INTEGER NOT NULL DEFAULT 0, result TEXT, received_at REAL NOT NULL, finished_at REAL,
                    CHECK ((step = 'finished') = (result IS NOT NULL))) STRICT;
                 INSERT INTO commands (id, kind, args, retry_safe, step, received_at) VALUES ('cmd_old', 'noop', '{}', 0, 'received', 1);
                 CREATE TABLE workloads (instance_id TEXT PRIMARY KEY, command_id TEXT NOT NULL, runtime TEXT NOT NULL,
                    devices TEXT NOT NULL, pid INTEGER, start_time INTEGER, container_id TEXT,
                    state TEXT NOT NULL CHECK (state IN ('starting', 'running', 'stopping', 'exited', 'stopped')),
                    exit_code INTEGER, signal INTEGER, ended_at REAL, exit_reported INTEGER NOT NULL DEFAULT 0, log_path TEXT) STRICT;
                 INSERT INTO workloads (instance_id, command_id, runtime, devices, state) VALUES ('ins_old', 'cmd_old', 'process', '[]', 'running');",
            )
            .expect("old schema");
        }
        let j = Journal::open(&d).expect("open");
        assert!(j.command("cmd_old").expect("read").is_some());
        assert_eq!(j.forget_recorded_commands(now() + 60.0).expect("forget"), 0);
        // The workloads table gained `drained_by`: a drain marks the old workload.
        assert!(j.workload_draining("ins_old", "cmd_drain").expect("drain"));
        assert_eq!(
            j.workload_ended("ins_old", None, Some(15), now())
                .expect("ended"),
            Some(WorkloadState::Exited)
        );
    }

    #[test]
    fn a_corrupt_file_is_refused_with_its_path() {
        let d = dir("corrupt");
        std::fs::write(
            d.join("journal.sqlite3"),
            b"this is not a database, not at all",
        )
        .expect("write");
        let Err(e) = Journal::open(&d) else {
            panic!("a corrupt journal was opened");
        };
        assert!(e.0.contains("journal.sqlite3"), "{e}");
    }
}
