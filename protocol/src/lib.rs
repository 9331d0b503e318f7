//! `compute-agent.v1`, the protocol between node daemons and the control plane's gateway
//! (`docs/agent-protocol.md` is its specification), as typed messages: [`FromDaemon`] and
//! [`ToDaemon`]. The gateway (`compute-api`), the node daemon (`compute-agent`) and the
//! simulator (`compute-sim`) all read and write these types, so the three cannot drift.
//!
//! Every message is a JSON object with a `type`; unknown types and unknown fields are refused
//! when parsed ([`FromDaemon::parse`], [`ToDaemon::parse`]), which the gateway turns into a close
//! with `4400`. This crate knows no SQL, no GraphQL and nothing of the domain.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[cfg(feature = "client")]
pub mod client;

/// The WebSocket subprotocol name of this version.
pub const PROTOCOL: &str = "compute-agent.v1";
/// The largest message either side sends (a larger one closes the connection with `1009`).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;
/// The largest `args`, `output` or `progress` object, serialized.
pub const MAX_OBJECT_BYTES: usize = 16 * 1024;

/// A message from a daemon to the gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
pub enum FromDaemon {
    /// The first message of a session, exactly once.
    #[serde(rename_all = "camelCase")]
    Hello {
        /// The node token, unless it is sent as `Authorization: Bearer` on the upgrade.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        node_id: String,
        daemon_version: String,
        /// The id of the daemon's durable journal; a new one means it lost its memory.
        journal_id: String,
        #[serde(default)]
        observed_generation: i64,
    },
    /// A sign of life, every `heartbeatSeconds` when nothing else is sent.
    Heartbeat {},
    /// The daemon applied a new spec generation.
    #[serde(rename_all = "camelCase")]
    Status { observed_generation: i64 },
    /// Before a clean shutdown.
    Bye {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// The daemon recorded a command it had not finished before, and waits for `proceed`.
    #[serde(rename_all = "camelCase")]
    Ack { command_id: String },
    /// A running command's progress (a JSON object of at most 16 KiB).
    #[serde(rename_all = "camelCase")]
    Progress { command_id: String, progress: Value },
    /// A command ended (or the journal says it already had).
    #[serde(rename_all = "camelCase")]
    Result {
        command_id: String,
        outcome: Outcome,
        #[serde(default = "empty_object")]
        output: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_code: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_message: Option<String>,
        /// W3C trace context: the command's `traceparent` as the daemon continued it (its own
        /// span's, or the one it received), so the gateway records the result in the trace.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        traceparent: Option<String>,
    },
    /// An instance's workload ended without its instance asking (it exited, a signal killed
    /// it, or a `drain_workloads` stopped it). Sent until the gateway answers `exitRecorded`,
    /// in this session or a later one.
    #[serde(rename_all = "camelCase")]
    Exited {
        instance_id: String,
        /// The exit code, when the workload exited.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exit_code: Option<i32>,
        /// The signal that ended it, when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<i32>,
        /// How long ago it ended, in seconds (an age, not a time: the database computes
        /// the time, so the daemon's clock does not matter).
        exited_seconds_ago: f64,
    },
    /// Instead of `hello`, the first message of a machine that is not a node yet: a one-time
    /// join token and what the machine has. The gateway answers `joined` (or `error` with a
    /// `JOIN_TOKEN_*` code) and closes; the daemon then opens sessions with `hello` and the
    /// credential it received.
    #[serde(rename_all = "camelCase")]
    Join {
        token: String,
        /// The pool the operator means the machine for: refused `JOIN_TOKEN_OTHER_POOL` when
        /// the token is another pool's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pool_id: Option<String>,
        daemon_version: String,
        inventory: Inventory,
    },
    /// What the machine has: sent after `welcome` and again whenever it changes. The gateway
    /// compares it with the registration and answers `inventoryChecked`.
    #[serde(rename_all = "camelCase")]
    Inventory { inventory: Inventory },
    /// One GPU's health, as the daemon's watch of the driver sees it: sent after `welcome` for
    /// each GPU and again whenever it changes. Answered with `healthRecorded`.
    #[serde(rename_all = "camelCase")]
    DeviceHealth {
        uuid: String,
        health: GpuHealth,
        /// Why, when it is not healthy ("XID 79: GPU has fallen off the bus").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

/// A machine's inventory: its scalars and its GPUs, as discovered (NVML and the operating
/// system) or declared (`--inventory FILE`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Inventory {
    pub hostname: String,
    pub vcpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    #[serde(default)]
    pub gpus: Vec<GpuInventory>,
}

/// One GPU of an [`Inventory`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuInventory {
    pub uuid: String,
    #[serde(default = "nvidia")]
    pub vendor: String,
    pub model: String,
    pub memory_mib: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// The NUMA node the GPU's PCI device is attached to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i32>,
    /// The GPU's NVLink domain: GPUs joined by NVLink (directly or through NVSwitches) share it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_domain: Option<String>,
    /// Whether MIG mode is on.
    #[serde(default)]
    pub mig_enabled: bool,
    /// The MIG instances, when MIG mode is on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<MigInstance>,
}

fn nvidia() -> String {
    "nvidia".to_owned()
}

/// A MIG instance of a [`GpuInventory`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigInstance {
    pub uuid: String,
    /// Its profile, as `nvidia-smi` names it (`1g.10gb`).
    pub profile: String,
}

