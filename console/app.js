// The Baton console. Everything it shows comes from this replica's /api/v1 with the caller's
// token (kept in memory and sessionStorage, sent only as `Authorization: Bearer`). Server text
// is only ever set as text (textContent), never parsed as HTML.
"use strict";

const TOKEN_KEY = "baton-token";
let token = sessionStorage.getItem(TOKEN_KEY) || "";
let me = null; // whoami
const live = { counts: null, leader: null, replicas: [], workers: [], seq: 0 };
let view = null; // { name, render(), onUpdate(msg) }
let liveAbort = null;

const ROLES = { read: 0, submit: 1, admin: 2 };
function may(role) {
  return me !== null && ROLES[me.role] >= ROLES[role];
}

// ---- DOM helpers: text only ----

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "onclick") el.addEventListener("click", v);
    else if (k === "onsubmit") el.addEventListener("submit", v);
    else if (k === "onchange") el.addEventListener("change", v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  return add(el, ...children);
}

/// Appends children as `h` does: nested arrays flattened, null and false skipped, text as text.
function add(el, ...children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function $(id) {
  return document.getElementById(id);
}

function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

function time(ms) {
  const n = Number(ms);
  if (!n) return "";
  return new Date(n).toISOString().replace("T", " ").slice(0, 19) + "Z";
}

function rfc(t) {
  if (!t) return "";
  const d = new Date(t);
  return isNaN(d) ? String(t) : d.toISOString().replace("T", " ").slice(0, 19) + "Z";
}

function stateName(s) {
  return String(s || "").replace(/^JOB_STATE_/, "").toLowerCase();
}

function cleanupName(s) {
  return String(s || "").replace(/^CLEANUP_(STATE_)?/, "").toLowerCase().replace(/_/g, " ");
}

/// A map's entries in key order (a protobuf map has none of its own).
function sorted(map) {
  return Object.entries(map || {}).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
}

function table(headers, rows, empty) {
  if (rows.length === 0) return h("p", { class: "empty" }, empty || "None.");
  return h("table", {}, h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))), h("tbody", {}, rows));
}

// ---- the API ----

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/// Bumped whenever what `main` shows is drawn anew ([`retire`]): the answer to a read issued
/// before is thrown away ([`Stale`]), so a slow answer for an earlier page never draws over the
/// current one.
let epoch = 0;

class Stale extends Error {}

/// How long a read may take before it counts as failed (a hung read would hold its view's
/// reloads, which never overlap).
const READ_TIMEOUT_MS = 15000;

async function api(method, path, body) {
  const at = epoch;
  const headers = {};
  if (token) headers["Authorization"] = "Bearer " + token;
  const init = { method, headers, cache: "no-store" };
  if (method !== "GET") {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body || {});
  } else {
    init.signal = AbortSignal.timeout(READ_TIMEOUT_MS);
  }
  const r = await fetch(path, init);
  const text = await r.text();
  if (method === "GET" && at !== epoch) throw new Stale("an answer for an earlier page");
  if (!r.ok) {
    let e = { code: String(r.status), message: text };
    try {
      e = JSON.parse(text);
    } catch (_) {}
    if (r.status === 401) signIn(e.message);
    throw new ApiError(r.status, e.code, e.message);
  }
  const type = r.headers.get("content-type") || "";
  return type.startsWith("application/json") ? JSON.parse(text) : text;
}

function showError(e) {
  if (e instanceof Stale) return;
  const box = $("error");
  clear(box).append(h("span", {}, e instanceof ApiError ? `${e.code}: ${e.message}` : String(e && e.message ? e.message : e)));
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

// ---- asking before acting ----

function confirmThen(question, act) {
  const dialog = $("confirm");
  add(clear($("confirm-text")), question);
  dialog.hidden = false;
  const done = () => {
    dialog.hidden = true;
    $("confirm-yes").onclick = null;
    $("confirm-no").onclick = null;
  };
  $("confirm-no").onclick = done;
  $("confirm-yes").onclick = async () => {
    done();
    try {
      clearError();
      await act();
      if (view) view.render();
    } catch (e) {
      showError(e);
    }
  };
}

function action(label, role, question, act, extra) {
  if (!may(role)) return null;
  return h("button", Object.assign({ type: "button", "data-action": label.toLowerCase().replace(/ /g, "-"), onclick: () => confirmThen(question, act) }, extra || {}), label);
}

// ---- signing in ----

function signIn(message) {
  if (liveAbort) liveAbort.abort();
  me = null;
  const main = clear($("main"));
  add(main, 
    h(
      "form",
      { id: "signin", onsubmit: onSignIn },
      h("h2", {}, "Sign in"),
      h("p", {}, "This cluster needs a token (it stays in this tab only)."),
      message ? h("p", { class: "error" }, message) : null,
      h("label", {}, "Token ", h("input", { id: "token", type: "password", autocomplete: "off" })),
      h("button", { type: "submit" }, "Sign in")
    )
  );
  renderWho();
}

async function onSignIn(ev) {
  ev.preventDefault();
  token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, token);
  await start();
}

