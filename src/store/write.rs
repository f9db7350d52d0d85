//! One conditional write: compares, the operations applied when they hold, and the reads
//! answered when they do not (so a failed compare needs no second round trip to explain
//! itself).
//!
//! A [`Write`] knows which keys it compares and which it changes. That is what lets
//! [`super::group`] put many writes into one etcd transaction: etcd evaluates every nested
//! compare against the state *before* the transaction and refuses a transaction in which two
//! branches put the same key, so only writes whose footprints are disjoint may share one.
//!
//! It also keeps an inspectable mirror of its compares ([`Cond`]) and changes ([`Effect`]), so
//! an in-memory etcd ([`super::mem`]) can apply exactly what the code would send: the protocol
//! model and unit tests run the code's own writes.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};

use etcd_client::{Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};

/// A single key, or every key under a prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Span {
    Key(Vec<u8>),
    Prefix(Vec<u8>),
}

impl Span {
    fn overlaps(&self, other: &Span) -> bool {
        match (self, other) {
            (Span::Key(a), Span::Key(b)) => a == b,
            (Span::Key(k), Span::Prefix(p)) | (Span::Prefix(p), Span::Key(k)) => k.starts_with(p),
            (Span::Prefix(a), Span::Prefix(b)) => a.starts_with(b) || b.starts_with(a),
        }
    }
}

/// A compare, as an in-memory store evaluates it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Cond {
    Absent(Vec<u8>),
    Present(Vec<u8>),
    /// Exists with this create revision.
    Created(Vec<u8>, i64),
    /// Last changed at this revision (0: absent).
    Modified(Vec<u8>, i64),
    Leased(Vec<u8>, i64),
}

impl Cond {
    pub fn key(&self) -> &[u8] {
        match self {
            Cond::Absent(k)
            | Cond::Present(k)
            | Cond::Created(k, _)
            | Cond::Modified(k, _)
            | Cond::Leased(k, _) => k,
        }
    }
}

/// A change, as an in-memory store applies it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Effect {
    /// Put on a lease (0: none).
    Put(Vec<u8>, Vec<u8>, i64),
    Delete(Vec<u8>),
    DeletePrefix(Vec<u8>),
}

/// See the module doc. Built with chained calls:
/// `Write::new().when_absent(k).put(k, v).or_get(k)`.
#[derive(Clone, Debug, Default)]
pub struct Write {
    conds: Vec<Cond>,
    effects: Vec<Effect>,
    compares: Vec<Compare>,
    then: Vec<TxnOp>,
    otherwise: Vec<TxnOp>,
    reads: Vec<Span>,
    writes: Vec<Span>,
    /// Keys and values carried, roughly what the request costs on the wire.
    bytes: usize,
}

impl Write {
    pub fn new() -> Write {
        Write::default()
    }

    fn compare(mut self, key: impl Into<Vec<u8>>, make: impl FnOnce(Vec<u8>) -> Compare) -> Self {
        let key = key.into();
        self.bytes += key.len() + 16;
        self.reads.push(Span::Key(key.clone()));
        self.compares.push(make(key));
        self
    }

    fn cond(mut self, c: Cond) -> Self {
        self.conds.push(c);
        self
    }

    /// The key does not exist.
    pub fn when_absent(self, key: impl Into<Vec<u8>>) -> Self {
        let key = key.into();
        self.cond(Cond::Absent(key.clone()))
            .compare(key, |k| Compare::version(k, CompareOp::Equal, 0))
    }

    /// The key exists.
    pub fn when_present(self, key: impl Into<Vec<u8>>) -> Self {
        let key = key.into();
        self.cond(Cond::Present(key.clone()))
            .compare(key, |k| Compare::version(k, CompareOp::Greater, 0))
    }

    /// The key exists with this create revision (one incarnation of it).
    pub fn when_created(self, key: impl Into<Vec<u8>>, rev: i64) -> Self {
        let key = key.into();
        self.cond(Cond::Created(key.clone(), rev))
            .compare(key, |k| Compare::create_revision(k, CompareOp::Equal, rev))
    }

    /// The key was last changed at this revision (0: it does not exist).
    pub fn when_modified(self, key: impl Into<Vec<u8>>, rev: i64) -> Self {
        let key = key.into();
        self.cond(Cond::Modified(key.clone(), rev))
            .compare(key, |k| Compare::mod_revision(k, CompareOp::Equal, rev))
    }

    /// The key is attached to this lease.
    pub fn when_leased(self, key: impl Into<Vec<u8>>, lease: i64) -> Self {
        let key = key.into();
        self.cond(Cond::Leased(key.clone(), lease))
            .compare(key, |k| Compare::lease(k, CompareOp::Equal, lease))
    }

    /// What it compares, in order.
    pub fn conds(&self) -> &[Cond] {
        &self.conds
    }

    /// What it changes when its compares hold, in order.
    pub fn effects(&self) -> &[Effect] {
        &self.effects
    }

    pub fn put(self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        self.put_with(key, value, 0)
    }

