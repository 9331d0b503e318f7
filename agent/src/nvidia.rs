//! GPU operations through NVIDIA's tool `nvidia-smi` (`--nvidia-smi`): a GPU reset and a MIG
//! repartition. On a host without it, each fails with `UNSUPPORTED`: the agent never reports
//! success for work it did not do.

use std::path::Path;

use tokio::process::Command;

use crate::runtime::Failure;

async fn run(tool: &Path, args: &[&str]) -> Result<String, Failure> {
    let out = Command::new(tool)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => Failure::new(
                "UNSUPPORTED",
                format!(
                    "this host has no usable NVIDIA tool ({}: {e}); GPU operations need the NVIDIA driver",
                    tool.display()
                ),
            ),
            _ => Failure::new("GPU_TOOL_FAILED", format!("{}: {e}", tool.display())),
        })?;
    if !out.status.success() {
        return Err(Failure::new(
            "GPU_TOOL_FAILED",
            format!(
                "{} {}: {}{}",
                tool.display(),
                args.join(" "),
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn check_uuid(device: &str) -> Result<(), Failure> {
    if device.is_empty()
        || device.len() > 100
        || !device
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err(Failure::new(
            "BAD_ARGS",
            format!("device {device:.60?} is not a GPU UUID"),
        ));
    }
    Ok(())
}

/// Resets one GPU (`nvidia-smi --gpu-reset -i <uuid>`).
pub async fn reset(tool: &Path, device: &str) -> Result<serde_json::Value, Failure> {
    check_uuid(device)?;
    run(tool, &["--gpu-reset", "-i", device]).await?;
    Ok(serde_json::json!({ "device": device, "reset": true }))
}

/// Replaces a GPU's MIG instances with `layout` (profiles by name, in order): destroys the
/// compute and GPU instances, then creates the GPU instances with their default compute
/// instances (`nvidia-smi mig -cgi … -C`).
pub async fn set_mig_layout(
    tool: &Path,
    device: &str,
    layout: &[String],
) -> Result<serde_json::Value, Failure> {
    check_uuid(device)?;
    if layout.len() > 7
        || layout
            .iter()
            .any(|p| p.is_empty() || !p.chars().all(|c| c.is_ascii_alphanumeric() || c == '.'))
    {
        return Err(Failure::new(
            "BAD_ARGS",
            "layout is at most 7 MIG profile names such as 1g.10gb",
        ));
    }
    // The GPU must be there and in MIG mode (this also fails UNSUPPORTED without the tool).
    let mode = run(
        tool,
        &[
            "-i",
            device,
            "--query-gpu=mig.mode.current",
            "--format=csv,noheader",
        ],
    )
    .await?;
    if mode.trim() != "Enabled" {
        return Err(Failure::new(
            "MIG_DISABLED",
            format!("{device}: MIG mode is {:?}, not Enabled", mode.trim()),
        ));
    }
    // Destroying fails when there is nothing to destroy; only the creation must succeed.
    let _ = run(tool, &["mig", "-i", device, "-dci"]).await;
    let _ = run(tool, &["mig", "-i", device, "-dgi"]).await;
    if !layout.is_empty() {
        run(
            tool,
            &["mig", "-i", device, "-cgi", &layout.join(","), "-C"],
        )
        .await?;
    }
    Ok(serde_json::json!({ "device": device, "layout": layout }))
}