/// A GPU's health as a daemon reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuHealth {
    Healthy,
    Unhealthy,
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Succeeded,
    Failed,
}

fn empty_object() -> Value {
    Value::Object(serde_json::Map::new())
}

/// A message from the gateway to a daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
pub enum ToDaemon {
    /// The answer to an accepted `hello`.
    #[serde(rename_all = "camelCase")]
    Welcome {
        session_epoch: i64,
        gateway_id: String,
        heartbeat_seconds: f64,
        protocol: String,
    },
    /// A message was refused; the session goes on.
    #[serde(rename_all = "camelCase")]
    Error {
        code: String,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        command_id: Option<String>,
    },
    /// A command dispatched to this session (each at most once per session).
    #[serde(rename_all = "camelCase")]
    Command {
        command_id: String,
        kind: CommandKind,
        args: Value,
        retry_safe: bool,
        attempt: i32,
        /// W3C trace context of the dispatch, when the control plane traces it: the daemon's
        /// work on the command continues it, and its `result` carries it back.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        traceparent: Option<String>,
    },
    /// In answer to `ack`: run it now.
    #[serde(rename_all = "camelCase")]
    Proceed { command_id: String },
    /// In answer to `ack`: do not run it.
    #[serde(rename_all = "camelCase")]
    Cancelled { command_id: String, reason: String },
    /// In answer to `result`.
    #[serde(rename_all = "camelCase")]
    Recorded { command_id: String, recorded: bool },
    /// In answer to `exited`: the control plane holds it (`recorded` is `false` when the
    /// instance is unknown on this node or had already ended: nothing changed, stop sending it).
    #[serde(rename_all = "camelCase")]
    ExitRecorded { instance_id: String, recorded: bool },
    /// In answer to `join`: the machine is node `nodeId` of pool `poolId`; `credential` opens
    /// its sessions from now on (keep it secret: it is shown once).
    #[serde(rename_all = "camelCase")]
    Joined {
        node_id: String,
        pool_id: String,
        credential: String,
    },
    /// In answer to `inventory`: what differs from the registration (empty when nothing does).
    #[serde(rename_all = "camelCase")]
    InventoryChecked { differences: Vec<String> },
    /// In answer to `deviceHealth`: whether the GPU is this node's (`false`: unknown here).
    #[serde(rename_all = "camelCase")]
    HealthRecorded { uuid: String, recorded: bool },
}

/// What a command asks a daemon to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommandKind {
    /// Apply the node's spec at `args.generation`, then report it in `status`.
    ApplySpec,
    /// Reset one GPU (`args.device`).
    ResetGpu,
    /// Repartition a GPU's MIG instances (`args.device`, `args.layout`).
    SetMigLayout,
    /// Stop every workload on the node.
    DrainWorkloads,
    /// Start an instance's workload ([`RunInstanceArgs`]).
    RunInstance,
    /// Stop an instance's workload ([`StopInstanceArgs`]).
    StopInstance,
    /// Does nothing.
    Noop,
}

impl CommandKind {
    /// The name on the wire (`run_instance`).
    pub fn as_str(self) -> &'static str {
        match self {
            CommandKind::ApplySpec => "apply_spec",
            CommandKind::ResetGpu => "reset_gpu",
            CommandKind::SetMigLayout => "set_mig_layout",
            CommandKind::DrainWorkloads => "drain_workloads",
            CommandKind::RunInstance => "run_instance",
            CommandKind::StopInstance => "stop_instance",
            CommandKind::Noop => "noop",
        }
    }

    /// The kind named `name` on the wire.
    pub fn parse(name: &str) -> Option<CommandKind> {
        serde_json::from_value(Value::String(name.to_owned())).ok()
    }
}

