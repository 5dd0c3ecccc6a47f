// octacloud dashboard: polls /dashboard/api/state once a second and redraws. No framework, no build step.
// The admin key (when the cloud has auth on) lives in sessionStorage and travels only in the Authorization header.
"use strict";

const POLL_MS = 1000;
const HISTORY_S = 900;
const KEY_ITEM = "octacloud.adminKey";
const $ = (id) => document.getElementById(id);

const history = { allocation: [], fragmentation: [], qps: {}, latency: {} };
let since = 0;
let last = null;
let timer = null;

const pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(x < 0.1 ? 1 : 0)} %`);
const mib = (bytes) => (bytes == null ? "–" : `${(bytes / 1048576).toFixed(0)} MiB`);

function append(store, points) {
  for (const p of points) store.push(p);
  const cutoff = (store.length ? store[store.length - 1][0] : 0) - HISTORY_S;
  while (store.length && store[0][0] < cutoff) store.shift();
}

// ---- key handling ---------------------------------------------------------------------------------------

function headers() {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function askForKey(message) {
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("login-key").focus();
}

$("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("login-key").value.trim());
  $("login-key").value = "";
  $("login").hidden = true;
  poll();
});

$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_ITEM);
  askForKey("");
});

$("colour-by").addEventListener("change", () => last && render(last));

// ---- polling --------------------------------------------------------------------------------------------

async function poll() {
  clearTimeout(timer);
  try {
    const response = await fetch(`/dashboard/api/state?since=${since}`, { headers: headers(), cache: "no-store" });
    if (response.status === 401) {
      const hadKey = !!sessionStorage.getItem(KEY_ITEM);
      sessionStorage.removeItem(KEY_ITEM);
      askForKey(hadKey ? "That key was refused (it must be an admin key)." : "");
      setStatus("needs the admin key", true);
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    append(history.allocation, data.allocation);
    append(history.fragmentation, data.fragmentation);
    for (const d of data.deployments) {
      append((history.qps[d.name] ||= []), d.qps);
      append((history.latency[d.name] ||= []), d.latency_ms);
    }
    since = Math.max(since, ...data.allocation.map((p) => p[0]), since);
    last = data;
    $("logout").hidden = !sessionStorage.getItem(KEY_ITEM);
    render(data);
    setStatus(`updated ${new Date(data.at * 1000).toLocaleTimeString()}`, false);
  } catch (error) {
    setStatus(`cannot reach the cloud (${error.message})`, true);
  }
  timer = setTimeout(poll, POLL_MS);
}

function setStatus(text, bad) {
  $("status").textContent = text;
  $("status").classList.toggle("stale", bad);
}

// ---- drawing --------------------------------------------------------------------------------------------

function render(data) {
  const by = $("colour-by").value;
  const fleet = data.fleet;
  $("kpi-alloc").textContent = pct(fleet.allocation);
  $("kpi-frag").textContent = pct(fleet.fragmentation);
  const ready = data.replicas.filter((r) => r.state === "ready").length;
  $("kpi-ready").textContent = `${ready}/${data.replicas.length}`;
  $("kpi-pending").textContent = data.scheduler.pending;
  const ms = data.scheduler.mean_decision_ms;
  $("kpi-decision").textContent = ms == null ? "–" : `${ms.toFixed(2)} ms`;
  setPalettes(data);
  renderFleet(fleet, by);
  renderChart($("chart-cluster"), [
    { name: "allocated", points: history.allocation, colour: "#4a7fd4" },
    { name: "fragmented (of idle)", points: history.fragmentation, colour: "#d4804a" },
  ]);
  renderDeployments(data.deployments);
  renderReplicas(data.replicas);
  renderTenants(data.tenants);
  renderEvents(data.events);
}

function renderChart(el, lines) {
  const w = 900, h = 150, pad = 28;
  const all = lines.flatMap((l) => l.points);
  if (!all.length) { el.innerHTML = `<svg viewBox="0 0 ${w} ${h}"><text x="${pad}" y="${h / 2}">waiting for samples…</text></svg>`; return; }
  const t1 = Math.max(...all.map((p) => p[0])), t0 = Math.min(t1 - 60, ...all.map((p) => p[0]));
  const x = (t) => pad + ((t - t0) / Math.max(1, t1 - t0)) * (w - pad - 8);
  const y = (v) => h - 18 - Math.min(1, Math.max(0, v)) * (h - 30);
  const grid = [0, 0.5, 1].map((v) => `<line class="axis" x1="${pad}" x2="${w - 8}" y1="${y(v)}" y2="${y(v)}"/><text x="0" y="${y(v) + 3}">${v * 100}%</text>`).join("");
  const paths = lines.map((l) => `<polyline fill="none" stroke="${l.colour}" stroke-width="2" points="${l.points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ")}"/>`).join("");
  const legend = lines.map((l, i) => `<text x="${pad + 8 + i * 170}" y="${h - 2}" style="fill:${l.colour}">■ ${esc(l.name)}: ${pct(l.points.length ? l.points[l.points.length - 1][1] : null)}</text>`).join("");
  el.innerHTML = `<svg viewBox="0 0 ${w} ${h}" preserveAspectRatio="none">${grid}${paths}${legend}</svg>`;
}

