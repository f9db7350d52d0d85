//! The submitted job: its spec, limits on it, and the `jobs/<id>` record (Flink's JobGraphStore).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Limits on what a submission may carry; documented in the README.
pub mod limits {
    pub const ID_MAX: usize = 128;
    pub const COMMAND_ARGS_MAX: usize = 256;
    pub const ARG_BYTES_MAX: usize = 8 * 1024;
    pub const ENV_ENTRIES_MAX: usize = 128;
    pub const ENV_VALUE_BYTES_MAX: usize = 8 * 1024;
    pub const SPEC_BYTES_MAX: usize = 64 * 1024;
    pub const MAX_ATTEMPTS_MAX: u32 = 100;
    pub const TIMEOUT_MAX_SECS: u64 = 7 * 24 * 3600;
    pub const SELECTOR_ENTRIES_MAX: usize = 32;
    pub const LABEL_BYTES_MAX: usize = 128;
    pub const CLEANUP_STEPS_MAX: usize = 16;
    pub const STEP_NAME_MAX: usize = 32;
}

/// Step names the cleanup pipeline uses itself: `command` is `cleanup_command`'s step,
/// `folder` and `finish` are the built-in stages after every step.
pub const RESERVED_STEP_NAMES: &[&str] = &["command", "folder", "finish"];

pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// What to run. Zero values in the request mean "the default" and are resolved before storing,
/// so the stored spec says exactly what will happen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cleanup_command: Vec<String>,
    pub max_attempts: u32,
    #[serde(with = "duration_secs")]
    pub timeout: Duration,
    /// Exact labels a worker must all have to run the job. Left out of the stored JSON when
    /// empty, so specs (and hashes) from before selectors are unchanged.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub worker_selector: BTreeMap<String, String>,
    /// Named cleanup steps, after `cleanup_command` (the ordered step `command`). Left out of
    /// the stored JSON when empty, so specs (and hashes) from before steps are unchanged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cleanup_steps: Vec<CleanupStep>,
}

/// One named step of a job's cleanup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupStep {
    /// 1 to 32 characters of `[a-z0-9-]`, unique in the spec.
    pub name: String,
    pub command: Vec<String>,
    pub mode: StepMode,
}

/// When a cleanup step runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepMode {
    /// One after another, in the given order, before the concurrent ones.
    #[default]
    Ordered,
    /// Together, once every ordered step is done.
    Concurrent,
}

impl StepMode {
    pub fn as_str(self) -> &'static str {
        match self {
            StepMode::Ordered => "ordered",
            StepMode::Concurrent => "concurrent",
        }
    }
}

/// A step name: 1 to 32 characters of `[a-z0-9-]`.
pub fn is_step_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= limits::STEP_NAME_MAX
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// The limits every command of a spec shares: `field` names it in the error.
fn check_command(field: &'static str, args: &[String], required: bool) -> Result<(), Invalid> {
    if (required || !args.is_empty()) && args.first().is_none_or(|a| a.is_empty()) {
        return Err(invalid(field, "must name a program to run"));
    }
    if args.len() > limits::COMMAND_ARGS_MAX {
        return Err(invalid(
            field,
            format!(
                "has {} arguments; at most {}",
                args.len(),
                limits::COMMAND_ARGS_MAX
            ),
        ));
    }
    if let Some(a) = args.iter().find(|a| a.len() > limits::ARG_BYTES_MAX) {
        return Err(invalid(
            field,
            format!(
                "an argument has {} bytes; at most {}",
                a.len(),
                limits::ARG_BYTES_MAX
            ),
        ));
    }
    if args.iter().any(|a| a.contains('\0')) {
        return Err(invalid(field, "arguments must not contain NUL bytes"));
    }
    Ok(())
}

/// A bad submission: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct Invalid {
    pub field: &'static str,
    pub reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Invalid {
    Invalid {
        field,
        reason: reason.into(),
    }
}

/// Worker labels and selector entries: 1 to 128 characters of `[A-Za-z0-9._-]`.
pub fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= limits::LABEL_BYTES_MAX
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

/// `k=v,k2=v2`, for messages.
pub fn show_labels(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Job ids go into etcd keys and folder names: `[A-Za-z0-9._-]`, 1 to 128 characters, and not
/// `.` or `..`.
pub fn validate_id(id: &str) -> Result<(), Invalid> {
    if id.is_empty() || id.len() > limits::ID_MAX {
        return Err(invalid(
            "job_id",
            format!("must be 1 to {} characters", limits::ID_MAX),
        ));
    }
    if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        return Err(invalid("job_id", "may only contain [A-Za-z0-9._-]"));
    }
    if id == "." || id == ".." {
        return Err(invalid("job_id", "must not be . or .."));
    }
    Ok(())
}