impl std::fmt::Display for CommandKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `args` of `run_instance`, as the control plane's instance workflow writes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunInstanceArgs {
    pub instance_id: String,
    /// A container image (the podman runtime); the process runtime records it only.
    pub image: String,
    /// The program and its arguments (the image's entry point when empty, podman only).
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The allocation's atoms: GPU UUIDs, `<uuid>/mig/<k>`, `<uuid>/s<k>`.
    #[serde(default)]
    pub devices: Vec<String>,
}

impl RunInstanceArgs {
    /// Whether these args are safe to act on: the instance id names files and a container, the
    /// image is a registry reference (never a podman option or transport), the env names are
    /// variable names. The control plane checks the same before it writes a command; the
    /// daemon checks again, for args an operator wrote by hand (`runCommand`) or a control
    /// plane it should not trust with the host.
    pub fn problem(&self) -> Option<String> {
        if !is_instance_id(&self.instance_id) {
            return Some(format!(
                "instanceId {:?} is not 1 to 128 of [A-Za-z0-9_-] starting with a letter or digit",
                self.instance_id
            ));
        }
        if let Err(why) = check_image_reference(&self.image) {
            return Some(format!("image {:?}: {why}", self.image));
        }
        if let Some(k) = self.env.keys().find(|k| !is_env_name(k)) {
            return Some(format!(
                "env name {k:?} is not [A-Za-z_][A-Za-z0-9_]* of at most 128 characters"
            ));
        }
        None
    }
}

/// An instance id as the daemon accepts it: 1 to 128 of `[A-Za-z0-9_-]`, the first a letter or
/// a digit (`ins_…` ids are); no `/` or `.`, so it names a file and a container, never a path.
pub fn is_instance_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id.starts_with(|c: char| c.is_ascii_alphanumeric())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// An environment variable's name: `[A-Za-z_][A-Za-z0-9_]*`, at most 128 characters.
pub fn is_env_name(k: &str) -> bool {
    (1..=128).contains(&k.len())
        && k.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Checks a container image reference against the distribution grammar: `[domain[:port]/]path
/// [:tag][@algorithm:hex]`, path components lowercase letters and digits joined by `.`, `_`,
/// `__` or dashes, at most 500 characters. What it rules out matters more than what it lets
/// in: an image is the argument after podman's options, so one starting with `-` would be an
/// option (`--privileged`), and a transport (`dir:/`, `docker-archive:/…`) would read the
/// host's files.
pub fn check_image_reference(image: &str) -> Result<(), &'static str> {
    if image.is_empty() || image.len() > 500 {
        return Err("an image reference is 1 to 500 characters");
    }
    let (name_tag, digest) = match image.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (image, None),
    };
    if let Some(d) = digest {
        let (alg, hex) = d
            .split_once(':')
            .ok_or("a digest is algorithm:hex, such as sha256:…")?;
        let alg_ok = !alg.is_empty()
            && alg.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
            && alg.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
            && alg
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+._-".contains(c));
        if !alg_ok || hex.len() < 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err("a digest is algorithm:hex, such as sha256:…");
        }
    }
    // A tag follows the last `:` after the last `/` (a `:` before it is a registry's port).
    let after_slash = name_tag.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match name_tag[after_slash..].rfind(':') {
        Some(i) => (
            &name_tag[..after_slash + i],
            Some(&name_tag[after_slash + i + 1..]),
        ),
        None => (name_tag, None),
    };
    if let Some(t) = tag {
        let ok = (1..=128).contains(&t.len())
            && t.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
        if !ok {
            return Err("a tag is 1 to 128 of [A-Za-z0-9_.-], not starting with . or -");
        }
    }
    let mut parts: Vec<&str> = name.split('/').collect();
    if parts.len() > 1 {
        let first = parts[0];
        if first.contains('.') || first.contains(':') || first == "localhost" {
            let (host, port) = match first.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (first, None),
            };
            let label_ok = |l: &str| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && l.ends_with(|c: char| c.is_ascii_alphanumeric())
                    && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            };
            if !host.split('.').all(label_ok)
                || port.is_some_and(|p| {
                    !p.chars().all(|c| c.is_ascii_digit()) || p.parse::<u16>().is_err()
                })
            {
                return Err("a registry is host[:port], such as registry.example:5000");
            }
            parts.remove(0);
        }
    }
    let component_ok = |c: &str| {
        let b = c.as_bytes();
        if b.is_empty() || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric()
        {
            return false;
        }
        // Separators between runs of [a-z0-9]: `.`, `_`, `__` or any number of `-`.
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_lowercase() || b[i].is_ascii_digit() {
                i += 1;
                continue;
            }
            let start = i;
            while i < b.len() && !(b[i].is_ascii_lowercase() || b[i].is_ascii_digit()) {
                i += 1;
            }
            let sep = &c[start..i];
            let dashes = sep.chars().all(|ch| ch == '-');
            if !(sep == "." || sep == "_" || sep == "__" || dashes) {
                return false;
            }
        }
        true
    };
    if parts.is_empty() || !parts.iter().all(|p| component_ok(p)) {
        return Err(
            "a repository is lowercase letters and digits joined by ., _, __ or -, in /-separated parts",
        );
    }
    Ok(())
}