function spark(points, colourName) {
  if (!points || points.length < 2) return `<svg class="spark"></svg>`;
  const tail = points.slice(-120);
  const max = Math.max(1e-9, ...tail.map((p) => p[1]));
  const coords = tail.map((p, i) => `${((i / (tail.length - 1)) * 118 + 1).toFixed(1)},${(25 - (p[1] / max) * 23).toFixed(1)}`).join(" ");
  return `<svg class="spark" viewBox="0 0 120 26"><polyline fill="none" stroke="${colour(colourName)}" stroke-width="1.5" points="${coords}"/></svg>`;
}

function histogram(sizes) {
  const entries = Object.entries(sizes);
  if (!entries.length) return `<span class="muted">–</span>`;
  const max = Math.max(...entries.map(([, n]) => n));
  return `<span class="hist" title="${esc(entries.map(([s, n]) => `batch ${s}: ${n}`).join(", "))}">${entries.map(([s, n]) => `<span data-size="${esc(s)}" style="height:${Math.max(4, (28 * n) / max)}px"></span>`).join("")}</span>`;
}

function lastValue(points) {
  return points && points.length ? points[points.length - 1][1] : null;
}

// ---- paged tables: a page of rows in the DOM, however many there are; a filter over the row's text ----------

const PAGE_ROWS = { deployments: 25, replicas: 50, tenants: 25 };
const pages = {};

function paged(id, rows, text, row) {
  const state = (pages[id] ||= { page: 0, filter: "" });
  const wanted = state.filter.toLowerCase();
  const shown = wanted ? rows.filter((r) => text(r).toLowerCase().includes(wanted)) : rows;
  const size = PAGE_ROWS[id];
  const count = Math.max(1, Math.ceil(shown.length / size));
  state.page = Math.min(state.page, count - 1);
  const first = state.page * size;
  setHtml($(id).tBodies[0], shown.slice(first, first + size).map(row).join(""));
  const pager = document.querySelector(`.pager[data-for="${id}"]`);
  pager.hidden = rows.length <= size && !wanted;
  pager.querySelector(".range").textContent = shown.length
    ? `${first + 1}–${Math.min(shown.length, first + size)} of ${shown.length}${wanted ? ` (of ${rows.length})` : ""}`
    : `none of ${rows.length}`;
  pager.querySelector("[data-step='-1']").disabled = state.page === 0;
  pager.querySelector("[data-step='1']").disabled = state.page >= count - 1;
}

for (const pager of document.querySelectorAll(".pager")) {
  const id = pager.dataset.for;
  pages[id] = { page: 0, filter: "" };
  pager.addEventListener("click", (event) => {
    const step = event.target.closest("[data-step]");
    if (!step) return;
    pages[id].page = Math.max(0, pages[id].page + Number(step.dataset.step));
    if (last) render(last);
  });
  pager.querySelector("input").addEventListener("input", (event) => {
    pages[id] = { page: 0, filter: event.target.value.trim() };
    if (last) render(last);
  });
}

