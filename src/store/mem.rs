//! An in-memory etcd: keys with create and mod revisions, versions and leases, one revision per
//! applied write, and [`Write`]s applied with etcd's semantics (every compare evaluated against
//! the state before the write; all effects at one new revision, or none). The protocol model
//! runs the code's own writes on it; unit tests get a fast store.

use std::collections::BTreeMap;

use super::write::{Cond, Effect, Write};

/// One key's value and metadata.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Kv {
    pub value: Vec<u8>,
    pub create: i64,
    pub modified: i64,
    pub version: i64,
    /// 0: none.
    pub lease: i64,
}

/// The store: its revision, its keys, and the live leases.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemEtcd {
    pub revision: i64,
    pub kvs: BTreeMap<Vec<u8>, Kv>,
    /// Live lease ids (their countdowns are the caller's: time is not kept here).
    pub leases: std::collections::BTreeSet<i64>,
}

impl MemEtcd {
    pub fn new() -> MemEtcd {
        MemEtcd::default()
    }

    pub fn get(&self, key: &[u8]) -> Option<&Kv> {
        self.kvs.get(key)
    }

    /// The keys under `prefix`, in order.
    pub fn prefix<'a>(&'a self, prefix: &'a [u8]) -> impl Iterator<Item = (&'a Vec<u8>, &'a Kv)> {
        self.kvs
            .range(prefix.to_vec()..)
            .take_while(move |(k, _)| k.starts_with(prefix))
    }

    pub fn holds(&self, c: &Cond) -> bool {
        let kv = self.kvs.get(c.key());
        match c {
            Cond::Absent(_) => kv.is_none(),
            Cond::Present(_) => kv.is_some(),
            Cond::Created(_, rev) => kv.map_or(0, |kv| kv.create) == *rev,
            Cond::Modified(_, rev) => kv.map_or(0, |kv| kv.modified) == *rev,
            Cond::Leased(_, lease) => kv.map_or(0, |kv| kv.lease) == *lease,
        }
    }

    /// Applies `write` if every compare holds (and `fence`, if any): its effects at one new
    /// revision. Whether it applied. A put on a lease that does not live fails like etcd's.
    pub fn apply(&mut self, write: &Write, fence: Option<&Cond>) -> bool {
        self.apply_parts(write.conds(), write.effects(), fence)
    }

    /// [`Self::apply`] of a write kept as its parts (a model's write in flight).
    pub fn apply_parts(
        &mut self,
        conds: &[Cond],
        effects: &[Effect],
        fence: Option<&Cond>,
    ) -> bool {
        if !fence.into_iter().chain(conds).all(|c| self.holds(c)) {
            return false;
        }
        let leases_live = effects.iter().all(|e| match e {
            Effect::Put(_, _, lease) => *lease == 0 || self.leases.contains(lease),
            _ => true,
        });
        if !leases_live {
            return false;
        }
        if effects.is_empty() {
            return true;
        }
        let rev = self.revision + 1;
        for e in effects {
            match e {
                Effect::Put(k, v, lease) => {
                    let old = self.kvs.get(k);
                    let kv = Kv {
                        value: v.clone(),
                        create: old.map_or(rev, |o| o.create),
                        modified: rev,
                        version: old.map_or(1, |o| o.version + 1),
                        lease: *lease,
                    };
                    self.kvs.insert(k.clone(), kv);
                }
                Effect::Delete(k) => {
                    self.kvs.remove(k);
                }
                Effect::DeletePrefix(p) => self.kvs.retain(|k, _| !k.starts_with(p)),
            }
        }
        self.revision = rev;
        true
    }

    /// A new lease.
    pub fn grant(&mut self, id: i64) {
        self.leases.insert(id);
    }

    /// Revokes (or expires) a lease: its keys go, at one new revision if any did.
    pub fn revoke(&mut self, lease: i64) -> bool {
        if !self.leases.remove(&lease) {
            return false;
        }
        let before = self.kvs.len();
        self.kvs.retain(|_, kv| kv.lease != lease);
        if self.kvs.len() != before {
            self.revision += 1;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_apply_with_etcds_semantics() {
        let mut m = MemEtcd::new();
        let w = Write::new().when_absent("a").put("a", "1");
        assert!(m.apply(&w, None));
        assert!(!m.apply(&w, None), "the key exists now");
        let a = m.get(b"a").unwrap().clone();
        assert_eq!((a.create, a.modified, a.version), (1, 1, 1));
        let w2 = Write::new()
            .when_modified("a", 1)
            .put("a", "2")
            .put("b", "x");
        assert!(m.apply(&w2, None));
        let a = m.get(b"a").unwrap();
        assert_eq!((a.create, a.modified, a.version), (1, 2, 2));
        assert_eq!(
            m.get(b"b").unwrap().modified,
            2,
            "one revision for the write"
        );
        let fence = Cond::Created(b"term".to_vec(), 9);
        assert!(!m.apply(&Write::new().put("c", "1"), Some(&fence)));
        assert!(m.apply(&Write::new().delete_prefix("a"), None));
        assert!(m.get(b"a").is_none());
        assert!(
            !m.apply(&Write::new().put_leased("k", "v", 5), None),
            "no lease 5"
        );
        m.grant(5);
        assert!(m.apply(&Write::new().put_leased("k", "v", 5), None));
        assert!(m.revoke(5));
        assert!(m.get(b"k").is_none(), "a lease's keys go with it");
        let dropped = Write::new()
            .when_absent("b")
            .put("d", "1")
            .without(|c| matches!(c, Cond::Absent(k) if k == b"b"));
        assert!(
            m.apply(&dropped, None),
            "the mutation control took the compare out"
        );
    }
}
