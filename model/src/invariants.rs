//! Invariants over etcd's contents alone, shared by the model's properties and the replay of
//! a drill's history: one definition, checked on both.

use baton::jobs::records::RegistryEntry;
use baton::store::mem::MemEtcd;
use baton::store::Keys;

/// Every job assignment has its RUNNING registry entry (naming that worker incarnation, written
/// in the same revision), and every RUNNING entry its one assignment: what is wrong, if
/// anything. Cleanup assignments are not job assignments.
pub fn registry_disagreement(keys: &Keys, etcd: &MemEtcd) -> Option<String> {
    let registry = keys.registry();
    let assignments = keys.assignments();
    let mut found: Vec<(String, String, i64)> = Vec::new();
    for (key, kv) in etcd.prefix(assignments.as_bytes()) {
        let rest = String::from_utf8_lossy(&key[assignments.len()..]).into_owned();
        let mut parts = rest.splitn(3, '/');
        let (Some(_), Some(_), Some(job)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if job.starts_with("cleanup/") {
            continue;
        }
        found.push((job.to_string(), rest.clone(), kv.modified));
    }
    for (key, kv) in etcd.prefix(registry.as_bytes()) {
        let id = String::from_utf8_lossy(&key[registry.len()..]).into_owned();
        let Ok(entry) = serde_json::from_slice::<RegistryEntry>(&kv.value) else {
            return Some(format!("the registry entry of {id} does not decode"));
        };
        let mine: Vec<&(String, String, i64)> = found.iter().filter(|f| f.0 == id).collect();
        match &entry.worker {
            Some(w) => {
                let want = format!("{w}/{}/{id}", entry.worker_rev);
                if mine.len() != 1 || mine[0].1 != want || mine[0].2 != kv.modified {
                    return Some(format!(
                        "{id} runs on {want} at revision {} by its registry entry, assigned as {mine:?}",
                        kv.modified
                    ));
                }
            }
            None if !mine.is_empty() => {
                return Some(format!(
                    "{id} is not running by its registry entry, assigned as {mine:?}"
                ));
            }
            None => {}
        }
    }
    let orphans: Vec<&(String, String, i64)> = found
        .iter()
        .filter(|f| etcd.get(keys.job(&f.0).registry.as_bytes()).is_none())
        .collect();
    orphans
        .first()
        .map(|o| format!("an assignment without a registry entry: {o:?}"))
}