function signOut() {
  token = "";
  sessionStorage.removeItem(TOKEN_KEY);
  signIn();
}

function renderWho() {
  const who = clear($("who"));
  if (!me) return;
  add(who, h("span", { id: "whoami" }, `${me.name} (${me.role})`), " on ", h("span", { id: "replica" }, me.replica_id));
  if (me.authentication) add(who, " ", h("button", { type: "button", id: "signout", onclick: signOut }, "Sign out"));
}

// ---- the live stream ----

function setStatus(s) {
  const el = $("status");
  el.textContent = s;
  el.className = "status " + s;
}

function renderLeader() {
  const el = clear($("leader-line"));
  const l = live.leader;
  if (!l) {
    el.append("no leader");
    return;
  }
  el.append("leader ", h("span", { id: "leader" }, l.replica_id), " term ", h("span", { id: "term" }, l.term));
}

function onMessage(name, data) {
  if (name === "error") {
    if (data.code === "UNAUTHENTICATED") signIn(data.message);
    else showError(new ApiError(0, data.code, data.message));
    return;
  }
  live.seq = data.seq;
  live.counts = data.counts;
  live.healthy = data.healthy;
  if ("leader" in data) live.leader = data.leader;
  if ("replicas" in data) live.replicas = data.replicas || [];
  if ("workers" in data) live.workers = data.workers || [];
  renderLeader();
  if (view && view.onUpdate) view.onUpdate(data);
}

async function follow() {
  let pause = 250;
  for (;;) {
    const ctl = new AbortController();
    liveAbort = ctl;
    try {
      const headers = token ? { Authorization: "Bearer " + token } : {};
      const r = await fetch("/api/v1/events", { headers, signal: ctl.signal, cache: "no-store" });
      if (r.status === 401) {
        signIn();
        return;
      }
      if (!r.ok) throw new Error(`events: ${r.status}`);
      setStatus("live");
      pause = 250;
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const chunk = buf.slice(0, i);
          buf = buf.slice(i + 2);
          let name = "message";
          let data = "";
          for (const line of chunk.split("\n")) {
            if (line.startsWith("event: ")) name = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (data) onMessage(name, JSON.parse(data));
        }
      }
    } catch (e) {
      if (ctl.signal.aborted) return;
    }
    if (ctl.signal.aborted) return;
    setStatus("disconnected");
    await new Promise((r) => setTimeout(r, pause));
    pause = Math.min(pause * 2, 4000);
  }
}

// ---- views ----

/// A view that loads when shown and reloads, at most once a second, on the updates `relevant`
/// picks.
function liveView(name, load, relevant) {
  return {
    name,
    load,
    render() {
      renew(this);
    },
    onUpdate(msg) {
      if (relevant(msg)) this.reload();
    },
  };
}

function jobsChanged(msg) {
  return msg.changed.jobs === "all" || msg.changed.jobs.length > 0;
}

/// Calls `load` at most once a second while updates keep coming, and never while a call still
/// runs: a request meanwhile runs it once more after that call ends. Two reads in flight could
/// answer out of order, and an older answer drawn last would stay on screen until the next
/// update, which may never come. `stop()` ends its calls when the view is left or drawn anew.
function throttled(load) {
  let last = 0;
  let timer = null;
  let running = false;
  let again = false;
  let stopped = false;
  const run = async () => {
    running = true;
    last = Date.now();
    try {
      await load();
    } finally {
      running = false;
      if (again) {
        again = false;
        request();
      }
    }
  };
  const request = () => {
    if (stopped) return;
    if (running) {
      again = true;
      return;
    }
    const wait = last + 1000 - Date.now();
    if (wait <= 0) {
      run();
    } else if (!timer) {
      // Nothing runs meanwhile: a request sees the timer, and none is running to ask again.
      timer = setTimeout(() => {
        timer = null;
        run();
      }, wait);
    }
  };
  request.stop = () => {
    stopped = true;
    clearTimeout(timer);
  };
  return request;
}

