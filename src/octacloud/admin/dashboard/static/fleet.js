// octacloud dashboard: the fleet map and its colours. A small fleet is drawn whole (every node, card and octant);
// a big one one cell per node, grouped by rack, and a click zooms to that node's cards and octants.
"use strict";

const DETAIL_CARDS = 32;  // fleets with more cards than this are drawn by rack and node until one node is picked
const GOLDEN = 0.618033988749895;
const LIGHTNESS = [45, 60, 35];
const OCTANT_PX = { all: 21, node: 37 };  // an octant's width in a card (196 px, or 324 px zoomed in): a label
// fits a run when its text does
const CHAR_PX = 6;

const fleetView = { zoom: "" };  // the node zoomed into ("" for the whole fleet); kept across polls
const palettes = { deployment: { colours: new Map(), keys: new Map(), light: new Set() }, tenant: { colours: new Map(), keys: new Map(), light: new Set() } };

// An element's HTML is replaced only when it changed: a poll that brings the same fleet costs no DOM work (and
// keeps the hover and the tooltip under the pointer).
let drawn = new WeakMap();

function setHtml(el, html) {
  if (drawn.get(el) === html) return;
  drawn.set(el, html);
  el.innerHTML = html;
}

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// A colour per deployment (and per tenant), distinct at any count: the sorted names' hues a golden ratio apart, in
// three bands of lightness (as `octacloud top` draws them), and a short key (#1, #2, ...) that the legend explains.
function setPalette(kind, names) {
  const colours = new Map(), keys = new Map(), light = new Set();
  [...new Set(names)].sort().forEach((name, i) => {
    colours.set(name, `hsl(${(((i * GOLDEN) % 1) * 360).toFixed(1)}, 70%, ${LIGHTNESS[i % 3]}%)`);
    keys.set(name, `#${i + 1}`);
    if (LIGHTNESS[i % 3] > 50) light.add(name);  // labelled in dark ink
  });
  palettes[kind] = { colours, keys, light };
}

function colour(name, kind = "deployment") {
  return palettes[kind].colours.get(name) || "#888";
}

function setPalettes(data) {
  const cells = data.fleet.nodes.flatMap((n) => n.cards.flatMap((c) => c.octants.filter(Boolean)));
  setPalette("deployment", [...data.deployments.map((d) => d.name), ...cells.map((o) => o.deployment)]);
  setPalette("tenant", [...data.tenants.map((t) => t.tenant), ...cells.map((o) => o.tenant)]);
}

function rackOf(node) {
  return (node.domains && node.domains.rack) || "-";
}

function heldOctants(cards) {
  return cards.reduce((n, c) => n + c.octants.filter(Boolean).length, 0);
}

function renderFleet(fleet, by) {
  const cards = fleet.nodes.reduce((n, node) => n + node.cards.length, 0);
  const zoomed = fleet.nodes.find((n) => n.name === fleetView.zoom);
  if (!zoomed) fleetView.zoom = "";
  const el = $("fleet");
  if (cards <= DETAIL_CARDS) {
    el.dataset.view = "all";
    setHtml(el, fleet.nodes.map((node) => nodeDetail(node, by, OCTANT_PX.all)).join(""));
  } else if (zoomed) {
    el.dataset.view = "node";
    setHtml(el, `<nav class="crumbs"><button type="button" data-zoom="">all ${fleet.nodes.length} nodes</button>
      › rack ${esc(rackOf(zoomed))} › <b>${esc(zoomed.name)}</b></nav>${nodeDetail(zoomed, by, OCTANT_PX.node)}`);
  } else {
    el.dataset.view = "racks";
    setHtml(el, racks(fleet.nodes, by));
  }
  const shown = zoomed && cards > DETAIL_CARDS ? [zoomed] : fleet.nodes;  // the legend: who is on the map
  const used = new Set(shown.flatMap((n) => n.cards.flatMap((c) => c.octants.filter(Boolean).map((o) => o[by]))));
  const { colours, keys } = palettes[by];
  setHtml($("legend"), [...colours].filter(([name]) => used.has(name))
    .map(([name, c]) => `<span data-name="${esc(name)}"><i style="background:${c}"></i><b>${keys.get(name)}</b> ${esc(name)}</span>`).join("")
    + `<span><i style="background:var(--free)"></i>free octant</span>`);
}

// One section per rack, one cell per node: its octants held, and a bar of who holds them.
function racks(nodes, by) {
  const byRack = new Map();
  for (const node of nodes) {
    if (!byRack.has(rackOf(node))) byRack.set(rackOf(node), []);
    byRack.get(rackOf(node)).push(node);
  }
  return [...byRack].sort(([a], [b]) => a.localeCompare(b)).map(([rack, members]) => {
    const total = members.reduce((n, m) => n + 8 * m.cards.length, 0);
    const held = members.reduce((n, m) => n + heldOctants(m.cards), 0);
    const healthy = members.filter((m) => m.health === "healthy").length;
    const title = rack === "-" ? "nodes without a rack" : `rack ${esc(rack)}`;
    return `<div class="rack" data-rack="${esc(rack)}"><h3>${title} <span>${members.length} nodes, ${healthy} healthy · ${held}/${total} octants (${pct(total ? held / total : 0)})</span></h3>
      <div class="nodes">${members.map((m) => nodeCell(m, by)).join("")}</div></div>`;
  }).join("");
}

