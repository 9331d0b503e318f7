//! The runtimes a workload runs under (`--runtime`): `process`, a child on the host in its own
//! session and process group, and `podman`, a container. Each starts a workload on exactly the
//! devices given, finds it again after the agent restarts, tells whether it still runs, and
//! stops it with a grace period.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use compute_protocol::RunInstanceArgs;
use tokio::process::Command;

use crate::journal::Workload;
use crate::sys;

/// The environment variable every workload carries with its instance's id (and the journal's,
/// below): how the agent finds a workload it started but died before recording.
pub const INSTANCE_ENV: &str = "COMPUTE_INSTANCE_ID";
pub const JOURNAL_ENV: &str = "COMPUTE_AGENT_JOURNAL";
/// The search path of a workload of the process runtime (the agent's own environment is
/// never passed on: it may hold the node's credential).
const WORKLOAD_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A command's failure: a stable code and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: &'static str,
    pub message: String,
}

impl Failure {
    pub fn new(code: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

/// Which runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// A child process on the host.
    Process,
    /// A podman container.
    Podman,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Process => "process",
            Kind::Podman => "podman",
        }
    }
}

/// The runtime's settings.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub kind: Kind,
    pub state_dir: PathBuf,
    /// The process runtime runs workloads as this user and group, when set.
    pub run_as: Option<(u32, u32)>,
    /// The podman program.
    pub podman: PathBuf,
    /// Arguments before `run` (`--runtime runc --cgroup-manager=cgroupfs` on hosts whose
    /// default OCI runtime does not work).
    pub podman_global_args: Vec<String>,
    /// Arguments of `podman run` before the image (`--network none`, ulimits, `--pull=never`).
    pub podman_run_args: Vec<String>,
    /// Where CDI specs live: NVIDIA devices are passed by CDI name when a spec names them.
    pub cdi_dirs: Vec<PathBuf>,
}

/// A workload that started.
pub struct Started {
    pub pid: Option<i32>,
    pub start_time: Option<u64>,
    pub container_id: Option<String>,
    /// The child to wait on (the process runtime, while this agent lives).
    pub child: Option<tokio::process::Child>,
}

/// How a workload ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Exit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl Exit {
    pub fn of(status: std::process::ExitStatus) -> Exit {
        use std::os::unix::process::ExitStatusExt;
        Exit {
            code: status.code(),
            signal: status.signal(),
        }
    }
}

/// The device ids a workload may see, from its allocation's atoms (the atom rule of
/// `consistency.md`): a whole GPU `<uuid>` and a time-slice slot `<uuid>/s<k>` are the GPU
/// `<uuid>`; a MIG instance `<uuid>/mig/<k>` needs the MIG device's own UUID, which only the
/// machine's inventory knows (`mig`: the k-th MIG instance of the GPU, in the order the
/// inventory lists them, which the control plane's inventory check holds to the registered
/// layout's order); one it does not know is refused rather than widened to the GPU.
pub fn visible_devices(
    atoms: &[String],
    mig: impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>, Failure> {
    let mut out: Vec<String> = Vec::new();
    for atom in atoms {
        if atom.is_empty()
            || atom.len() > 200
            || !atom
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./:".contains(c))
        {
            return Err(Failure::new(
                "BAD_ARGS",
                format!("device {atom:.60?} is not an atom name"),
            ));
        }
        let gpu = match atom.split_once('/') {
            None => atom.as_str(),
            Some((uuid, rest))
                if rest
                    .strip_prefix('s')
                    .is_some_and(|k| k.parse::<u32>().is_ok()) =>
            {
                uuid
            }
            Some((_, rest)) if rest.starts_with("mig/") => {
                let Some(uuid) = mig(atom) else {
                    return Err(Failure::new(
                        "MIG_UNMAPPED",
                        format!(
                            "{atom} is a MIG instance this machine's inventory does not list (NVML or --inventory); its MIG device UUID is unknown"
                        ),
                    ));
                };
                if !out.contains(&uuid) {
                    out.push(uuid);
                }
                continue;
            }
            Some(_) => {
                return Err(Failure::new(
                    "BAD_ARGS",
                    format!("device {atom:.60?} is not an atom name"),
                ));
            }
        };
        if !out.iter().any(|d| d == gpu) {
            out.push(gpu.to_owned());
        }
    }
    Ok(out)
}

/// Makes `dir` (and what is missing above it) with `mode`, and sets `mode` on it.
fn make_dir(dir: &Path, mode: u32) -> Result<(), Failure> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let failed =
        |e: std::io::Error| Failure::new("STATE_UNWRITABLE", format!("{}: {e}", dir.display()));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .map_err(failed)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(failed)
}