/// Ends what a view's last render started: its reloads stop, and answers to reads issued until
/// now are dropped.
function retire(v) {
  if (v && v.reload && v.reload.stop) v.reload.stop();
  epoch++;
}

/// Draws view `v` anew: every load from here on goes through one fresh [`throttled`], the first
/// at once, so no two of its reads are ever in flight together.
function renew(v) {
  retire(v);
  v.reload = throttled(() => v.load());
  v.reload();
}

function countsBox() {
  const c = live.counts || {};
  const item = (id, label, n) => h("div", { class: "count", id: "count-" + id }, h("span", { class: "n" }, n ?? 0), h("span", { class: "label" }, label));
  return h(
    "div",
    { class: "counts" },
    item("pending", "pending", c.pending),
    item("running", "running", c.running),
    item("cleanup-pending", "cleanup pending", c.cleanup_pending),
    item("needs-operator", "needs operator", c.needs_operator),
    item("done", "done", c.done)
  );
}

function workersTable() {
  const rows = live.workers.map((w) =>
    h(
      "tr",
      { "data-worker": w.worker_id },
      h("td", {}, w.worker_id),
      h("td", {}, `${w.running}/${w.capacity}`),
      h("td", {}, `${w.cleanups}/${w.cleanup_capacity}`),
      h("td", { class: "draining" }, w.unable ? "unable: " + w.unable : w.drain_requested ? "drain requested" : w.draining ? "draining" : ""),
      h("td", {}, sorted(w.labels).map(([k, v]) => `${k}=${v}`).join(", ")),
      h(
        "td",
        {},
        w.drain_requested
          ? action("Undrain", "admin", `Let worker ${w.worker_id} take new jobs again?`, () => api("POST", `/api/v1/workers/${encodeURIComponent(w.worker_id)}/undrain`))
          : action("Drain", "admin", `Drain worker ${w.worker_id}? It takes no new jobs; running ones finish.`, () => api("POST", `/api/v1/workers/${encodeURIComponent(w.worker_id)}/drain`))
      )
    )
  );
  return table(["worker", "jobs", "cleanups", "", "labels", ""], rows, "No workers.");
}

const overview = {
  name: "overview",
  render() {
    const main = clear($("main"));
    const l = live.leader;
    add(main, 
      h("h2", {}, "Overview"),
      h(
        "section",
        { class: "leader" },
        l ? h("p", {}, "Leader ", h("strong", { id: "overview-leader" }, l.replica_id), ` at ${l.advertise}, term `, h("strong", { id: "overview-term" }, l.term), `, elected ${rfc(l.elected_at)}`) : h("p", {}, "No leader: an election is under way."),
        l ? action("Resign leadership", "admin", `Ask ${l.replica_id} to hand leadership over?`, () => api("POST", "/api/v1/leader/resign", { term: l.term })) : null
      ),
      h("h3", {}, "Jobs"),
      countsBox(),
      h("h3", {}, "Replicas"),
      table(["replica", "address", "role", "readiness"], live.replicas.map((r) => h("tr", { "data-replica": r.replica_id }, h("td", {}, r.replica_id), h("td", {}, r.advertise), h("td", {}, r.leader ? "leader" : "follower"), h("td", {}, "ready: reaches etcd (its lease is alive)"))), "No replica in the election."),
      h("h3", {}, "Workers"),
      workersTable()
    );
  },
  /// Redrawn only when what it shows changed, so a button is not replaced under the pointer.
  onUpdate(msg) {
    const counts = JSON.stringify(msg.counts);
    if (msg.changed.leader || msg.changed.workers || counts !== this.shown) {
      this.shown = counts;
      this.render();
    }
  },
};