impl JobSpec {
    /// Checks every limit and resolves defaults.
    pub fn resolve(
        command: Vec<String>,
        env: BTreeMap<String, String>,
        cleanup_command: Vec<String>,
        max_attempts: u32,
        timeout: Option<Duration>,
    ) -> Result<JobSpec, Invalid> {
        check_command("spec.command", &command, true)?;
        check_command("spec.cleanup_command", &cleanup_command, false)?;
        if env.len() > limits::ENV_ENTRIES_MAX {
            return Err(invalid(
                "spec.env",
                format!(
                    "has {} entries; at most {}",
                    env.len(),
                    limits::ENV_ENTRIES_MAX
                ),
            ));
        }
        for (k, v) in &env {
            let name_ok = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !name_ok {
                return Err(invalid(
                    "spec.env",
                    format!("{k:?} is not a valid variable name"),
                ));
            }
            if k.starts_with("BATON_") {
                return Err(invalid(
                    "spec.env",
                    format!("{k} is reserved: BATON_* variables are set by Baton"),
                ));
            }
            if v.len() > limits::ENV_VALUE_BYTES_MAX || v.contains('\0') {
                return Err(invalid(
                    "spec.env",
                    format!("the value of {k} is too long or has a NUL byte"),
                ));
            }
        }
        let max_attempts = match max_attempts {
            0 => DEFAULT_MAX_ATTEMPTS,
            n if n > limits::MAX_ATTEMPTS_MAX => {
                return Err(invalid(
                    "spec.max_attempts",
                    format!("{n} is more than {}", limits::MAX_ATTEMPTS_MAX),
                ))
            }
            n => n,
        };
        let timeout = match timeout {
            None => DEFAULT_TIMEOUT,
            Some(t) if t.is_zero() => DEFAULT_TIMEOUT,
            Some(t) if t > Duration::from_secs(limits::TIMEOUT_MAX_SECS) => {
                return Err(invalid("spec.timeout", "is more than 7 days"))
            }
            Some(t) if t < Duration::from_millis(100) => {
                return Err(invalid("spec.timeout", "is less than 100ms"))
            }
            Some(t) => t,
        };
        JobSpec {
            command,
            env,
            cleanup_command,
            max_attempts,
            timeout,
            worker_selector: BTreeMap::new(),
            cleanup_steps: Vec::new(),
        }
        .checked_size()
    }

    /// The same spec with these cleanup steps (see [`CleanupStep`]).
    pub fn with_cleanup_steps(mut self, steps: Vec<CleanupStep>) -> Result<JobSpec, Invalid> {
        const FIELD: &str = "spec.cleanup_steps";
        if steps.len() > limits::CLEANUP_STEPS_MAX {
            return Err(invalid(
                FIELD,
                format!(
                    "has {} steps; at most {}",
                    steps.len(),
                    limits::CLEANUP_STEPS_MAX
                ),
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, step) in steps.iter().enumerate() {
            if !is_step_name(&step.name) {
                return Err(invalid(
                    FIELD,
                    format!(
                        "step {i}: name {:?} must be 1 to {} characters of [a-z0-9-]",
                        step.name,
                        limits::STEP_NAME_MAX
                    ),
                ));
            }
            if RESERVED_STEP_NAMES.contains(&step.name.as_str()) {
                return Err(invalid(
                    FIELD,
                    format!(
                        "step {i}: {:?} is reserved (command is cleanup_command's step; folder \
                         and finish are built-in stages)",
                        step.name
                    ),
                ));
            }
            if !seen.insert(step.name.as_str()) {
                return Err(invalid(
                    FIELD,
                    format!("step {i}: the name {:?} is used twice", step.name),
                ));
            }
            check_command(FIELD, &step.command, true).map_err(|e| {
                invalid(FIELD, format!("step {:?}: command {}", step.name, e.reason))
            })?;
        }
        self.cleanup_steps = steps;
        self.checked_size()
    }

    /// The same spec, run only on workers that have every one of these labels.
    pub fn with_selector(mut self, selector: BTreeMap<String, String>) -> Result<JobSpec, Invalid> {
        if selector.len() > limits::SELECTOR_ENTRIES_MAX {
            return Err(invalid(
                "spec.worker_selector",
                format!(
                    "has {} entries; at most {}",
                    selector.len(),
                    limits::SELECTOR_ENTRIES_MAX
                ),
            ));
        }
        for (k, v) in &selector {
            if !is_label(k) || !is_label(v) {
                return Err(invalid(
                    "spec.worker_selector",
                    format!(
                        "{k}={v}: keys and values must be 1 to {} characters of [A-Za-z0-9._-]",
                        limits::LABEL_BYTES_MAX
                    ),
                ));
            }
        }
        self.worker_selector = selector;
        self.checked_size()
    }

    /// Whether a worker with these labels may run the job.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.worker_selector
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }

    fn checked_size(self) -> Result<JobSpec, Invalid> {
        let spec = self;
        let bytes = serde_json::to_vec(&spec).expect("a spec serializes").len();
        if bytes > limits::SPEC_BYTES_MAX {
            return Err(invalid(
                "spec",
                format!(
                    "is {bytes} bytes as stored; at most {}",
                    limits::SPEC_BYTES_MAX
                ),
            ));
        }
        Ok(spec)
    }

    /// A stable digest of the resolved spec: identical re-submissions are recognised by it, even
    /// after the spec itself was removed by cleanup.
    pub fn hash(&self) -> String {
        let canonical = serde_json::to_vec(self).expect("a spec serializes");
        format!("{:016x}", fnv1a64(&canonical))
    }
}

/// FNV-1a, 64 bit: stable across versions and platforms, which `std`'s hasher is not.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// `jobs/<id>`: written at submission, removed when cleanup completes. Its create revision is the
/// job's *incarnation*: every per-job leader write compares it, so an event about an earlier job
/// of the same id changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub version: u32,
    pub job_id: String,
    pub spec: JobSpec,
    pub spec_hash: String,
    /// Unix milliseconds.
    pub submitted_at_ms: u64,
    /// Who submitted it: the token's name or the client certificate's CN (`anonymous`
    /// without authentication). Absent in records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_by: Option<String>,
    /// The schedule that made this job (a tick, trigger or backfill), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<TickOrigin>,
}

