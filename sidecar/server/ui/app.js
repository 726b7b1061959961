// The built-in page: a chat playground over /v1/chat/completions (SSE) and a live engine view from
// /metrics. Plain DOM and canvas; everything comes from this server, nothing from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "sidecar-api-key";
const PLOT_POINTS = 120; // samples each plot keeps: two minutes at one per second
const POLL_MS = 1000;

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  history: [], // {role, content} of the conversation so far
  busy: false,
  series: {}, // plot id -> values
  last: null, // previous metrics sample, for rates
};

function headers(json) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  if (state.key) h["authorization"] = "Bearer " + state.key;
  return h;
}

// Every API call carries the key; a 401 opens the key panel (the page itself needs none).
async function api(path, init = {}) {
  const r = await fetch(path, { ...init, headers: headers(Boolean(init.body)) });
  if (r.status === 401) {
    askKey(state.key ? "The API key was refused; enter another." : "This server needs an API key.");
    throw new Error("an API key is required");
  }
  return r;
}

function askKey(message) {
  $("key-msg").textContent = message;
  $("key-panel").hidden = false;
  $("api-key").focus();
}

function saveKey() {
  state.key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key-panel").hidden = true;
  loadModels();
}

async function errorText(r) {
  try {
    const d = await r.json();
    return (d.error && d.error.message) || JSON.stringify(d);
  } catch (e) {
    return r.status + " " + r.statusText;
  }
}

async function loadModels() {
  let r;
  try {
    r = await api("/v1/models");
  } catch (e) {
    $("server-state").textContent = e.message;
    return;
  }
  if (!r.ok) {
    $("server-state").textContent = await errorText(r);
    return;
  }
  const data = (await r.json()).data;
  const select = $("model");
  select.replaceChildren();
  for (const m of data) {
    if (!m.parent && !m.max_model_len) continue; // the embedding model: not a chat model
    const opt = document.createElement("option");
    opt.value = m.id;
    opt.textContent = m.parent ? m.id + " (adapter of " + m.parent + ")" : m.id;
    select.append(opt);
  }
  const base = data[0];
  $("server-state").textContent = "serving " + base.id + " · context " + base.max_model_len + " tokens";
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// Splits a reply into (reasoning, answer): a separate reasoning stream when the server sends one,
// else a leading <think>...</think> block of the text.
function splitReasoning(text, reasoning) {
  if (reasoning) return [reasoning, text];
  const m = /^\s*<think>([\s\S]*?)(<\/think>|$)([\s\S]*)$/.exec(text);
  return m ? [m[1], m[3]] : ["", text];
}

function renderReply(div, text, reasoning, stats) {
  const [thought, answer] = splitReasoning(text, reasoning);
  div.replaceChildren();
  if (thought) {
    const d = document.createElement("details");
    const s = document.createElement("summary");
    s.textContent = "Reasoning";
    d.append(s, document.createTextNode(thought));
    div.append(d);
  }
  div.append(document.createTextNode(answer));
  if (stats) {
    const s = document.createElement("span");
    s.className = "stats";
    s.textContent = stats;
    div.append(s);
  }
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true } };
  const num = (id) => Number($(id).value);
  if ($("temperature").value !== "") body.temperature = num("temperature");
  if ($("top-p").value !== "") body.top_p = num("top-p");
  if ($("max-tokens").value !== "") body.max_tokens = num("max-tokens");
  return body;
}

// Reads the SSE body, calling onChunk for each JSON event until [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

