// The gateway's status page: reads /admin/status every few seconds and draws it; drains and undrains with the
// admin API. Plain DOM, no framework, no build step. Everything the server sends is set as text, never as HTML.
"use strict";

const EVERY_MS = 2000;
const KEY = "gateway-admin-key";  // the admin key, kept in this tab's sessionStorage only
const $ = (id) => document.getElementById(id);

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function call(method, path) {
  const response = await fetch(path, { method, headers: headers(), cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401 || response.status === 403) {
    askForKey(body.error ? body.error.message : `HTTP ${response.status}`);
    throw new Error("needs an admin key");
  }
  if (!response.ok) throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
  hide($("login"));
  return body;
}

function askForKey(why) {
  $("login").hidden = false;
  $("login-error").textContent = why;
}

function hide(element) { element.hidden = true; }

function fmt(value, unit = "") {
  if (value === null || value === undefined) return "–";
  const n = Number(value);
  const text = n >= 100 ? n.toFixed(0) : n >= 10 ? n.toFixed(1) : n.toFixed(2).replace(/\.?0+$/, "");
  return text + unit;
}

// a sparkline: one polyline over the series (gaps where a value is null), scaled to its own maximum
function spark(svg, values) {
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const numbers = values.filter((v) => v !== null);
  const top = Math.max(1e-9, ...numbers);
  const dx = values.length > 1 ? 120 / (values.length - 1) : 120;
  let points = [];
  const flush = () => {
    if (points.length) {
      const line = document.createElementNS(ns, "polyline");
      line.setAttribute("points", points.join(" "));
      svg.appendChild(line);
    }
    points = [];
  };
  values.forEach((v, i) => {
    if (v === null) { flush(); return; }
    points.push(`${(i * dx).toFixed(1)},${(27 - (v / top) * 25).toFixed(1)}`);
  });
  flush();
  svg.dataset.last = numbers.length ? String(numbers[numbers.length - 1]) : "";
  svg.dataset.max = numbers.length ? String(top) : "";
  svg.setAttribute("aria-label", `latest ${fmt(numbers[numbers.length - 1])}, most ${fmt(numbers.length ? top : null)}`);
}

function decisionsText(decisions) {
  const parts = Object.entries(decisions).map(([reason, n]) => `${reason} ${n}`);
  return parts.length ? `routed by: ${parts.join(", ")}` : "no request in the last minute";
}

function drawBackend(card, b) {
  const set = (field, text) => { card.querySelector(`[data-field="${field}"]`).textContent = text; };
  const recent = b.recent || {};
  set("name", b.name);
  set("state", b.state);
  card.querySelector('[data-field="state"]').className = `badge ${b.state}`;
  set("engine", b.engine);
  set("url", b.url);
  set("models", b.models.join(", ") || "no model yet");
  set("health", b.detail ? `${b.health} (${b.detail})` : b.health);
  set("breaker", b.breaker);
  set("in_flight", `${b.in_flight}${b.in_flight_elsewhere ? ` (+${b.in_flight_elsewhere} elsewhere)` : ""}`
      + (b.max_concurrency ? ` of ${b.max_concurrency}` : ""));
  set("slots", b.slots === null || b.slots === undefined ? "–" : String(b.slots));
  const load = b.load;
  set("load", load ? `${load.running ?? "–"} running, ${load.waiting ?? "–"} waiting`
      + (load.kv_usage !== null && load.kv_usage !== undefined ? `, KV ${fmt(load.kv_usage * 100, "%")}` : "")
      + `, ${fmt(load.age_seconds, " s")} old` : "no reading");
  set("requests", String(recent.requests ?? 0));
  set("ttft", fmt(recent.ttft_p50_ms, " ms"));
  set("tokens_per_second", fmt(recent.tokens_per_second));
  set("decisions", decisionsText(recent.decisions || {}));
  for (const svg of card.querySelectorAll("[data-spark]")) spark(svg, b.series[svg.dataset.spark]);
  const button = card.querySelector('[data-action="drain"]');
  const drained = b.drained;
  button.textContent = drained ? "Undrain" : "Drain";
  button.disabled = b.state === "removing";
  button.onclick = async () => {
    button.disabled = true;
    try {
      await call("POST", `/admin/backends/${encodeURIComponent(b.name)}/${drained ? "undrain" : "drain"}`);
      await refresh();
    } catch (err) {
      showError(err);
    }
  };
}

function drawBackends(backends) {
  const grid = $("backends");
  const cards = new Map([...grid.children].map((card) => [card.dataset.backend, card]));
  for (const b of backends) {
    let card = cards.get(b.name);
    if (!card) {
      card = $("backend-card").content.firstElementChild.cloneNode(true);
      card.dataset.backend = b.name;
      grid.appendChild(card);
    }
    cards.delete(b.name);
    drawBackend(card, b);
  }
  for (const gone of cards.values()) gone.remove();
}

function drawModels(models) {
  const rows = [];
  const row = (cells) => {
    const tr = document.createElement("tr");
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    rows.push(tr);
  };
  for (const [name, backends] of Object.entries(models.served)) {
    const own = models.aliases[name];
    row([name, "served", backends.join(", "), own ? own.fallbacks.join(" → ") : ""]);
  }
  for (const [name, alias] of Object.entries(models.aliases)) {
    if (models.served[name]) continue;
    const split = alias.targets.map((t) => `${t.model} ${Math.round(t.share * 1000) / 10}%`).join(", ");
    row([name, alias.targets.length ? "alias" : "fallbacks only", split, alias.fallbacks.join(" → ")]);
  }
  $("models").tBodies[0].replaceChildren(...rows);
}

function drawFleet(status) {
  const serving = status.backends.filter((b) => b.state === "serving").length;
  $("summary").textContent = `${serving} of ${status.backends.length} backends serving`
    + (status.workers > 1 ? ` · ${status.workers} workers` : "");
  $("updated").textContent = `updated ${new Date(status.time * 1000).toLocaleTimeString()}`;
  $("queued").textContent = String(status.queue.queued);
  spark($("queue-spark"), status.queue.series);
  const top = Math.max(1, ...Object.values(status.decisions));
  $("decisions").replaceChildren(...Object.entries(status.decisions).map(([reason, n]) => {
    const li = document.createElement("li");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${(n / top) * 100}%`;
    const label = document.createElement("span");
    label.textContent = `${reason}: ${n}`;
    li.append(bar, label);
    return li;
  }));
  drawBackends(status.backends);
  drawModels(status.models);
}

function showError(err) {
  const box = $("error");
  box.hidden = false;
  box.textContent = `could not reach the gateway: ${err.message}`;
}

let timer = null;
async function refresh() {
  clearTimeout(timer);
  try {
    drawFleet(await call("GET", "/admin/status"));
    hide($("error"));
    document.body.dataset.loaded = "true";
  } catch (err) {
    if (err.message !== "needs an admin key") showError(err);
  }
  timer = setTimeout(refresh, EVERY_MS);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key").value = "";
  refresh();
});

refresh();