/// Writes `bytes` to `path`, readable by this user only.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn program_failure(program: &str, e: &std::io::Error) -> Failure {
    match e.kind() {
        std::io::ErrorKind::NotFound => Failure::new(
            "EXECUTABLE_NOT_FOUND",
            format!("{program}: no such program"),
        ),
        std::io::ErrorKind::PermissionDenied => Failure::new(
            "EXECUTABLE_NOT_PERMITTED",
            format!("{program}: permission denied"),
        ),
        _ => Failure::new("START_FAILED", format!("{program}: {e}")),
    }
}

impl Runtime {
    /// Removes the env files a `podman run` killed with the agent left in `work/` (each holds
    /// a tenant's environment values, and is removed as soon as podman has read it); run at
    /// start, before any workload starts. Returns how many it removed.
    pub fn remove_stale_env_files(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(self.state_dir.join("work")) else {
            return 0;
        };
        entries
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_type().is_ok_and(|t| t.is_file())
                    && e.path().extension().is_some_and(|x| x == "env")
            })
            .filter(|e| std::fs::remove_file(e.path()).is_ok())
            .count()
    }

    /// Removes what an ended workload left on the host: its container (with its writable
    /// layer), its working directory and its log. Each already gone counts as removed; an
    /// error names what could not be removed (the journal keeps the workload, to try again).
    pub async fn remove(&self, w: &Workload) -> Result<(), String> {
        if let Some(id) = &w.container_id {
            let out = self
                .podman()
                .args(["rm", "--ignore", id])
                .output()
                .await
                .map_err(|e| format!("podman rm {id}: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "podman rm {id}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        // Paths are made from the instance id only when it is one (a journal row from before
        // ids were checked is forgotten without touching the file system).
        if compute_protocol::is_instance_id(&w.instance_id) {
            let gone = |r: std::io::Result<()>, what: &Path| match r {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(format!("{}: {e}", what.display()))
                }
                _ => Ok(()),
            };
            let work = self.state_dir.join("work").join(&w.instance_id);
            gone(std::fs::remove_dir_all(&work), &work)?;
            let log = self.log_path(&w.instance_id);
            gone(std::fs::remove_file(&log), &log)?;
        }
        Ok(())
    }

    /// Where a workload's stdout and stderr go.
    pub fn log_path(&self, instance: &str) -> PathBuf {
        self.state_dir.join("logs").join(format!("{instance}.log"))
    }

    fn container_name(instance: &str) -> String {
        format!("compute-{instance}")
    }

    /// The environment a workload gets: its own, the visible devices, and the ids that find
    /// it again.
    fn environment(
        args: &RunInstanceArgs,
        visible: &[String],
        journal: &str,
    ) -> BTreeMap<String, String> {
        let mut env = args.env.clone();
        let devices = if visible.is_empty() {
            // No GPU in the allocation: none visible (not "all").
            "void".to_owned()
        } else {
            visible.join(",")
        };
        env.insert("CUDA_VISIBLE_DEVICES".into(), devices.clone());
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), devices);
        env.insert(INSTANCE_ENV.into(), args.instance_id.clone());
        env.insert(JOURNAL_ENV.into(), journal.to_owned());
        env
    }

    /// Starts a workload.
    pub async fn start(
        &self,
        args: &RunInstanceArgs,
        visible: &[String],
        journal: &str,
    ) -> Result<Started, Failure> {
        let log = self.log_path(&args.instance_id);
        if let Some(dir) = log.parent() {
            // Only the agent reads workloads' logs (they may hold a tenant's secrets).
            make_dir(dir, 0o700)?;
        }
        let env = Self::environment(args, visible, journal);
        match self.kind {
            Kind::Process => self.start_process(args, &env, &log),
            Kind::Podman => self.start_container(args, &env, visible, &log).await,
        }
    }

    fn start_process(
        &self,
        args: &RunInstanceArgs,
        env: &BTreeMap<String, String>,
        log: &Path,
    ) -> Result<Started, Failure> {
        let Some((program, rest)) = args.command.split_first() else {
            return Err(Failure::new(
                "BAD_ARGS",
                "the process runtime needs a command (it runs no image)",
            ));
        };
        use std::os::unix::fs::OpenOptionsExt;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(log)
            .map_err(|e| Failure::new("STATE_UNWRITABLE", format!("{}: {e}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(|e| Failure::new("STATE_UNWRITABLE", format!("{}: {e}", log.display())))?;
        // `work/` can be crossed, not listed, by the workloads' user; each working directory
        // is its workload's own.
        make_dir(&self.state_dir.join("work"), 0o711)?;
        let work = self.state_dir.join("work").join(&args.instance_id);
        make_dir(&work, 0o700)?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(&work, Some(uid), Some(gid)).map_err(|e| {
                Failure::new("STATE_UNWRITABLE", format!("chown {}: {e}", work.display()))
            })?;
        }
        let mut command = std::process::Command::new(program);
        command
            .args(rest)
            .env_clear()
            .env("PATH", WORKLOAD_PATH)
            .env("HOME", &work)
            .envs(env)
            .current_dir(&work)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if let Some((uid, gid)) = self.run_as {
            use std::os::unix::process::CommandExt;
            command.uid(uid).gid(gid);
        }
        sys::new_session(&mut command);
        let child = Command::from(command)
            .kill_on_drop(false)
            .spawn()
            .map_err(|e| program_failure(program, &e))?;
        let pid = child.id().map(|p| p as i32);
        let start_time = pid.and_then(sys::stat).map(|s| s.start_time);
        Ok(Started {
            pid,
            start_time,
            container_id: None,
            child: Some(child),
        })
    }

    fn podman(&self) -> Command {
        let mut c = Command::new(&self.podman);
        c.args(&self.podman_global_args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        c
    }

    /// Whether a CDI spec names NVIDIA GPUs (`nvidia.com/gpu`).
    fn cdi_has_nvidia(&self) -> bool {
        self.cdi_dirs.iter().any(|d| {
            std::fs::read_dir(d).is_ok_and(|entries| {
                entries.flatten().any(|e| {
                    std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("nvidia.com/gpu"))
                })
            })
        })
    }

    async fn start_container(
        &self,
        args: &RunInstanceArgs,
        env: &BTreeMap<String, String>,
        visible: &[String],
        log: &Path,
    ) -> Result<Started, Failure> {
        let mut c = self.podman();
        c.arg("run")
            .arg("--detach")
            .arg("--name")
            .arg(Self::container_name(&args.instance_id))
            .arg("--label")
            .arg(format!("compute.instance={}", args.instance_id))
            .arg("--log-driver")
            .arg("k8s-file")
            .arg("--log-opt")
            .arg(format!("path={}", log.display()));
        // Values go through a file only the agent can read (never podman's command line, which
        // other users of the host can read, nor podman's own environment, where a tenant's
        // `PATH` or `CONTAINERS_CONF` would steer podman itself). Removed once podman read it.
        if env.values().any(|v| v.contains('\n') || v.contains('\r')) {
            return Err(Failure::new(
                "BAD_ARGS",
                "the podman runtime cannot pass an environment value of several lines",
            ));
        }
        let env_file = self
            .state_dir
            .join("work")
            .join(format!("{}.env", args.instance_id));
        write_private(
            &env_file,
            env.iter()
                .map(|(k, v)| format!("{k}={v}\n"))
                .collect::<String>()
                .as_bytes(),
        )
        .map_err(|e| Failure::new("STATE_UNWRITABLE", format!("{}: {e}", env_file.display())))?;
        c.arg("--env-file").arg(&env_file);
        if !visible.is_empty() && self.cdi_has_nvidia() {
            for uuid in visible {
                c.arg("--device").arg(format!("nvidia.com/gpu={uuid}"));
            }
        }
        c.args(&self.podman_run_args)
            .arg(&args.image)
            .args(&args.command);
        let out = c.output().await;
        let _ = std::fs::remove_file(&env_file);
        let out =
            out.map_err(
                |e| match program_failure(&self.podman.display().to_string(), &e) {
                    f if f.code == "EXECUTABLE_NOT_FOUND" => Failure::new(
                        "RUNTIME_UNAVAILABLE",
                        format!("podman is not installed here ({})", self.podman.display()),
                    ),
                    f => f,
                },
            )?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let text = stderr.trim();
            let lower = text.to_lowercase();
            let code = if lower.contains("image not known")
                || lower.contains("no such image")
                || lower.contains("manifest unknown")
                || lower.contains("unable to pull")
            {
                "IMAGE_NOT_FOUND"
            } else {
                "START_FAILED"
            };
            // The failed container, if it was made, would keep the name.
            let _ = self
                .podman()
                .args(["rm", "--force", &Self::container_name(&args.instance_id)])
                .output()
                .await;
            return Err(Failure::new(code, format!("podman run: {text:.1500}")));
        }
        let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if id.is_empty() {
            return Err(Failure::new(
                "START_FAILED",
                "podman run printed no container id",
            ));
        }
        Ok(Started {
            pid: None,
            start_time: None,
            container_id: Some(id),
            child: None,
        })
    }

    /// Finds a workload of `instance` started under `journal` that the journal does not know
    /// (the agent died between starting it and recording it).
    pub async fn find(&self, instance: &str, journal: &str) -> Option<Started> {
        match self.kind {
            Kind::Process => {
                let needle = format!("{INSTANCE_ENV}={instance}");
                let journal = format!("{JOURNAL_ENV}={journal}");
                let pids = sys::processes_with_env(&needle);
                let with_journal = sys::processes_with_env(&journal);
                // The group leader: the process whose group is its own pid.
                let pid = pids.into_iter().find(|p| {
                    with_journal.contains(p) && sys::stat(*p).is_some_and(|s| s.pgrp == *p)
                })?;
                Some(Started {
                    pid: Some(pid),
                    start_time: sys::stat(pid).map(|s| s.start_time),
                    container_id: None,
                    child: None,
                })
            }
            Kind::Podman => {
                let out = self
                    .podman()
                    .args([
                        "ps",
                        "--all",
                        "--filter",
                        &format!("label=compute.instance={instance}"),
                        "--format",
                        "{{.ID}}",
                        "--no-trunc",
                    ])
                    .output()
                    .await
                    .ok()?;
                let id = String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .next()?
                    .trim()
                    .to_owned();
                (!id.is_empty()).then_some(Started {
                    pid: None,
                    start_time: None,
                    container_id: Some(id),
                    child: None,
                })
            }
        }
    }

    /// Whether the workload still runs.
    pub async fn running(&self, w: &Workload) -> bool {
        if let Some(id) = &w.container_id {
            let out = self
                .podman()
                .args(["inspect", "--format", "{{.State.Running}}", id])
                .output()
                .await;
            return out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "true");
        }
        match (w.pid, w.start_time) {
            (Some(pid), Some(start)) => sys::alive(pid, start),
            (Some(pid), None) => sys::stat(pid).is_some_and(|s| s.state != 'Z'),
            _ => false,
        }
    }

    /// Waits for a workload that is not this process's child to end: `podman wait` for a
    /// container (its exit code, even for one that ended while the agent was down), or
    /// watching `/proc` for a process (whose exit code only its parent learns).
    pub async fn wait_adopted(&self, w: &Workload) -> Exit {
        if let Some(id) = &w.container_id {
            let out = self.podman().args(["wait", id]).output().await;
            if let Ok(o) = out
                && o.status.success()
            {
                let code = String::from_utf8_lossy(&o.stdout)
                    .trim()
                    .parse::<i32>()
                    .ok();
                return Exit { code, signal: None };
            }
            while self.running(w).await {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            return Exit::default();
        }
        while self.running(w).await {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Exit::default()
    }

    /// Stops a workload: SIGTERM to its process group (or `podman stop`), `grace`, then
    /// SIGKILL; done only when it is gone. The signal that ended it.
    pub async fn stop(&self, w: &Workload, grace: Duration) -> Result<i32, Failure> {
        if let Some(id) = &w.container_id {
            let out = self
                .podman()
                .args(["stop", "--time", &grace.as_secs().to_string(), id])
                .output()
                .await
                .map_err(|e| Failure::new("RUNTIME_UNAVAILABLE", format!("podman stop: {e}")))?;
            if !out.status.success() && self.running(w).await {
                return Err(Failure::new(
                    "STOP_FAILED",
                    format!(
                        "podman stop: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ),
                ));
            }
            for _ in 0..50 {
                if !self.running(w).await {
                    return Ok(libc::SIGTERM);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            return Err(Failure::new(
                "STOP_FAILED",
                format!("container {id} still runs after podman stop"),
            ));
        }
        let Some(pgrp) = w.pid else {
            return Ok(0);
        };
        // Gone means the leader and every other process of its group.
        let gone = async || !self.running(w).await && !sys::group_alive(pgrp);
        if gone().await {
            return Ok(0);
        }
        sys::signal_group(pgrp, libc::SIGTERM);
        let deadline = tokio::time::Instant::now() + grace;
        while tokio::time::Instant::now() < deadline {
            if gone().await {
                return Ok(libc::SIGTERM);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        sys::signal_group(pgrp, libc::SIGKILL);
        for _ in 0..200 {
            if gone().await {
                return Ok(libc::SIGKILL);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(Failure::new(
            "STOP_FAILED",
            format!("process group {pgrp} still runs 10 s after SIGKILL"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_files_left_by_an_interrupted_run_are_removed_at_start() {
        let dir = std::env::temp_dir().join(format!("compute-agent-env-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("work/ins_1")).expect("dirs");
        std::fs::write(dir.join("work/ins_1.env"), "SECRET=1\n").expect("env");
        std::fs::write(dir.join("work/ins_1/keep.env"), "mine").expect("a workload's file");
        let runtime = Runtime {
            kind: Kind::Podman,
            state_dir: dir.clone(),
            run_as: None,
            podman: "podman".into(),
            podman_global_args: vec![],
            podman_run_args: vec![],
            cdi_dirs: vec![],
        };
        assert_eq!(runtime.remove_stale_env_files(), 1);
        assert!(!dir.join("work/ins_1.env").exists());
        assert!(dir.join("work/ins_1/keep.env").exists(), "only work/*.env");
        assert_eq!(runtime.remove_stale_env_files(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn atoms_map_to_exactly_their_gpus() {
        let atoms = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // A MIG instance is its own MIG UUID, from the inventory; never its whole GPU.
        let inventory = |atom: &str| (atom == "GPU-a/mig/1").then(|| "MIG-a1".to_owned());
        assert_eq!(
            visible_devices(&atoms(&["GPU-a/mig/1", "GPU-b"]), inventory).expect("mapped"),
            vec!["MIG-a1".to_owned(), "GPU-b".to_owned()]
        );
        assert_eq!(
            visible_devices(&atoms(&["GPU-a/mig/0"]), inventory)
                .expect_err("not in the inventory")
                .code,
            "MIG_UNMAPPED"
        );
        assert_eq!(
            visible_devices(&atoms(&["GPU-a", "GPU-b/s0", "GPU-b/s1"]), |_| None).expect("mapped"),
            vec!["GPU-a".to_owned(), "GPU-b".to_owned()]
        );
        assert_eq!(
            visible_devices(&atoms(&["GPU-a/mig/0"]), |_| None)
                .expect_err("refused")
                .code,
            "MIG_UNMAPPED"
        );
        assert_eq!(
            visible_devices(&atoms(&["GPU-a,GPU-b"]), |_| None)
                .expect_err("refused")
                .code,
            "BAD_ARGS",
            "a comma would widen CUDA_VISIBLE_DEVICES"
        );
    }
}