/// What a schedule's job records about where it came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TickOrigin {
    pub schedule: String,
    /// The mod revision of the schedule's definition the job was made from.
    pub schedule_revision: i64,
    /// Unix ms.
    pub scheduled_time: u64,
    /// `tick`, `trigger` or `backfill`.
    pub kind: String,
}

/// Version 2: the spec has cleanup steps, which an older leader would skip; it reads version
/// 2 as unknown (the job never runs there, and is counted) instead.
pub const JOB_RECORD_VERSION: u32 = 1;
pub const JOB_RECORD_VERSION_STEPS: u32 = 2;
pub const JOB_RECORD_VERSIONS_READ: &[u32] = &[1, 2];

impl JobSpec {
    /// The version of a record holding this spec: the oldest that can say all of it.
    pub fn record_version(&self) -> u32 {
        if self.cleanup_steps.is_empty() {
            JOB_RECORD_VERSION
        } else {
            JOB_RECORD_VERSION_STEPS
        }
    }
}

/// Durations stored as fractional seconds, readable in `etcdctl get`.
pub(crate) mod duration_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        if !(0.0..=1e9).contains(&secs) {
            return Err(serde::de::Error::custom("duration out of range"));
        }
        Ok(Duration::from_secs_f64(secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn defaults_resolve_and_hash_is_stable() {
        let a = JobSpec::resolve(cmd(&["true"]), BTreeMap::new(), vec![], 0, None).unwrap();
        assert_eq!(a.max_attempts, DEFAULT_MAX_ATTEMPTS);
        assert_eq!(a.timeout, DEFAULT_TIMEOUT);
        let b = JobSpec::resolve(
            cmd(&["true"]),
            BTreeMap::new(),
            vec![],
            3,
            Some(Duration::ZERO),
        )
        .unwrap();
        assert_eq!(a.hash(), b.hash());
        let c = JobSpec::resolve(cmd(&["false"]), BTreeMap::new(), vec![], 0, None).unwrap();
        assert_ne!(a.hash(), c.hash());
    }

    #[test]
    fn bad_input_names_the_field() {
        let e = JobSpec::resolve(vec![], BTreeMap::new(), vec![], 0, None).unwrap_err();
        assert_eq!(e.field, "spec.command");
        let e = JobSpec::resolve(cmd(&["x"]), BTreeMap::new(), vec![], 1000, None).unwrap_err();
        assert_eq!(e.field, "spec.max_attempts");
        let big = "x".repeat(limits::ARG_BYTES_MAX + 1);
        let e = JobSpec::resolve(vec![big], BTreeMap::new(), vec![], 0, None).unwrap_err();
        assert_eq!(e.field, "spec.command");
        let env = BTreeMap::from([("BATON_JOB_ID".to_string(), "x".to_string())]);
        assert_eq!(
            JobSpec::resolve(cmd(&["x"]), env, vec![], 0, None)
                .unwrap_err()
                .field,
            "spec.env"
        );
        let many: Vec<String> = (0..100).map(|_| "y".repeat(4000)).collect();
        assert_eq!(
            JobSpec::resolve(many, BTreeMap::new(), vec![], 0, None)
                .unwrap_err()
                .field,
            "spec"
        );
        let sel = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        let plain = JobSpec::resolve(cmd(&["x"]), BTreeMap::new(), vec![], 0, None).unwrap();
        let gpu = plain.clone().with_selector(sel("gpu", "true")).unwrap();
        assert_ne!(plain.hash(), gpu.hash());
        assert!(gpu.selects(&sel("gpu", "true")));
        assert!(!gpu.selects(&sel("gpu", "false")));
        assert!(plain.selects(&BTreeMap::new()));
        assert_eq!(
            plain
                .clone()
                .with_selector(sel("a b", "c"))
                .unwrap_err()
                .field,
            "spec.worker_selector"
        );
        assert!(
            !serde_json::to_string(&plain)
                .unwrap()
                .contains("worker_selector"),
            "an empty selector is not stored, so older hashes stay"
        );
        assert!(validate_id("job-1.a_b").is_ok());
        assert!(validate_id("a/b").is_err());
        assert!(validate_id("..").is_err());
        assert!(validate_id(&"a".repeat(129)).is_err());
    }
}