    pub fn put_leased(
        self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Self {
        self.put_with(key, value, lease)
    }

    fn put_with(mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: i64) -> Self {
        let (key, value) = (key.into(), value.into());
        let options = (lease != 0).then(|| PutOptions::new().with_lease(lease));
        self.effects
            .push(Effect::Put(key.clone(), value.clone(), lease));
        self.bytes += key.len() + value.len() + 8;
        self.writes.push(Span::Key(key.clone()));
        self.then.push(TxnOp::put(key, value, options));
        self
    }

    pub fn delete(mut self, key: impl Into<Vec<u8>>) -> Self {
        let key = key.into();
        self.effects.push(Effect::Delete(key.clone()));
        self.bytes += key.len() + 8;
        self.writes.push(Span::Key(key.clone()));
        self.then.push(TxnOp::delete(key, None));
        self
    }

    pub fn delete_prefix(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        let prefix = prefix.into();
        self.effects.push(Effect::DeletePrefix(prefix.clone()));
        self.bytes += 2 * prefix.len() + 8;
        self.writes.push(Span::Prefix(prefix.clone()));
        self.then.push(TxnOp::delete(
            prefix,
            Some(DeleteOptions::new().with_prefix()),
        ));
        self
    }

    /// Read this key (with the operations, when the compares hold). A write of reads alone is
    /// a read, batched like any write.
    pub fn get(mut self, key: impl Into<Vec<u8>>) -> Self {
        let key = key.into();
        self.bytes += key.len() + 8;
        self.then.push(TxnOp::get(key, None));
        self
    }

    /// Read every key under this prefix (with the operations, when the compares hold).
    pub fn get_prefix(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        let prefix = prefix.into();
        self.bytes += 2 * prefix.len() + 8;
        self.then
            .push(TxnOp::get(prefix, Some(GetOptions::new().with_prefix())));
        self
    }

    /// Read this key when the compares fail.
    pub fn or_get(mut self, key: impl Into<Vec<u8>>) -> Self {
        let key = key.into();
        self.bytes += key.len() + 8;
        self.otherwise.push(TxnOp::get(key, None));
        self
    }

    /// Read every key under this prefix when the compares fail.
    pub fn or_get_prefix(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        let prefix = prefix.into();
        self.bytes += 2 * prefix.len() + 8;
        self.otherwise
            .push(TxnOp::get(prefix, Some(GetOptions::new().with_prefix())));
        self
    }

    /// This write and `other` as one: every compare of both, then every operation of both.
    pub fn merge(mut self, other: Write) -> Self {
        self.conds.extend(other.conds);
        self.effects.extend(other.effects);
        self.compares.extend(other.compares);
        self.then.extend(other.then);
        self.otherwise.extend(other.otherwise);
        self.reads.extend(other.reads);
        self.writes.extend(other.writes);
        self.bytes += other.bytes;
        self
    }

    /// This write without the compares `drop` picks: a mutation control of the protocol model
    /// (a compare taken out of the code must make the model fail).
    pub fn without(mut self, drop: impl Fn(&Cond) -> bool) -> Write {
        let keep: Vec<bool> = self.conds.iter().map(|c| !drop(c)).collect();
        let mut kept = keep.iter();
        self.compares.retain(|_| *kept.next().unwrap_or(&true));
        let mut kept = keep.iter();
        self.conds.retain(|_| *kept.next().unwrap_or(&true));
        self
    }

    pub fn has_compares(&self) -> bool {
        !self.compares.is_empty()
    }

    /// Roughly what this write costs in a request.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The most operations of any one branch (etcd's `--max-txn-ops` bounds each).
    pub fn ops(&self) -> usize {
        self.compares
            .len()
            .max(self.then.len())
            .max(self.otherwise.len())
    }

    /// Whether the two cannot share a transaction: one changes a key the other changes or
    /// compares.
    pub fn conflicts_with(&self, other: &Write) -> bool {
        let hits = |a: &[Span], b: &[Span]| a.iter().any(|x| b.iter().any(|y| x.overlaps(y)));
        hits(&self.writes, &other.writes)
            || hits(&self.writes, &other.reads)
            || hits(&self.reads, &other.writes)
    }

    /// This write as a transaction of its own.
    pub fn into_txn(self) -> Txn {
        Txn::new()
            .when(self.compares)
            .and_then(self.then)
            .or_else(self.otherwise)
    }

    /// A copy of this write as a transaction of its own (its operations only).
    pub fn to_txn(&self) -> Txn {
        Txn::new()
            .when(self.compares.clone())
            .and_then(self.then.clone())
            .or_else(self.otherwise.clone())
    }

    /// This write as a transaction guarded by `fence` too: the fence outside, this write nested
    /// inside with its own compares (so a failed compare of its own is told apart from a failed
    /// fence).
    pub fn into_fenced_txn(self, fence: Compare) -> Txn {
        Txn::new()
            .when([fence])
            .and_then([TxnOp::txn(self.into_txn())])
    }
}

/// The footprints of a group of writes, kept as the group grows, so that asking whether one
/// more meets any of them costs that write's own keys rather than a pass over the group (which
/// was most of what batching cost the leader under load). Keys are kept as hashes: a collision
/// only takes a write for a conflicting one, which costs it a later transaction, never a wrong
/// one.
#[derive(Debug, Default)]
pub struct Footprints {
    written: HashSet<u64>,
    read: HashSet<u64>,
    /// Prefixes of the group, and whether written (else read).
    prefixes: Vec<(Vec<u8>, bool)>,
}

fn key_hash(key: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

impl Footprints {
    pub fn add(&mut self, w: &Write) {
        for (spans, written) in [(&w.writes, true), (&w.reads, false)] {
            for s in spans {
                match s {
                    Span::Key(k) if written => self.written.insert(key_hash(k)),
                    Span::Key(k) => self.read.insert(key_hash(k)),
                    Span::Prefix(p) => {
                        self.prefixes.push((p.clone(), written));
                        true
                    }
                };
            }
        }
    }

    /// Whether `w` meets a write of the group, as [`Write::conflicts_with`] would answer for
    /// one of them. A write with a prefix of its own is compared with each of `members` (the
    /// group's writes), as before.
    pub fn meets<'a>(&self, w: &Write, mut members: impl Iterator<Item = &'a Write>) -> bool {
        fn keys(spans: &[Span]) -> Option<Vec<&[u8]>> {
            spans
                .iter()
                .map(|s| match s {
                    Span::Key(k) => Some(k.as_slice()),
                    Span::Prefix(_) => None,
                })
                .collect()
        }
        let (Some(writes), Some(reads)) = (keys(&w.writes), keys(&w.reads)) else {
            return members.any(|m| m.conflicts_with(w));
        };
        let under = |k: &[u8], written_only: bool| {
            self.prefixes
                .iter()
                .any(|(p, written)| (*written || !written_only) && k.starts_with(p))
        };
        writes.iter().any(|k| {
            let h = key_hash(k);
            self.written.contains(&h) || self.read.contains(&h) || under(k, false)
        }) || reads
            .iter()
            .any(|k| self.written.contains(&key_hash(k)) || under(k, true))
    }
}

#[cfg(test)]
mod tests {
    use super::{Footprints, Write};