/// `args` of `stop_instance`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StopInstanceArgs {
    pub instance_id: String,
    /// Seconds between SIGTERM and SIGKILL (30 when not given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_seconds: Option<f64>,
}

/// `args` of `reset_gpu`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResetGpuArgs {
    /// The GPU's UUID.
    pub device: String,
}

/// `args` of `set_mig_layout`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetMigLayoutArgs {
    /// The GPU's UUID.
    pub device: String,
    /// The MIG profiles to create, in order (`1g.10gb`, …).
    pub layout: Vec<String>,
}

/// `args` of `apply_spec`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplySpecArgs {
    pub generation: i64,
}

/// `args` of `drain_workloads`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DrainArgs {
    /// Seconds between SIGTERM and SIGKILL for each workload (30 when not given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_seconds: Option<f64>,
}

/// Whether `code` is a well-formed `errorCode`: 1 to 64 of `A-Z` and `_`.
pub fn valid_error_code(code: &str) -> bool {
    (1..=64).contains(&code.len()) && code.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
}

impl FromDaemon {
    /// Parses one text frame; unknown types and fields are errors.
    pub fn parse(text: &str) -> Result<FromDaemon, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The frame's text.
    pub fn to_text(&self) -> String {
        // Serializing these types cannot fail: every field is a string, number, bool or JSON value.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A `result` that succeeded with `output`.
    pub fn succeeded(command_id: impl Into<String>, output: Value) -> FromDaemon {
        FromDaemon::Result {
            command_id: command_id.into(),
            outcome: Outcome::Succeeded,
            output,
            error_code: None,
            error_message: None,
            traceparent: None,
        }
    }

    /// This message with `traceparent` when it is a `result` (any other is returned as it is).
    pub fn with_traceparent(mut self, tp: Option<String>) -> FromDaemon {
        if let FromDaemon::Result { traceparent, .. } = &mut self {
            *traceparent = tp;
        }
        self
    }

    /// A `result` that failed with `code` and `message`.
    pub fn failed(
        command_id: impl Into<String>,
        code: impl Into<String>,
        message: impl Into<String>,
    ) -> FromDaemon {
        FromDaemon::Result {
            command_id: command_id.into(),
            outcome: Outcome::Failed,
            output: empty_object(),
            error_code: Some(code.into()),
            error_message: Some(message.into()),
            traceparent: None,
        }
    }
}

impl ToDaemon {
    /// Parses one text frame; unknown types and fields are errors.
    pub fn parse(text: &str) -> Result<ToDaemon, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The frame's text.
    pub fn to_text(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The command this message is about, if any.
    pub fn command_id(&self) -> Option<&str> {
        match self {
            ToDaemon::Command { command_id, .. }
            | ToDaemon::Proceed { command_id }
            | ToDaemon::Cancelled { command_id, .. }
            | ToDaemon::Recorded { command_id, .. } => Some(command_id),
            ToDaemon::Error { command_id, .. } => command_id.as_deref(),
            ToDaemon::Welcome { .. }
            | ToDaemon::ExitRecorded { .. }
            | ToDaemon::Joined { .. }
            | ToDaemon::InventoryChecked { .. }
            | ToDaemon::HealthRecorded { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn images_are_references_never_options_or_transports() {
        for ok in [
            "busybox",
            "x",
            "library/busybox:1.36",
            "registry.example/train:1",
            "localhost/compute-test-busybox:1",
            "registry.example:5000/a/b__c/d-e.f_g:v1.2-rc_3",
            "Registry.Example/team/img@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(check_image_reference(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "--privileged",
            "-v=/:/host",
            "--volume=/:/host",
            "dir:/etc",
            "docker-archive:/root/x.tar",
            "oci-archive:/tmp/x",
            "docker://busybox",
            "Busybox",
            "a//b",
            "a/b/",
            "img:",
            "img:-x",
            "img:.x",
            "img@sha256:xyz",
            "host:99999/img",
            "bad_host.example/img",
            "img name",
            "img\n",
            "ümlaut",
        ] {
            assert!(check_image_reference(bad).is_err(), "{bad} was accepted");
        }
        assert!(check_image_reference(&"a".repeat(501)).is_err());
        assert!(is_instance_id("ins_0193a1b2c3"));
        assert!(is_instance_id("not-an-instance"));
        for bad in ["", "../../etc", "a/b", ".", "-rf", "a.b", "x\n"] {
            assert!(!is_instance_id(bad), "{bad}");
        }
        let args = |id: &str, image: &str, env: &[(&str, &str)]| RunInstanceArgs {
            instance_id: id.into(),
            image: image.into(),
            command: vec![],
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            devices: vec![],
        };
        assert_eq!(args("ins_1", "busybox", &[("A_B", "v")]).problem(), None);
        assert!(
            args("../x", "busybox", &[])
                .problem()
                .unwrap_or_default()
                .contains("instanceId")
        );
        assert!(
            args("ins_1", "--privileged", &[])
                .problem()
                .unwrap_or_default()
                .contains("image")
        );
        assert!(
            args("ins_1", "busybox", &[("A\nB", "v")])
                .problem()
                .unwrap_or_default()
                .contains("env name")
        );
    }

    #[test]
    fn messages_keep_their_wire_names() {
        let hello = FromDaemon::parse(
            r#"{"type":"hello","nodeId":"node_1","daemonVersion":"a/1","journalId":"j"}"#,
        )
        .expect("hello");
        assert_eq!(
            hello,
            FromDaemon::Hello {
                token: None,
                node_id: "node_1".into(),
                daemon_version: "a/1".into(),
                journal_id: "j".into(),
                observed_generation: 0
            }
        );
        let c = ToDaemon::Command {
            command_id: "cmd_1".into(),
            kind: CommandKind::RunInstance,
            args: json!({}),
            retry_safe: false,
            attempt: 1,
            traceparent: None,
        };
        let v: Value = serde_json::from_str(&c.to_text()).expect("json");
        assert_eq!(
            v,
            json!({"type": "command", "commandId": "cmd_1", "kind": "run_instance", "args": {}, "retrySafe": false, "attempt": 1})
        );
        let r: Value =
            serde_json::from_str(&FromDaemon::failed("cmd_1", "X", "y").to_text()).expect("json");
        assert_eq!(
            r,
            json!({"type": "result", "commandId": "cmd_1", "outcome": "failed", "output": {}, "errorCode": "X", "errorMessage": "y"})
        );
        let e: Value = serde_json::from_str(
            &ToDaemon::ExitRecorded {
                instance_id: "ins_1".into(),
                recorded: true,
            }
            .to_text(),
        )
        .expect("json");
        assert_eq!(e["type"], "exitRecorded");
    }

    #[test]
    fn unknown_types_and_fields_are_refused() {
        assert!(FromDaemon::parse(r#"{"type":"heartbeat","extra":1}"#).is_err());
        assert!(FromDaemon::parse(r#"{"type":"reboot"}"#).is_err());
        assert!(FromDaemon::parse(r#"{"commandId":"cmd_1"}"#).is_err());
        assert!(ToDaemon::parse(r#"{"type":"proceed","commandId":"c","x":1}"#).is_err());
        assert!(
            serde_json::from_value::<RunInstanceArgs>(
                json!({"instanceId": "i", "image": "x", "gpus": 1})
            )
            .is_err()
        );
        for kind in [
            CommandKind::ApplySpec,
            CommandKind::ResetGpu,
            CommandKind::SetMigLayout,
            CommandKind::DrainWorkloads,
            CommandKind::RunInstance,
            CommandKind::StopInstance,
            CommandKind::Noop,
        ] {
            assert_eq!(CommandKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(CommandKind::parse("reboot"), None);
    }

    #[test]
    fn error_codes() {
        assert!(valid_error_code("DEVICE_OVERLAP"));
        assert!(!valid_error_code(""));
        assert!(!valid_error_code("lower"));
        assert!(!valid_error_code(&"A".repeat(65)));
    }
}