function renderDeployments(deployments) {
  paged("deployments", deployments, (d) => `${d.name} ${d.model} ${d.tenant}`, (d) => {
    const qps = lastValue(history.qps[d.name]);
    const latency = lastValue(history.latency[d.name]);
    return `<tr data-deployment="${esc(d.name)}">
      <td><i style="display:inline-block;width:10px;height:10px;background:${colour(d.name)};margin-right:6px"></i>${esc(d.name)}</td>
      <td>${esc(d.model)}</td><td>${esc(d.tenant)}</td><td class="num">${d.octants}</td><td class="num">${d.ready}/${d.desired}</td>
      <td class="num">${qps == null ? "–" : qps.toFixed(1)} ${spark(history.qps[d.name], d.name)}</td>
      <td class="num">${latency == null ? "–" : `${latency.toFixed(1)} ms`} ${spark(history.latency[d.name], d.name)}</td>
      <td>${d.generation ? generation(d.generation) : histogram(d.batch_sizes)}</td></tr>`;
  });
}

function generation(g) {
  const ms = (v) => (v == null ? "–" : `${v.toFixed(1)} ms`);
  const rate = lastValue(g.tokens_per_s);
  const kv = g.kv_cache_usage == null ? "–" : `${(g.kv_cache_usage * 100).toFixed(0)} %`;
  return `<span class="generation">TTFT ${ms(g.ttft_p50_ms)} / ${ms(g.ttft_p99_ms)} · ITL ${ms(g.itl_p50_ms)} / ${ms(g.itl_p99_ms)} · ${rate == null ? "–" : rate.toFixed(1)} tok/s · KV ${kv} · ${g.running} running, ${g.waiting} waiting</span>`;
}

function renderReplicas(replicas) {
  paged("replicas", replicas, (r) => `${r.id} ${r.state} ${r.node} ${r.deployment} ${r.tenant}`, (r) => `<tr data-replica="${esc(r.id)}" title="${esc(r.message)}">
    <td>${esc(r.id)}</td><td class="state-${esc(r.state)}">${esc(r.state)}</td>
    <td>${r.node ? `${esc(r.node)} [${r.gpus.join(",")}] × ${r.milli_per_gpu / 125} oct` : esc(r.message || "–")}</td>
    <td class="num">${pct(r.busy)}</td><td class="num">${r.cpu_cores == null ? "–" : r.cpu_cores.toFixed(2)}</td>
    <td class="num">${mib(r.rss_bytes)}</td><td class="num">${r.restarts}</td></tr>`);
}

function renderTenants(tenants) {
  paged("tenants", tenants, (t) => t.tenant, (t) => `<tr data-tenant="${esc(t.tenant)}">
    <td><i style="display:inline-block;width:10px;height:10px;background:${colour(t.tenant, "tenant")};margin-right:6px"></i>${esc(t.tenant)}</td>
    <td class="num">${t.deployments}</td><td class="num">${t.replicas}</td><td class="num">${t.octants}</td>
    <td>${usage(t.usage)}</td></tr>`);
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0;
  while (n >= 1024 && k < units.length - 1) { n /= 1024; k += 1; }
  return `${n.toFixed(k ? 1 : 0)} ${units[k]}`;
}

// Metering totals (closed intervals of the ledger), in readable units.
function usage(u) {
  if (!u) return "–";
  return esc([
    `${u.octant_seconds.toLocaleString()} octant·s`,
    `${u.exec_seconds.toLocaleString()} s executing`,
    `${u.inferences.toLocaleString()} inferences`,
    `${u.requests.toLocaleString()} requests`,
    `${bytes(u.bytes_in)} in / ${bytes(u.bytes_out)} out`,
  ].join(" · "));
}

function renderEvents(events) {
  setHtml($("events"), events.map((e) => `<li><time>${new Date(e.at * 1000).toLocaleTimeString()}</time>
    <span class="kind">${esc(e.kind)}</span> ${esc(e.subject)} — ${esc(e.message)}</li>`).join(""));
}

poll();