function statsLine(t0, first, lastAt, usage, cache) {
  const parts = [];
  if (first !== null) parts.push("TTFT " + Math.round(first - t0) + " ms");
  const n = usage ? usage.completion_tokens : 0;
  if (n > 1 && first !== null) parts.push("TPOT " + ((lastAt - first) / (n - 1)).toFixed(1) + " ms");
  if (usage) {
    parts.push(n + " tokens");
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(cached + " of " + usage.prompt_tokens + " prompt tokens cached");
  }
  parts.push("cache " + (cache || "n/a"));
  return parts.join(" · ");
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.busy) return;
  state.busy = true;
  $("send").disabled = true;
  $("prompt").value = "";
  bubble("user", text);
  state.history.push({ role: "user", content: text });
  const div = bubble("assistant", "…");
  try {
    await stream(div);
  } catch (e) {
    div.className = "msg error";
    div.textContent = e.message;
    state.history.pop();
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

async function stream(div) {
  const t0 = performance.now();
  const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(requestBody()) });
  if (!r.ok) throw new Error(await errorText(r));
  const cache = r.headers.get("x-sidecar-cache");
  let text = "", reasoning = "", usage = null, first = null, lastAt = null;
  await readEvents(r, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
    const piece = (delta.content || "") + (delta.reasoning_content || "");
    if (piece) {
      lastAt = performance.now();
      if (first === null) first = lastAt;
      text += delta.content || "";
      reasoning += delta.reasoning_content || "";
      renderReply(div, text, reasoning, null);
      div.scrollIntoView({ block: "end" });
    }
  });
  renderReply(div, text, reasoning, statsLine(t0, first, lastAt, usage, cache));
  div.dataset.done = "true";
  state.history.push({ role: "assistant", content: splitReasoning(text, reasoning)[1] });
}

// -- engine view ------------------------------------------------------------------------------------

// Prometheus text -> {name: value}, labelled series summed per name ("name{kind=...}" kept too).
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const v = Number(m[3]);
    out[m[1]] = (out[m[1]] || 0) + v;
    if (m[2]) out[m[1] + m[2]] = v;
  }
  return out;
}

function plot(id, value, max) {
  const s = (state.series[id] = state.series[id] || []);
  s.push(value);
  if (s.length > PLOT_POINTS) s.shift();
  const c = $(id);
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const top = Math.max(max || 0, ...s, 1e-9);
  g.strokeStyle = "#2f6fde";
  g.lineWidth = 1.5;
  g.beginPath();
  s.forEach((v, i) => {
    const x = (i / (PLOT_POINTS - 1)) * c.width;
    const y = c.height - 2 - (v / top) * (c.height - 4);
    if (i === 0) g.moveTo(x, y);
    else g.lineTo(x, y);
  });
  g.stroke();
  c.dataset.samples = String(s.length);
}

const pct = (x) => (100 * x).toFixed(1) + " %";

function showSample(m, now) {
  const running = m.sidecar_num_requests_running || 0;
  const waiting = m.sidecar_num_requests_waiting || 0;
  const kv = m.sidecar_kv_cache_usage_ratio || 0;
  const generated = m.sidecar_generation_tokens_total || 0;
  let tps = 0;
  if (state.last) {
    const dt = (now - state.last.at) / 1000;
    if (dt > 0) tps = Math.max(0, (generated - state.last.generated) / dt);
  }
  state.last = { at: now, generated };
  const queries = m.sidecar_prefix_cache_queries_total || 0;
  const prefix = queries ? (m.sidecar_prefix_cache_hits_total || 0) / queries : 0;
  const lookups = m.sidecar_semantic_cache_lookups_total;
  const semantic = lookups ? (m.sidecar_semantic_cache_hits_total || 0) / lookups : 0;
  $("m-running").textContent = String(running);
  $("m-waiting").textContent = String(waiting);
  $("m-kv").textContent = pct(kv);
  $("m-tps").textContent = tps.toFixed(1);
  $("m-prefix").textContent = queries ? pct(prefix) : "–";
  $("m-semantic").textContent = lookups ? pct(semantic) : "no lookups";
  $("m-generated").textContent = String(generated);
  plot("p-running", running);
  plot("p-waiting", waiting);
  plot("p-kv", kv, 1);
  plot("p-tps", tps);
  plot("p-prefix", prefix, 1);
  plot("p-semantic", semantic, 1);
}

async function poll() {
  try {
    const r = await fetch("/metrics", { headers: headers(false) });
    if (r.ok) showSample(parseMetrics(await r.text()), performance.now());
  } catch (e) {
    $("server-state").textContent = "server unreachable";
  }
  setTimeout(poll, POLL_MS);
}

function init() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("clear").addEventListener("click", () => {
    state.history = [];
    $("messages").replaceChildren();
  });
  $("key-save").addEventListener("click", saveKey);
  $("api-key").addEventListener("keydown", (e) => {
    if (e.key === "Enter") saveKey();
  });
  $("key-open").addEventListener("click", () => askKey("API key for this server's API calls:"));
  loadModels();
  poll();
}

init();
