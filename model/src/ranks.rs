//! Revisions renamed to ranks after each step, so the state space stays finite and two states
//! that differ only in how many revisions etcd has counted are one state.
//!
//! The protocol compares revisions only for equality and order (a compare on a create or mod
//! revision, the fence, an incarnation newer than another), never for their distance, so an
//! order-preserving renaming of every revision the state holds changes nothing it can observe.
//! "Every revision" means every place one hides: etcd's counter and each key's create and mod
//! revisions; key names (`assignments/<worker>/<incarnation>/...`, `attempts/<job>/<token>`);
//! stored values (`term`, `worker_rev`, `stage_term`, `token`); writes in flight (their
//! compares, keys, values and fence); and what processes remember (terms, incarnations,
//! tokens, `started` revisions, gone incarnations). Key versions are set to 1 for the same
//! reason: no step the model takes reads them (the cleaner's "a new dirty result" check does,
//! and cleanup is not modelled yet). Lease ids are not renamed: leases are granted only at
//! start and after faults, so they stay bounded.

use std::collections::{BTreeMap, BTreeSet};

use baton::store::{Cond, Effect, Keys};
use serde_json::Value;

use crate::State;

/// Fields of stored values that hold a revision.
const REVISION_FIELDS: [&str; 6] = [
    "term",
    "worker_rev",
    "stage_term",
    "token",
    "schedule_rev",
    "schedule_revision",
];

/// Renames every revision in `s` to its rank among them (0, "none", stays 0); etcd's counter
/// becomes the highest rank, so the next write is still newer than everything.
pub fn rename(keys: &Keys, s: &mut State) {
    let mut seen = BTreeSet::new();
    visit(keys, s, &mut |r| {
        seen.insert(*r);
    });
    seen.insert(s.etcd.revision);
    seen.remove(&0);
    let rank: BTreeMap<i64, i64> = seen.into_iter().zip(1..).collect();
    visit(keys, s, &mut |r| {
        if *r != 0 {
            *r = rank[r];
        }
    });
    s.etcd.revision = rank.get(&s.etcd.revision).copied().unwrap_or(0);
}

/// Calls `f` on every revision `s` holds (see the module doc), in place.
fn visit(keys: &Keys, s: &mut State, f: &mut dyn FnMut(&mut i64)) {
    let kvs = std::mem::take(&mut s.etcd.kvs);
    for (mut key, mut kv) in kvs {
        in_key(keys, &mut key, f);
        f(&mut kv.create);
        f(&mut kv.modified);
        kv.version = 1;
        in_value(&mut kv.value, f);
        s.etcd.kvs.insert(key, kv);
    }
    for r in &mut s.replicas {
        if let Some(l) = &mut r.lead {
            f(&mut l.fence);
        }
        if let Some(out) = &mut r.outbox {
            f(&mut out.term);
            if let Some(fence) = &mut out.fence {
                f(fence);
            }
            for c in &mut out.conds {
                match c {
                    Cond::Created(k, rev) | Cond::Modified(k, rev) => {
                        in_key(keys, k, f);
                        f(rev);
                    }
                    Cond::Absent(k) | Cond::Present(k) | Cond::Leased(k, _) => in_key(keys, k, f),
                }
            }
            for e in &mut out.effects {
                match e {
                    Effect::Put(k, v, _) => {
                        in_key(keys, k, f);
                        in_value(v, f);
                    }
                    Effect::Delete(k) | Effect::DeletePrefix(k) => in_key(keys, k, f),
                }
            }
        }
        if let Some((value, rev)) = &mut r.sched {
            in_value(value, f);
            f(rev);
        }
        let gone = std::mem::take(&mut r.gone);
        for (mut rev, g) in gone {
            f(&mut rev);
            r.gone.insert(rev, g);
        }
    }
    for w in &mut s.workers {
        if let Some(inc) = &mut w.inc {
            f(&mut inc.rev);
        }
        for g in &mut w.guards {
            f(&mut g.inc);
            f(&mut g.token);
            f(&mut g.started);
        }
    }
}

