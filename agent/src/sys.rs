//! The few things the agent asks of Linux directly: a process's start time and state from
//! `/proc`, signals to a process group, and a new session for a workload. The only `unsafe` of
//! the agent is here, each call with what makes it sound.

use std::path::Path;

/// What `/proc/<pid>/stat` says of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// The state letter (`R`, `S`, `Z`, …).
    pub state: char,
    pub pgrp: i32,
    /// When it started, in clock ticks since boot (field 22): with the pid, it names one
    /// process for the life of the machine.
    pub start_time: u64,
}

/// Reads `/proc/<pid>/stat`; `None` when there is no such process.
pub fn stat(pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

fn parse_stat(text: &str) -> Option<ProcStat> {
    // The command name (field 2) is in parentheses and may hold spaces and parentheses: the
    // fields after it start after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state), rest[2] field 5 (pgrp), rest[19] field 22 (starttime).
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        pgrp: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// Whether the process `pid` that started at `start_time` is still alive (a zombie is not:
/// it has ended and waits only to be reaped).
pub fn alive(pid: i32, start_time: u64) -> bool {
    stat(pid).is_some_and(|s| s.start_time == start_time && s.state != 'Z' && s.state != 'X')
}

/// Whether any live (not zombie) process is in process group `pgrp`.
pub fn group_alive(pgrp: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        e.file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .and_then(stat)
            .is_some_and(|s| s.pgrp == pgrp && s.state != 'Z' && s.state != 'X')
    })
}

/// The processes whose environment holds `needle` (`NAME=value`), for finding a workload the
/// agent started but died before recording.
pub fn processes_with_env(needle: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read(Path::new("/proc").join(pid.to_string()).join("environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()))
        })
        .collect()
}

/// Sends `signal` to every process of group `pgrp`; `false` when there is none.
#[allow(unsafe_code)]
pub fn signal_group(pgrp: i32, signal: i32) -> bool {
    if pgrp <= 1 {
        // Never the whole system (-1) or the agent's caller's group by mistake.
        return false;
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    unsafe { libc::kill(-pgrp, signal) == 0 }
}

/// Kills this process with SIGKILL (the crash tests' fault injection): nothing runs after it.
#[allow(unsafe_code)]
pub fn kill_self() -> ! {
    // SAFETY: kill(2) and getpid(2) take and return plain integers.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort()
}

/// Makes the calling process (a child between fork and exec) the leader of a new session
/// and process group, so that it outlives the agent and is signalled as one group.
#[allow(unsafe_code)]
pub fn new_session(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook runs in the child after fork, before exec; setsid(2) is
    // async-signal-safe and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The size of the file system holding `path`, in GiB.
#[allow(unsafe_code)]
pub fn disk_gib(path: &std::path::Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid C string and `st` a zeroed statvfs the call fills in.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some((st.f_blocks as u128 * st.f_frsize as u128 / (1u128 << 30)) as i64)
    }
}

/// Seconds since the Unix epoch by this machine's clock.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_a_tricky_name() {
        let line =
            "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        let s = parse_stat(line).expect("parsed");
        assert_eq!(s.state, 'S');
        assert_eq!(s.pgrp, 4242);
        assert_eq!(s.start_time, 987_654);
    }

    #[test]
    fn this_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = std::process::id() as i32;
        let s = stat(me).expect("own stat");
        assert!(alive(me, s.start_time));
        assert!(!alive(me, s.start_time + 1), "a reused pid would pass");
    }
}
