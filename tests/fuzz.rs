//! Property tests with many cases: spec validation and the decoding of every stored value
//! type never panic, and nothing invalid is accepted. They run in `make test`.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;

use baton::election::CandidateRecord;
use baton::exec::record::ExitRecord;
use baton::jobs::records::{CancelRequest, JobResult, RegistryEntry};
use baton::jobs::spec::{self, limits, JobRecord, JobSpec};
use baton::jobs::work::{Assignment, AttemptRecord, DrainRequest, WorkerRecord};
use baton::security::TokenTable;
use baton::store::codec;

/// Strings that hit the edges: empty, NUL, `=`, digits first, `BATON_`, long, non-ASCII.
fn edgy() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("\0".to_string()),
        Just("BATON_X".to_string()),
        Just("1A".to_string()),
        Just("A=B".to_string()),
        "[A-Za-z_][A-Za-z0-9_]{0,8}",
        ".{0,12}",
        "[a-z]{8190,8194}",
    ]
}

fn env() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(edgy(), edgy(), 0..4)
}

fn assert_valid(s: &JobSpec) {
    assert!(!s.command.is_empty() && !s.command[0].is_empty());
    for args in [&s.command, &s.cleanup_command] {
        assert!(args.len() <= limits::COMMAND_ARGS_MAX);
        assert!(args
            .iter()
            .all(|a| a.len() <= limits::ARG_BYTES_MAX && !a.contains('\0')));
    }
    assert!(s.env.len() <= limits::ENV_ENTRIES_MAX);
    for (k, v) in &s.env {
        assert!(!k.is_empty() && !k.starts_with("BATON_") && !k.contains('=') && !k.contains('\0'));
        assert!(!k.starts_with(|c: char| c.is_ascii_digit()));
        assert!(v.len() <= limits::ENV_VALUE_BYTES_MAX && !v.contains('\0'));
    }
    assert!((1..=limits::MAX_ATTEMPTS_MAX).contains(&s.max_attempts));
    assert!(s.timeout >= Duration::from_millis(100));
    assert!(s.timeout <= Duration::from_secs(limits::TIMEOUT_MAX_SECS));
    assert!(s.worker_selector.len() <= limits::SELECTOR_ENTRIES_MAX);
    assert!(s
        .worker_selector
        .iter()
        .all(|(k, v)| spec::is_label(k) && spec::is_label(v)));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn spec_validation_never_panics_and_accepts_only_valid_specs(
        command in prop::collection::vec(edgy(), 0..4),
        cleanup in prop::collection::vec(edgy(), 0..3),
        env in env(),
        selector in env(),
        max_attempts in prop_oneof![Just(0u32), Just(1), Just(100), Just(101), any::<u32>()],
        timeout_ms in prop::option::of(prop_oneof![Just(0u64), Just(99), Just(100), Just(604_800_000), Just(604_800_001), any::<u64>()]),
    ) {
        let timeout = timeout_ms.map(Duration::from_millis);
        let resolved = JobSpec::resolve(command, env, cleanup, max_attempts, timeout)
            .and_then(|s| s.with_selector(selector));
        if let Ok(s) = resolved {
            assert_valid(&s);
            // What is stored reads back as the same spec with the same hash.
            let record = JobRecord {
                version: spec::JOB_RECORD_VERSION,
                job_id: "j".into(),
                spec: s.clone(),
                spec_hash: s.hash(),
                submitted_at_ms: 1,
                submitted_by: Some("alice".into()),
                schedule: None,
            };
            let back: JobRecord = codec::decode(b"k", &codec::encode(&record), spec::JOB_RECORD_VERSION).unwrap();
            prop_assert_eq!(&back, &record);
            prop_assert_eq!(back.spec.hash(), s.hash());
        }
    }

    #[test]
    fn job_ids_are_checked_without_panics(id in prop_oneof![".{0,140}", "[A-Za-z0-9._-]{0,140}"]) {
        if spec::validate_id(&id).is_ok() {
            prop_assert!(!id.is_empty() && id.len() <= limits::ID_MAX);
        }
    }

    #[test]
    fn token_files_parse_without_panics(text in ".{0,200}(\n.{0,60}){0,4}") {
        if let Ok(t) = TokenTable::parse(&text) {
            prop_assert!(t.len() <= text.lines().count());
        }
    }
}

/// Every stored value type, decoded from `bytes` under its expected version.
fn decode_all(bytes: &[u8]) {
    let k = b"/baton/test/key";
    let _ = codec::decode::<JobRecord>(k, bytes, spec::JOB_RECORD_VERSION);
    let _ = codec::decode::<RegistryEntry>(k, bytes, baton::jobs::records::REGISTRY_VERSION);
    let _ = codec::decode::<JobResult>(k, bytes, baton::jobs::records::RESULT_VERSION);
    let _ = codec::decode::<CancelRequest>(k, bytes, baton::jobs::records::CANCEL_VERSION);
    let _ = codec::decode::<WorkerRecord>(k, bytes, baton::jobs::work::WORKER_VERSION);
    let _ = codec::decode::<Assignment>(k, bytes, baton::jobs::work::ASSIGNMENT_VERSION);
    let _ = codec::decode::<AttemptRecord>(k, bytes, baton::jobs::work::ATTEMPT_VERSION);
    let _ = codec::decode::<DrainRequest>(k, bytes, baton::jobs::work::DRAIN_VERSION);
    let _ = codec::decode::<ExitRecord>(k, bytes, baton::exec::record::EXIT_RECORD_VERSION);
    let _ = codec::decode::<CandidateRecord>(k, bytes, baton::election::RECORD_VERSION);
}

/// JSON that is nearly right: the real shape with fields dropped, retyped or out of range.
fn jsonish() -> impl Strategy<Value = Vec<u8>> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        ".{0,10}".prop_map(serde_json::Value::from),
        Just(serde_json::Value::from(1u32)),
        Just(serde_json::Value::from(2u32)),
    ];
    let names = prop_oneof![
        Just("version"),
        Just("status"),
        Just("spec"),
        Just("command"),
        Just("job_id"),
        Just("timeout"),
        Just("attempt"),
        Just("worker"),
        Just("cleanup"),
        Just("exit_code"),
        Just("max_attempts"),
        Just("env"),
        Just("term"),
        Just("submitted_by"),
        Just("stage"),
    ];
    let value = leaf.prop_recursive(3, 24, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map(names.clone().prop_map(String::from), inner, 0..8)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    value.prop_map(|v| serde_json::to_vec(&v).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_decode_to_errors_not_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        decode_all(&bytes);
    }

    #[test]
    fn nearly_right_json_decodes_to_errors_not_panics(bytes in jsonish()) {
        decode_all(&bytes);
    }

    #[test]
    fn damaged_real_values_decode_to_errors_not_panics(cut in 0usize..400, flip in 0usize..400, to in any::<u8>()) {
        let spec = JobSpec::resolve(vec!["sh".into(), "-c".into(), "true".into()], BTreeMap::new(), vec![], 0, None).unwrap();
        let mut bytes = codec::encode(&JobRecord {
            version: spec::JOB_RECORD_VERSION,
            job_id: "j-1".into(),
            spec_hash: spec.hash(),
            spec,
            submitted_at_ms: 1,
            submitted_by: None,
            schedule: None,
        });
        if flip < bytes.len() {
            bytes[flip] = to;
        }
        bytes.truncate(cut.min(bytes.len()));
        decode_all(&bytes);
        bytes = codec::encode(&RegistryEntry::pending());
        if flip < bytes.len() {
            bytes[flip] = to;
        }
        decode_all(&bytes);
    }
}