    #[test]
    fn footprints_decide_who_may_share_a_transaction() {
        let a = Write::new().when_absent("/j/a").put("/j/a", "1");
        let b = Write::new().when_absent("/j/b").put("/j/b", "1");
        assert!(!a.conflicts_with(&b));
        // The same key put twice, or compared by one and changed by the other.
        let a2 = Write::new().put("/j/a", "2");
        assert!(a.conflicts_with(&a2));
        let reads_a = Write::new().when_modified("/j/a", 3).put("/x", "1");
        assert!(reads_a.conflicts_with(&a2) && a2.conflicts_with(&reads_a));
        // A prefix delete covers the keys under it, and only those.
        let wipe = Write::new().delete_prefix("/attempts/a/");
        assert!(wipe.conflicts_with(&Write::new().put("/attempts/a/7", "x")));
        assert!(!wipe.conflicts_with(&Write::new().put("/attempts/ab/7", "x")));
        // Reads alone never conflict.
        let r1 = Write::new().when_present("/k").or_get("/k");
        let r2 = Write::new().when_absent("/k").or_get("/k");
        assert!(!r1.conflicts_with(&r2));
    }

    #[test]
    fn footprints_of_a_group_answer_as_a_pass_over_it_would() {
        let keys = ["/a", "/a/1", "/a/2", "/ab", "/b/1", "/b/2"];
        let prefixes = ["/a/", "/b/", "/a"];
        let mut rng = fastrand::Rng::with_seed(7);
        let one = |rng: &mut fastrand::Rng| {
            let mut w = Write::new();
            for _ in 0..rng.usize(1..4) {
                let k = keys[rng.usize(..keys.len())];
                w = match rng.u8(..5) {
                    0 => w.when_absent(k),
                    1 => w.put(k, "v"),
                    2 => w.delete(k),
                    3 if rng.bool() => w.delete_prefix(prefixes[rng.usize(..prefixes.len())]),
                    _ => w.when_modified(k, 2),
                };
            }
            w
        };
        for _ in 0..2000 {
            let group: Vec<Write> = (0..rng.usize(0..5)).map(|_| one(&mut rng)).collect();
            let w = one(&mut rng);
            let mut fp = Footprints::default();
            group.iter().for_each(|m| fp.add(m));
            let pass = group.iter().any(|m| m.conflicts_with(&w));
            assert_eq!(fp.meets(&w, group.iter()), pass, "{w:?} against {group:?}");
        }
    }

    #[test]
    fn ops_counts_the_largest_branch() {
        let w = Write::new()
            .when_absent("a")
            .when_absent("b")
            .put("a", "1")
            .or_get("a")
            .or_get("b")
            .or_get("c");
        assert_eq!(w.ops(), 3);
        assert!(w.bytes() > 0);
    }
}