const jobsView = {
  name: "jobs",
  query: { state: "", cleanup: "", id_prefix: "" },
  tokens: [""],
  page: null,
  async load() {
    const q = new URLSearchParams({ page_size: "50" });
    for (const [k, v] of Object.entries(this.query)) if (v) q.set(k, v);
    // A live view: each page at the newest revision, from the id the token holds.
    const t = this.tokens[this.tokens.length - 1].replace(/^\d+\//, "0/");
    if (t) q.set("page_token", t);
    try {
      this.page = await api("GET", "/api/v1/jobs?" + q);
      clearError();
    } catch (e) {
      if (e instanceof Stale) return;
      showError(e);
    }
    this.draw();
  },
  render() {
    this.tokens = [""];
    renew(this);
  },
  draw() {
    const main = clear($("main"));
    const select = (name, options) =>
      h(
        "select",
        { id: "filter-" + name, onchange: (e) => ((this.query[name] = e.target.value), this.render()) },
        options.map(([v, label]) => {
          const o = h("option", { value: v }, label);
          if (this.query[name] === v) o.selected = true;
          return o;
        })
      );
    const search = h("input", { id: "search", type: "search", placeholder: "id prefix", value: this.query.id_prefix });
    add(main, 
      h("h2", {}, "Jobs"),
      h(
        "form",
        { class: "filters", onsubmit: (e) => (e.preventDefault(), (this.query.id_prefix = search.value.trim()), this.render()) },
        select("state", [["", "any state"], ["PENDING", "pending"], ["RUNNING", "running"], ["FINISHED", "finished"], ["FAILED", "failed"], ["CANCELED", "canceled"]]),
        select("cleanup", [["", "any cleanup"], ["CLEANUP_PENDING", "cleanup pending"], ["CLEANUP_NEEDS_OPERATOR", "needs operator"], ["CLEANUP_DONE", "cleanup done"]]),
        search,
        h("button", { type: "submit" }, "Search")
      )
    );
    const p = this.page;
    if (!p) return;
    if (p.notice) add(main, h("p", { class: "notice" }, p.notice));
    add(main, jobRows(p.jobs));
    if (p.scan_limit_reached) add(main, h("p", { class: "notice", id: "short-page" }, "This page is short: the scan limit was reached before it filled. More may follow."));
    const nav = h("p", { class: "pager" });
    if (this.tokens.length > 1) add(nav, h("button", { type: "button", onclick: () => (this.tokens.pop(), renew(this)) }, "Previous"));
    if (p.next_page_token) add(nav, h("button", { type: "button", id: "next-page", onclick: () => (this.tokens.push(p.next_page_token), renew(this)) }, "Next"));
    add(main, nav);
  },
  onUpdate(msg) {
    if (jobsChanged(msg)) this.reload();
  },
};

function jobRows(jobs, withCleanupActions) {
  const rows = jobs.map((j) =>
    h(
      "tr",
      { "data-job": j.job_id },
      h("td", {}, h("a", { href: "#/jobs/" + encodeURIComponent(j.job_id) }, j.job_id)),
      h("td", { class: "state" }, stateName(j.state)),
      h("td", { class: "cleanup" }, cleanupName(j.cleanup && j.cleanup.state)),
      h("td", {}, j.worker),
      h("td", {}, j.attempts),
      h("td", {}, time(j.submitted_unix_ms)),
      h("td", {}, time(j.finished_unix_ms)),
      withCleanupActions ? h("td", { class: "last-error" }, j.cleanup ? j.cleanup.last_error : "") : null,
      withCleanupActions ? h("td", {}, cleanupActions(j)) : null
    )
  );
  const headers = ["job", "state", "cleanup", "worker", "attempts", "submitted", "finished"];
  if (withCleanupActions) headers.push("last error", "");
  return table(headers, rows, "No jobs.");
}

function cleanupActions(j) {
  const c = j.cleanup || {};
  if (c.state !== "CLEANUP_PENDING" && c.state !== "CLEANUP_NEEDS_OPERATOR") return [];
  const id = encodeURIComponent(j.job_id);
  return [
    action("Retry cleanup", "admin", `Retry the cleanup of ${j.job_id} now?`, () => api("POST", `/api/v1/jobs/${id}/cleanup/retry`)),
    action("Abandon cleanup", "admin", `Abandon the cleanup of ${j.job_id}? Its remaining steps will not run.`, () => api("POST", `/api/v1/jobs/${id}/cleanup/abandon`, { reason: "abandoned from the console" })),
  ];
}

const cleanupsView = liveView(
  "cleanups",
  async function () {
    try {
      const [ops, pending] = await Promise.all([api("GET", "/api/v1/jobs?cleanup=CLEANUP_NEEDS_OPERATOR&page_size=200"), api("GET", "/api/v1/jobs?cleanup=CLEANUP_PENDING&page_size=200")]);
      clearError();
      const main = clear($("main"));
      add(main, h("h2", {}, "Cleanups"), h("h3", {}, "Needs an operator"), h("div", { id: "needs-operator" }, jobRows(ops.jobs, true)), h("h3", {}, "Pending"), h("div", { id: "cleanup-pending" }, jobRows(pending.jobs, true)));
    } catch (e) {
      showError(e);
    }
  },
  jobsChanged
);

const workersView = {
  name: "workers",
  render() {
    add(clear($("main")), h("h2", {}, "Workers"), workersTable());
  },
  onUpdate(msg) {
    if (msg.changed.workers) this.render();
  },
};

const schedulesView = liveView(
  "schedules",
  async function () {
    try {
      const r = await api("GET", "/api/v1/schedules");
      clearError();
      const rows = (r.schedules || []).map((s) => {
        const d = s.definition || {};
        const name = encodeURIComponent(s.name);
        return h(
          "tr",
          { "data-schedule": s.name },
          h("td", {}, s.name),
          h("td", {}, d.cron, d.tz ? ` (${d.tz})` : ""),
          h("td", { class: "paused" }, s.paused ? "paused " + (s.pause_reason || "") : ""),
          h("td", {}, (s.next_fire_times || []).slice(0, 3).map(rfc).join(", ")),
          h("td", {}, (s.recent || []).slice(-5).reverse().map((o) => h("div", {}, `${rfc(o.scheduled_time)} ${o.outcome}${o.job_id ? " " + o.job_id : ""}`))),
          h(
            "td",
            {},
            s.paused
              ? action("Resume", "submit", `Resume schedule ${s.name}?`, () => api("POST", `/api/v1/schedules/${name}/resume`))
              : action("Pause", "submit", `Pause schedule ${s.name}?`, () => api("POST", `/api/v1/schedules/${name}/pause`, { reason: "paused from the console" })),
            action("Trigger", "submit", `Run schedule ${s.name} once now?`, () => api("POST", `/api/v1/schedules/${name}/trigger`))
          )
        );
      });
      add(clear($("main")), h("h2", {}, "Schedules"), table(["schedule", "when", "", "next", "recent", ""], rows, "No schedules."));
    } catch (e) {
      showError(e);
    }
  },
  (msg) => msg.changed.schedules || jobsChanged(msg)
);

const historyView = liveView(
  "history",
  async function () {
    try {
      const r = await api("GET", "/api/v1/leader/history?limit=100");
      clearError();
      const rows = (r.terms || []).map((t) =>
        h("tr", { "data-term": t.term }, h("td", {}, t.term), h("td", {}, t.replica_id), h("td", {}, rfc(t.elected_at)), h("td", {}, t.followed === "0" ? "" : t.followed), h("td", { class: "ended" }, t.ended_reason ? `${t.ended_reason} ${rfc(t.ended_at)}` : ""))
      );
      add(clear($("main")), h("h2", {}, "Failover history"), table(["term", "leader", "elected", "after term", "ended"], rows, "No terms recorded."));
    } catch (e) {
      showError(e);
    }
  },
  (msg) => msg.changed.history || msg.changed.leader
);

function jobView(id) {
  let logAbort = null;
  let following = false;
  const v = {
    name: "job",
    async load() {
      let j;
      try {
        j = await api("GET", "/api/v1/jobs/" + encodeURIComponent(id));
        clearError();
      } catch (e) {
        showError(e);
        return;
      }
      this.draw(j);
    },
    draw(j) {
      const main = clear($("main"));
      const s = j.spec || {};
      const c = j.cleanup || {};
      const terminal = ["FINISHED", "FAILED", "CANCELED"].includes(j.state);
      add(main, 
        h("h2", {}, "Job ", h("span", { id: "job-id" }, j.job_id)),
        h(
          "dl",
          { class: "facts" },
          h("dt", {}, "state"),
          h("dd", { id: "job-state" }, stateName(j.state)),
          h("dt", {}, "worker"),
          h("dd", {}, j.worker),
          h("dt", {}, "submitted"),
          h("dd", {}, `${time(j.submitted_unix_ms)} by `, h("span", { id: "job-submitter" }, j.submitted_by)),
          h("dt", {}, "exit"),
          h("dd", {}, j.has_exit_code ? `code ${j.exit_code}` : j.signal ? `signal ${j.signal}` : ""),
          h("dt", {}, "error"),
          h("dd", { id: "job-error" }, j.error),
          h("dt", {}, "waiting"),
          h("dd", {}, j.waiting_reason)
        ),
        terminal ? null : action("Cancel", "submit", `Cancel job ${j.job_id}?`, () => api("POST", `/api/v1/jobs/${encodeURIComponent(j.job_id)}/cancel`)),
        h("h3", {}, "Log"),
        h("pre", { id: "log", class: "log" }),
        h("h3", {}, "Spec"),
        h("pre", { id: "job-command" }, (s.command || []).join(" ")),
        table(["variable", "value"], sorted(s.env).map(([k, val]) => h("tr", {}, h("td", {}, k), h("td", { class: "env-value" }, val))), "No environment."),
        h("h3", {}, "Attempts"),
        table(["attempt", "worker", "state", "exit", "reason", "at"], (j.history || []).map((a) => h("tr", {}, h("td", {}, a.attempt), h("td", {}, a.worker), h("td", {}, a.state), h("td", {}, a.has_exit_code ? a.exit_code : ""), h("td", {}, a.reason), h("td", {}, time(a.at_unix_ms)))), "No attempts yet."),
        h("h3", {}, "Cleanup"),
        h("p", {}, h("span", { id: "cleanup-state" }, cleanupName(c.state)), c.next_retry_unix_ms && c.next_retry_unix_ms !== "0" ? ` — next retry ${time(c.next_retry_unix_ms)}` : ""),
        c.last_error ? h("pre", { id: "cleanup-error", class: "error" }, c.last_error) : null,
        table(["step", "state", "attempts", "next retry", "last error", "worker"], (c.steps || []).map((st) => h("tr", {}, h("td", {}, st.name), h("td", {}, st.state), h("td", {}, st.attempts), h("td", {}, time(st.next_retry_unix_ms)), h("td", {}, st.last_error), h("td", {}, st.worker))), "No cleanup steps."),
        cleanupActions(j)

      );
      this.log(j);
    },
    async log(j) {
      if (logAbort) logAbort.abort();
      const ctl = new AbortController();
      logAbort = ctl;
      const pre = $("log");
      const headers = token ? { Authorization: "Bearer " + token } : {};
      const path = "/api/v1/jobs/" + encodeURIComponent(j.job_id) + "/logs";
      try {
        if (j.state === "RUNNING") {
          following = true;
          const r = await fetch(path + "/follow", { headers, signal: ctl.signal, cache: "no-store" });
          if (!r.ok) return;
          const reader = r.body.getReader();
          const dec = new TextDecoder();
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            pre.append(dec.decode(value, { stream: true }));
          }
          following = false;
        } else {
          const r = await fetch(path, { headers, signal: ctl.signal, cache: "no-store" });
          pre.textContent = r.ok ? await r.text() : "";
        }
      } catch (_) {
        following = false;
      }
    },
    render() {
      renew(this);
    },
    onUpdate(msg) {
      if (msg.changed.jobs === "all" || msg.changed.jobs.includes(id)) this.reload();
    },
    leave() {
      if (logAbort) logAbort.abort();
      following = false;
    },
  };
  return v;
}

// ---- routing ----

function route() {
  if (view && view.leave) view.leave();
  retire(view);
  const hash = location.hash || "#/";
  const parts = hash.slice(2).split("/");
  if (parts[0] === "jobs" && parts[1]) view = jobView(decodeURIComponent(parts[1]));
  else view = { "": overview, jobs: jobsView, cleanups: cleanupsView, workers: workersView, schedules: schedulesView, history: historyView }[parts[0]] || overview;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("current", a.getAttribute("href") === "#/" + parts[0]);
  clearError();
  if (me) view.render();
}

async function start() {
  if (document.documentElement.dataset.auth === "token" && !token) {
    signIn();
    return;
  }
  try {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const r = await fetch("/api/v1/whoami", { headers, cache: "no-store" });
    if (r.status === 401) {
      signIn(token ? "That token was not accepted." : "");
      return;
    }
    if (!r.ok) throw new Error(`whoami: ${r.status}`);
    me = await r.json();
  } catch (e) {
    setStatus("disconnected");
    setTimeout(start, 1000);
    return;
  }
  renderWho();
  route();
  follow();
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", start);