/// The revision in a key's name: the incarnation of an assignment (or of a worker's
/// assignments prefix), the token of an attempt record.
fn in_key(keys: &Keys, key: &mut Vec<u8>, f: &mut dyn FnMut(&mut i64)) {
    let Ok(text) = std::str::from_utf8(key) else {
        return;
    };
    let (prefix, at) = if let Some(rest) = text.strip_prefix(&keys.assignments()) {
        (keys.assignments(), rest.find('/').map(|i| i + 1))
    } else if let Some(rest) = text.strip_prefix(&keys.attempts()) {
        (keys.attempts(), rest.find('/').map(|i| i + 1))
    } else {
        return;
    };
    let rest = &text[prefix.len()..];
    let Some(at) = at else { return };
    let end = rest[at..].find('/').map_or(rest.len(), |i| at + i);
    let Ok(mut rev) = rest[at..end].parse::<i64>() else {
        return;
    };
    f(&mut rev);
    *key = format!("{prefix}{}{rev}{}", &rest[..at], &rest[end..]).into_bytes();
}

fn in_value(value: &mut Vec<u8>, f: &mut dyn FnMut(&mut i64)) {
    let Ok(mut v) = serde_json::from_slice::<Value>(value) else {
        return;
    };
    in_json(&mut v, f);
    *value = serde_json::to_vec(&v).expect("a JSON value serializes");
}

fn in_json(v: &mut Value, f: &mut dyn FnMut(&mut i64)) {
    match v {
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                match v.as_i64() {
                    Some(mut rev) if REVISION_FIELDS.contains(&k.as_str()) => {
                        f(&mut rev);
                        *v = Value::from(rev);
                    }
                    _ => in_json(v, f),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| in_json(v, f)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BatonModel, Guard, Inc, Replica, Worker};
    use baton::store::mem::Kv;
    use stateright::Model;

    #[test]
    fn ranks_keep_order_and_equality_everywhere_a_revision_hides() {
        let keys = Keys::new("m");
        let mut s = BatonModel::new(1, 1, 1).init_states().remove(0);
        s.etcd.revision = 40;
        let kv = |create, modified, value: &str| Kv {
            create,
            modified,
            version: 7,
            lease: 0,
            value: value.as_bytes().to_vec(),
        };
        s.etcd.kvs.clear();
        s.replicas = vec![Replica::default()];
        let akey = keys.assignment("w0", 12, "j0");
        s.etcd.kvs.insert(
            akey.clone().into_bytes(),
            kv(30, 30, r#"{"term":9,"job_id":"j0","attempt":1}"#),
        );
        s.etcd.kvs.insert(
            keys.attempt("j0", 30).into_bytes(),
            kv(35, 35, r#"{"worker_rev":12,"attempt":1}"#),
        );
        s.workers = vec![Worker {
            inc: Some(Inc {
                rev: 12,
                lease: 5,
                proof: 2,
                renewal: None,
            }),
            guards: vec![Guard {
                job: 0,
                inc: 12,
                token: 30,
                started: 35,
                go: true,
                deadline: 2,
                running: true,
                ended: false,
                exited: false,
            }],
            ..Worker::default()
        }];
        rename(&keys, &mut s);
        // 9 < 12 < 30 < 35 < 40 become 1 < 2 < 3 < 4 < 5; counts (attempt 1) are untouched.
        let a = &s.etcd.kvs[keys.assignment("w0", 2, "j0").as_bytes()];
        assert_eq!((a.create, a.modified, a.version), (3, 3, 1));
        assert_eq!(
            serde_json::from_slice::<Value>(&a.value).unwrap(),
            serde_json::json!({"term": 1, "job_id": "j0", "attempt": 1})
        );
        let r = &s.etcd.kvs[keys.attempt("j0", 3).as_bytes()];
        assert_eq!((r.create, r.modified), (4, 4));
        assert_eq!(
            serde_json::from_slice::<Value>(&r.value).unwrap(),
            serde_json::json!({"worker_rev": 2, "attempt": 1})
        );
        let g = &s.workers[0].guards[0];
        assert_eq!((g.inc, g.token, g.started), (2, 3, 4));
        assert_eq!(s.workers[0].inc.as_ref().unwrap().rev, 2);
        assert_eq!(s.etcd.revision, 5);
        assert!(!s.etcd.kvs.contains_key(akey.as_bytes()));
    }
}
