//! The key layout under `/baton/<cluster>/`. Every key Baton writes is built here.

/// Keys of one cluster.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(cluster: &str) -> Self {
        Self {
            prefix: format!("/baton/{cluster}/"),
        }
    }

    /// The cluster's name.
    pub fn cluster(&self) -> &str {
        self.prefix
            .trim_start_matches("/baton/")
            .trim_end_matches('/')
    }

    /// `/baton/<cluster>/`
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The election name; candidates' keys live under `<election>/<lease id in hex>`.
    pub fn election(&self) -> String {
        format!("{}election", self.prefix)
    }

    /// `fast-failover/last`: the latest revoke on evidence, on its follower's lease of one
    /// election TTL (one revoke per TTL per cluster).
    pub fn fast_failover_last(&self) -> String {
        format!("{}fast-failover/last", self.prefix)
    }

    /// `fast-failover/false-alarm`: a live leader was revoked; on a 10-minute lease, and no
    /// follower revokes while it exists.
    pub fn fast_failover_false_alarm(&self) -> String {
        format!("{}fast-failover/false-alarm", self.prefix)
    }

    /// `jobs/`: submitted specs.
    pub fn jobs(&self) -> String {
        format!("{}jobs/", self.prefix)
    }

    /// `registry/`: PENDING and RUNNING jobs only.
    pub fn registry(&self) -> String {
        format!("{}registry/", self.prefix)
    }

    /// `results/dirty/`: terminal results whose cleanup is not complete.
    pub fn dirty(&self) -> String {
        format!("{}results/dirty/", self.prefix)
    }

    /// `results/clean/`: terminal results whose cleanup is complete.
    pub fn clean(&self) -> String {
        format!("{}results/clean/", self.prefix)
    }

    /// `cancel/`: cancel requests.
    pub fn cancel(&self) -> String {
        format!("{}cancel/", self.prefix)
    }

    /// `cleanup-now/`: operators' requests to retry a cleanup at once.
    pub fn cleanup_now(&self) -> String {
        format!("{}cleanup-now/", self.prefix)
    }

    /// `cleanup-abandon/`: operators' requests to end a job's cleanup by hand.
    pub fn cleanup_abandon(&self) -> String {
        format!("{}cleanup-abandon/", self.prefix)
    }

    /// `workers/`: one key per live worker incarnation, on the worker's own lease.
    pub fn workers(&self) -> String {
        format!("{}workers/", self.prefix)
    }

    /// `workers/<id>`
    pub fn worker(&self, id: &str) -> String {
        format!("{}{id}", self.workers())
    }

    /// `drains/`: operators' drain requests, one per worker id; kept across its incarnations
    /// until undrained.
    pub fn drains(&self) -> String {
        format!("{}drains/", self.prefix)
    }

    /// `drains/<id>`
    pub fn drain(&self, id: &str) -> String {
        format!("{}{id}", self.drains())
    }

    /// `assignments/`: what the leader gave each worker incarnation to run.
    pub fn assignments(&self) -> String {
        format!("{}assignments/", self.prefix)
    }

    /// `assignments/<worker>/<create_rev>/`: the one prefix a worker incarnation watches.
    pub fn assignments_of(&self, worker: &str, incarnation: i64) -> String {
        format!("{}{worker}/{incarnation}/", self.assignments())
    }

    /// `assignments/<worker>/<create_rev>/<job>`
    pub fn assignment(&self, worker: &str, incarnation: i64, job: &str) -> String {
        format!("{}{job}", self.assignments_of(worker, incarnation))
    }

    /// `assignments/<worker>/<create_rev>/cleanup/<job>`: a cleanup step of a finished job
    /// (job ids hold no `/`, so it never meets a job's assignment).
    pub fn cleanup_assignment(&self, worker: &str, incarnation: i64, job: &str) -> String {
        format!("{}cleanup/{job}", self.assignments_of(worker, incarnation))
    }

    /// `assignments/<worker>/<create_rev>/cleanup/<job>/<step>`: a named cleanup step of a
    /// finished job (version 3 entries; steps of one job may run side by side on one worker).
    pub fn cleanup_step_assignment(
        &self,
        worker: &str,
        incarnation: i64,
        job: &str,
        step: &str,
    ) -> String {
        format!(
            "{}cleanup/{job}/{step}",
            self.assignments_of(worker, incarnation)
        )
    }

    /// `cleanups/`: what workers report about cleanup steps.
    pub fn cleanups(&self) -> String {
        format!("{}cleanups/", self.prefix)
    }

    /// `cleanups/<job>/<step>`: `<step>` is the `command` step's attempt (version 2 entries),
    /// `<name>.<attempt>` (version 3), or `folder`.
    pub fn cleanup_record(&self, job: &str, step: &str) -> String {
        format!("{}{job}/{step}", self.cleanups())
    }

    /// `attempts/`: what workers report about each assignment.
    pub fn attempts(&self) -> String {
        format!("{}attempts/", self.prefix)
    }

    /// `attempts/<job>/`
    pub fn attempts_of(&self, job: &str) -> String {
        format!("{}{job}/", self.attempts())
    }

    /// `attempts/<job>/<token>`: keyed by the revision of the assignment it reports on.
    pub fn attempt(&self, job: &str, token: i64) -> String {
        format!("{}{token}", self.attempts_of(job))
    }

    /// `schedules/`: schedule definitions, written by any replica.
    pub fn schedules(&self) -> String {
        format!("{}schedules/", self.prefix)
    }

    /// `schedules/<name>`
    pub fn schedule(&self, name: &str) -> String {
        format!("{}{name}", self.schedules())
    }

    /// `schedule-status/`: what the leader decided about each schedule (fenced).
    pub fn schedule_statuses(&self) -> String {
        format!("{}schedule-status/", self.prefix)
    }

    /// `schedule-status/<name>`
    pub fn schedule_status(&self, name: &str) -> String {
        format!("{}{name}", self.schedule_statuses())
    }

    /// `schedule-requests/`: triggers and backfills waiting for the leader.
    pub fn schedule_requests(&self) -> String {
        format!("{}schedule-requests/", self.prefix)
    }

    /// `schedule-requests/<name>/<id>`
    pub fn schedule_request(&self, name: &str, id: &str) -> String {
        format!("{}{name}/{id}", self.schedule_requests())
    }

    /// `terms/`: the history of terms, one key per term.
    pub fn terms(&self) -> String {
        format!("{}terms/", self.prefix)
    }

    /// `terms/<term, 20 digits>`: sorts in term order.
    pub fn term_record(&self, term: i64) -> String {
        format!("{}{term:020}", self.terms())
    }

    /// The job id of a key under one of the per-job prefixes.
    pub fn id_in<'a>(prefix: &str, key: &'a [u8]) -> Option<&'a str> {
        std::str::from_utf8(key).ok()?.strip_prefix(prefix)
    }
}

/// The keys of one job.
#[derive(Clone, Debug)]
pub struct JobKeys {
    pub spec: String,
    pub registry: String,
    pub dirty: String,
    pub clean: String,
    pub cancel: String,
    pub cleanup_now: String,
    pub abandon: String,
}

impl Keys {
    pub fn job(&self, id: &str) -> JobKeys {
        JobKeys {
            spec: format!("{}{id}", self.jobs()),
            registry: format!("{}{id}", self.registry()),
            dirty: format!("{}{id}", self.dirty()),
            clean: format!("{}{id}", self.clean()),
            cancel: format!("{}{id}", self.cancel()),
            cleanup_now: format!("{}{id}", self.cleanup_now()),
            abandon: format!("{}{id}", self.cleanup_abandon()),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn layout() {
        let k = super::Keys::new("prod");
        assert_eq!(k.prefix(), "/baton/prod/");
        assert_eq!(k.election(), "/baton/prod/election");
        assert_eq!(
            k.assignment("w1", 42, "j"),
            "/baton/prod/assignments/w1/42/j"
        );
        assert_eq!(k.attempt("j", 43), "/baton/prod/attempts/j/43");
    }
}