function nodeCell(node, by) {
  const total = 8 * node.cards.length;
  const count = new Map();
  for (const card of node.cards) for (const o of card.octants) if (o) {
    const name = o[by];
    count.set(name, (count.get(name) || 0) + 1);
  }
  const held = [...count.values()].reduce((a, b) => a + b, 0);
  let at = 0;
  const stops = [...count].sort(([a], [b]) => a.localeCompare(b)).map(([name, n]) => {
    const from = (100 * at) / total;
    at += n;
    return `${colour(name, by)} ${from.toFixed(2)}% ${((100 * at) / total).toFixed(2)}%`;
  });
  stops.push(`var(--free) ${((100 * at) / total).toFixed(2)}% 100%`);
  const short = node.name.startsWith(`${rackOf(node)}-`) ? node.name.slice(rackOf(node).length + 1) : node.name;
  const who = [...count].sort((a, b) => b[1] - a[1]).slice(0, 5).map(([name, n]) => `${name} ${n}`).join(", ");
  return `<button type="button" class="node-cell ${esc(node.health)}" data-zoom="${esc(node.name)}" data-held="${held}" data-total="${total}"
    title="${esc(node.name)} (${esc(node.health)}) · ${held}/${total} octants${who ? ` · ${esc(who)}` : ""} · click for its cards">
    <span class="name">${esc(short)}</span><span class="use">${held}/${total}</span>
    <i class="mix" style="background:linear-gradient(90deg, ${stops.join(", ")})"></i></button>`;
}

// A node's cards, each a row of octants; a replica's octants on a card form one run, labelled within it.
function nodeDetail(node, by, octantPx) {
  const cards = node.cards.map((card) => {
    const t = card.telemetry || {};
    const util = t.utilisation;
    const label = t.source === "nvml" ? "GPU util" : "busy (replica-measured)";
    const memory = t.memory_used_mib == null ? "" : `${t.memory_used_mib.toFixed(0)} MiB used`;
    return `<div class="card${card.usable ? "" : " unusable"}" data-node="${esc(node.name)}" data-gpu="${card.index}">
      <div class="title"><span>card ${card.index} · ${esc(card.model)}</span><span>${(1000 - card.free_milli) / 125}/8</span></div>
      <div class="octants">${runs(node, card, by, octantPx)}</div>
      <div class="meter"><span>${label}</span><span>${pct(util)}</span></div>
      <div class="bar"><i style="width:${Math.min(100, 100 * (util || 0))}%"></i></div>
      <div class="meter"><span>${memory}</span><span>${t.power_w == null ? "" : `${t.power_w.toFixed(0)} W`}</span></div>
    </div>`;
  }).join("");
  const d = node.domains || {};
  const where = [d.zone, d.rack, d.power_feed].some(Boolean)
    ? ` <span class="domains" title="zone / rack / power feed">${[d.zone, d.rack, d.power_feed].map((p) => esc(p || "-")).join(" / ")}</span>` : "";
  return `<div class="node ${esc(node.health)}" data-node="${esc(node.name)}"><h3>${esc(node.name)} <span>${esc(node.health)}</span>${where}</h3><div class="cards">${cards}</div></div>`;
}

function runs(node, card, by, octantPx) {
  const groups = [];
  card.octants.forEach((o, k) => {
    const open = groups[groups.length - 1];
    if (o && open && open.cell && open.cell.replica === o.replica) open.octants.push(k);
    else groups.push({ cell: o, octants: [k] });
  });
  const at = `data-node="${esc(node.name)}" data-gpu="${card.index}"`;
  return groups.map(({ cell, octants }) => {
    if (!cell) return `<div class="run free" style="grid-column:span 1"><div class="octant free" ${at} data-octant="${octants[0]}"></div></div>`;
    const name = cell[by];
    const text = name.length * CHAR_PX <= octants.length * octantPx - 4 ? name : palettes[by].keys.get(name) || "?";
    const cells = octants.map((k) => `<div class="octant ${esc(cell.state)}" style="background-color:${colour(name, by)}" ${at} data-octant="${k}"
      data-replica="${esc(cell.replica)}" data-deployment="${esc(cell.deployment)}" data-tenant="${esc(cell.tenant)}"></div>`).join("");
    return `<div class="run" style="grid-column:span ${octants.length}" title="${esc(cell.replica)} · ${esc(cell.deployment)} · tenant ${esc(cell.tenant)} · ${esc(cell.state)}">
      ${cells}<span class="label${palettes[by].light.has(name) ? " dark" : ""}">${esc(text)}</span></div>`;
  }).join("");
}

document.getElementById("fleet").addEventListener("click", (event) => {
  const target = event.target.closest("[data-zoom]");
  if (!target) return;
  fleetView.zoom = target.dataset.zoom;
  if (last) renderFleet(last.fleet, $("colour-by").value);
});
