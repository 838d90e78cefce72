// The ortune dashboard: polls /v1 every couple of seconds; everything it shows comes from the public REST API.
"use strict";

const POLL_MS = 2000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
// losses on the left axis; the held-out quality (a classifier's accuracy, a recognizer's word error rate) on
// the right, 0 to 1
const CHART_SERIES = ["train_loss", "eval_loss", "eval_accuracy", "eval_wer"];

// Where the deployment requires API keys, a 401 shows a key form; the key is kept in localStorage under
// "ortune.api_key" and sent as a bearer token.
function authHeaders() {
  const key = localStorage.getItem("ortune.api_key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path) {
  const res = await fetch(path, { headers: authHeaders() });
  if (res.status === 401) document.getElementById("key-form").hidden = false;
  if (!res.ok) {
    let message = `${res.status} ${res.statusText}`;
    try { message = (await res.json()).error.message; } catch (_) { /* not our error shape */ }
    throw new Error(`${path}: ${message}`);
  }
  return res.json();
}

// A POST to the API with the same key; the response itself (a stream is read by the caller).
async function post(path, body) {
  const headers = { "Content-Type": "application/json", ...authHeaders() };
  const res = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  if (!res.ok) {
    let message = `${res.status} ${res.statusText}`;
    try { message = (await res.json()).error.message; } catch (_) { /* not our error shape */ }
    throw new Error(message);
  }
  return res;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

const when = (unix) => (unix ? new Date(unix * 1000).toLocaleString() : "");
const clock = (unix) => new Date(unix * 1000).toLocaleTimeString();
const bytes = (n) => {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
};
const statusBadge = (status) => el("span", { class: `status ${status}` }, status.replace(/_/g, " "));

function setProgress(bar, progress) {
  const total = progress.total_steps || 0;
  const pct = total ? Math.min(100, (100 * progress.step) / total) : 0;
  bar.querySelector("div").style.width = `${pct}%`;
  bar.querySelector("span").textContent = total ? `${progress.step} / ${total}` : `${progress.step}`;
}

function progressBar(progress) {
  const bar = el("div", { class: "progress" }, el("div"), el("span"));
  setProgress(bar, progress);
  return bar;
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem("ortune.api_key", document.getElementById("key-input").value.trim());
  location.reload();
});

function showPollState(error) {
  const poll = document.getElementById("poll");
  poll.textContent = error ? `update failed: ${error.message}` : `updated ${new Date().toLocaleTimeString()}`;
  poll.className = error ? "error" : "muted";
}

// Poll `tick` until it returns false (the job is finished); a failed poll is shown and retried.
function poll(tick) {
  const loop = async () => {
    let again = true;
    try { again = await tick(); showPollState(null); } catch (err) { showPollState(err); }
    if (again) setTimeout(loop, POLL_MS);
  };
  loop();
}

// ---- the job list ------------------------------------------------------------------------------------------

function jobRow(job, checked) {
  const link = el("a", { href: `/dashboard/jobs/${encodeURIComponent(job.id)}` }, job.id);
  const backend = job.backend_used ? `${job.backend_used}` : `${job.backend} (requested)`;
  const box = el("input", { type: "checkbox", "data-compare": job.id, title: "compare its loss curve" });
  box.checked = checked.has(job.id);
  return el("tr", { "data-job": job.id },
    el("td", {}, box),
    el("td", { class: "mono" }, link),
    el("td", {}, job.model),
    el("td", {}, statusBadge(job.status)),
    el("td", { title: job.backend_reason || "" }, backend),
    el("td", {}, progressBar(job.progress)),
    el("td", {}, when(job.created_at)));
}

function listView() {
  document.getElementById("list-view").hidden = false;
  const body = document.querySelector("#jobs tbody");
  const older = document.getElementById("older");
  let pages = 1;
  older.onclick = () => { pages += 1; };
  const checked = new Set();
  const compare = document.getElementById("compare");
  body.addEventListener("change", (event) => {
    const id = event.target.dataset.compare;
    if (!id) return;
    if (event.target.checked) checked.add(id); else checked.delete(id);
    compare.disabled = checked.size < 2;
  });
  compare.onclick = () => { location.href = `/dashboard/compare?jobs=${[...checked].map(encodeURIComponent).join(",")}`; };
  setUpNewJob();
  poll(async () => {
    const rows = [];
    let after = null, more = false;
    for (let i = 0; i < pages; i++) {
      const page = await api(`/v1/fine_tuning/jobs?limit=50${after ? `&after=${encodeURIComponent(after)}` : ""}`);
      rows.push(...page.data);
      more = page.has_more;
      if (!more || !page.data.length) break;
      after = page.data[page.data.length - 1].id;
    }
    body.replaceChildren(...rows.map((job) => jobRow(job, checked)));
    document.getElementById("jobs-empty").hidden = rows.length > 0;
    older.hidden = !more;
    return true;
  });
}

// ---- a new job: upload a dataset, pick a base model and the common settings, submit ----------------------------

async function fillChoices() {
  const [models, files] = await Promise.all([api("/v1/models"), api("/v1/files?purpose=fine-tune")]);
  // base models and this tenant's fine-tuned ones (a fine-tuned model is a base too)
  document.getElementById("job-model").replaceChildren(...models.data.map((m) => el("option", { value: m.id }, m.id)));
  const usable = files.data.filter((f) => f.status === "processed");
  const option = (f) => el("option", { value: f.id }, `${f.filename} (${f.row_count} ${f.row_kind} rows, ${f.id})`);
  document.getElementById("job-training-file").replaceChildren(...usable.map(option));
  document.getElementById("job-validation-file").replaceChildren(el("option", { value: "" }, "none"), ...usable.map(option));
}

function setUpNewJob() {
  fillChoices().catch(() => { /* a key may be needed first: the key form says so */ });
  const status = document.getElementById("upload-status");
  document.getElementById("upload-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = new FormData();
    form.append("purpose", "fine-tune");
    form.append("file", document.getElementById("upload-file").files[0]);
    status.textContent = "uploading…";
    const res = await fetch("/v1/files", { method: "POST", body: form, headers: authHeaders() });
    const body = await res.json();
    if (!res.ok) status.textContent = body.error.message;
    else if (body.status === "error") status.textContent = `${body.filename} was refused: ${body.status_details}`;
    else status.textContent = `${body.filename}: ${body.row_count} ${body.row_kind} rows, ${body.id}`;
    status.dataset.status = res.ok ? body.status : "refused";
    await fillChoices();
  });
  document.getElementById("job-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const value = (id) => document.getElementById(id).value;
    const hp = {};
    if (value("job-epochs")) hp.n_epochs = Number(value("job-epochs"));
    if (value("job-batch")) hp.batch_size = Number(value("job-batch"));
    if (value("job-lr")) hp.learning_rate_multiplier = Number(value("job-lr"));
    const method = value("job-method");
    const options = { hyperparameters: hp, ...(document.getElementById("job-lora").checked ? { lora: {} } : {}) };
    const body = { model: value("job-model"), training_file: value("job-training-file"), method: { type: method, [method]: options } };
    if (value("job-validation-file")) body.validation_file = value("job-validation-file");
    const error = document.getElementById("job-form-error");
    try {
      const job = await (await post("/v1/fine_tuning/jobs", body)).json();
      location.href = `/dashboard/jobs/${encodeURIComponent(job.id)}`;
    } catch (err) {
      error.hidden = false;
      error.textContent = err.message;
    }
  });
}

// ---- files ------------------------------------------------------------------------------------------------------

function filesView() {
  document.getElementById("files-view").hidden = false;
  const body = document.querySelector("#files tbody");
  poll(async () => {
    const files = await api("/v1/files");
    body.replaceChildren(...files.data.map((f) => {
      const remove = el("button", { type: "button", "data-delete": f.id }, "Delete");
      remove.onclick = async () => {
        const res = await fetch(`/v1/files/${encodeURIComponent(f.id)}`, { method: "DELETE", headers: authHeaders() });
        if (!res.ok) remove.replaceWith(el("span", { class: "error" }, (await res.json()).error.message));
        else remove.closest("tr").remove();
      };
      return el("tr", { "data-file": f.id },
        el("td", { class: "mono" }, f.id), el("td", {}, f.filename), el("td", {}, statusBadge(f.status)),
        el("td", {}, f.row_count), el("td", { class: "error" }, f.status_details || ""), el("td", {}, bytes(f.bytes)),
        el("td", {}, remove));
    }));
    return true;
  });
}

// ---- several jobs' loss curves on one chart -------------------------------------------------------------------

async function compareView(ids) {
  document.getElementById("compare-view").hidden = false;
  const target = document.getElementById("compare-chart");
  const series = await Promise.all(ids.map((id) =>
    api(`/v1/fine_tuning/jobs/${encodeURIComponent(id)}/metrics?name=train_loss&max_points=1000`)));
  const colours = ["#2f6fde", "#d9822b", "#2e9d5b", "#b03a9b", "#7a7a7a", "#c23b3b"];
  const opts = {
    width: Math.max(320, target.clientWidth || 900), height: 320, scales: { x: { time: false } },
    axes: [{ label: "step" }, { label: "train loss" }],
    series: [{ label: "step" }, ...ids.map((id, i) => ({ label: id, stroke: colours[i % colours.length], width: 1.5, spanGaps: true }))],
  };
  const data = uPlot.join(series.map((m) => {
    const s = m.data.train_loss || { steps: [], values: [] };
    return [s.steps, s.values];
  }));
  new uPlot(opts, data, target);
  target.dataset.series = String(ids.length);
}

// ---- one job -------------------------------------------------------------------------------------------------

function lossChart(target) {
  const opts = {
    width: Math.max(320, target.clientWidth || 900),
    height: 280,
    scales: { x: { time: false }, quality: { range: [0, 1] } },
    axes: [{ label: "step" }, { label: "loss" }, { scale: "quality", side: 1, label: "accuracy / WER", grid: { show: false } }],
    series: [
      { label: "step" },
      { label: "train loss", stroke: "#2f6fde", width: 1.5, spanGaps: true },
      { label: "eval loss", stroke: "#d9822b", width: 2, spanGaps: true, points: { show: true, size: 6 } },
      { label: "eval accuracy", scale: "quality", stroke: "#2e9e5b", width: 2, dash: [6, 4], spanGaps: true,
        points: { show: true, size: 6 } },
      { label: "eval WER", scale: "quality", stroke: "#b03a9e", width: 2, dash: [6, 4], spanGaps: true,
        points: { show: true, size: 6 } },
    ],
  };
  const chart = new uPlot(opts, [[], [], [], [], []], target);
  window.addEventListener("resize", () => chart.setSize({ width: target.clientWidth || 900, height: 280 }));
  return chart;
}

function renderFacts(job) {
  const facts = [
    ["Status", statusBadge(job.status)],
    ["Model", job.model],
    ["Task", job.task],
    ["Backend", job.backend_used ? `${job.backend_used} (asked: ${job.backend})` : `${job.backend} (not started)`],
    ["Why", job.backend_reason],
    ["Optimizer / precision", `${job.optim} / ${job.precision}`],
    ["Attempt", job.attempt],
    ["Created", when(job.created_at)],
    ["Finished", when(job.finished_at)],
    ["Fine-tuned model", job.fine_tuned_model],
  ];
  const dl = document.getElementById("job-facts");
  const shown = facts.filter(([, v]) => v !== null && v !== undefined && v !== "");
  dl.replaceChildren(...shown.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  setProgress(document.getElementById("job-progress"), job.progress);
  const error = document.getElementById("job-error");
  error.hidden = !job.error;
  error.textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";
}

function renderChart(chart, metrics) {
  const series = CHART_SERIES.map((name) => metrics.data[name] || { steps: [], values: [] });
  const data = uPlot.join(series.map((s) => [s.steps, s.values]));
  while (data.length < CHART_SERIES.length + 1) data.push([]);
  chart.setData(data);
  const points = series.reduce((n, s) => n + s.steps.length, 0);
  const target = document.getElementById("chart");
  target.dataset.points = String(points);
  target.dataset.series = CHART_SERIES.filter((_, i) => series[i].steps.length > 0).join(" ");
  document.getElementById("chart-empty").hidden = points > 0;
}

function renderEvents(events) {
  const items = events.data.map((e) =>
    el("li", { class: e.level }, el("time", { datetime: new Date(e.created_at * 1000).toISOString() }, clock(e.created_at)),
      el("span", {}, e.message)));
  document.getElementById("events").replaceChildren(...items);
}

function renderCheckpoints(checkpoints) {
  const rows = checkpoints.data.map((c) => el("tr", {},
    el("td", {}, c.step_number),
    el("td", {}, c.metrics.loss ?? c.metrics.train_loss ?? ""),
    el("td", {}, bytes(c.bytes)),
    el("td", { class: "mono", title: c.sha256 }, c.sha256.slice(0, 16))));
  document.querySelector("#checkpoints tbody").replaceChildren(...rows);
}

function renderDownloads(artifacts) {
  if (!artifacts.length) return;
  const items = artifacts.map((a) => el("li", {},
    el("a", { href: a.url, download: "", "data-format": a.format }, `Download ${a.format === "onnx" ? "ONNX" : "PyTorch"}`),
    el("span", { class: "muted" }, ` ${bytes(a.bytes)}, sha256 `),
    el("code", { title: a.sha256 }, a.sha256.slice(0, 16))));
  document.getElementById("downloads").replaceChildren(...items);
}

function renderTrials(job, trials) {
  // A search does not train itself: its trials do, and each has its own page with its curve.
  const search = job.hyperparameter_search;
  document.getElementById("trials-section").hidden = !search;
  document.getElementById("training-section").hidden = !!search;
  document.getElementById("checkpoints-section").hidden = !!search;
  if (!search) return;
  const best = job.result && job.result.best_job_id;
  document.getElementById("trials-metric").textContent = `${search.metric} (${search.direction})`;
  const rows = trials.data.map((t) => {
    const shown = Object.entries(t.search_params || {}).map(([k, v]) => `${k}=${typeof v === "number" ? v.toPrecision(3) : v}`);
    const value = t.result?.metrics?.[search.metric];
    return el("tr", { class: t.id === best ? "best" : "" },
      el("td", { class: "mono" }, el("a", { href: `/dashboard/jobs/${encodeURIComponent(t.id)}` }, t.id)),
      el("td", { class: "mono" }, shown.join(", ")),
      el("td", {}, statusBadge(t.status)),
      el("td", {}, value === undefined ? "" : value.toPrecision(4)));
  });
  document.querySelector("#trials tbody").replaceChildren(...rows);
}

// The playground of a succeeded job: chat with a causal LM (its reply streamed as it is decoded), or label
// scores for a text from a classifier; both through the public inference endpoints.
function setUpPlayground(job) {
  const section = document.getElementById("playground");
  if (!section.hidden || !job.fine_tuned_model) return;
  section.hidden = false;
  const chat = job.task === "causal-lm";
  const input = document.getElementById("playground-input");
  const output = document.getElementById("playground-output");
  input.placeholder = chat ? "Say something to the model" : "A text to classify";
  document.getElementById("playground-send").textContent = chat ? "Send" : "Score";
  document.getElementById("playground-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    output.dataset.done = "0";
    output.replaceChildren();
    try {
      if (chat) await streamChat(job.fine_tuned_model, input.value, output);
      else await score(job.fine_tuned_model, input.value, output);
    } catch (err) {
      output.replaceChildren(el("span", { class: "error" }, err.message));
    }
    output.dataset.done = "1";
  });
}

async function streamChat(model, text, output) {
  const res = await post("/v1/chat/completions", {
    model, messages: [{ role: "user", content: text }], max_tokens: 64, temperature: 0, stream: true,
  });
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += value;
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") return;
      const delta = JSON.parse(data).choices?.[0]?.delta?.content;
      if (delta) output.append(delta);
    }
  }
}

async function score(model, text, output) {
  const res = await post("/v1/predict", { model, inputs: [text] });
  const [scores] = (await res.json()).data;
  output.replaceChildren(...scores.map((s) => el("div", { class: "score", "data-label": s.label },
    el("span", {}, s.label), el("span", { class: "mono" }, ` ${s.score.toFixed(4)}`))));
}

function jobView(jobId) {
  document.getElementById("job-view").hidden = false;
  document.getElementById("job-title").textContent = jobId;
  document.title = `${jobId} · ortune`;
  const chart = lossChart(document.getElementById("chart"));
  const base = `/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}`;
  const names = CHART_SERIES.map((n) => `name=${n}`).join("&");
  poll(async () => {
    const [job, metrics, events, checkpoints] = await Promise.all([
      api(base), api(`${base}/metrics?${names}&max_points=1000`), api(`${base}/events?limit=100`),
      api(`${base}/checkpoints?limit=20`),
    ]);
    renderFacts(job);
    renderChart(chart, metrics);
    renderEvents(events);
    renderCheckpoints(checkpoints);
    renderTrials(job, job.hyperparameter_search ? await api(`${base}/trials`) : { data: [] });
    if (job.status === "succeeded") {
      const artifacts = await api(`${base}/artifacts`);
      renderDownloads(artifacts);
      if (artifacts.some((a) => a.format === "onnx")) setUpPlayground(job);
    }
    return !TERMINAL.has(job.status);
  });
}

const match = location.pathname.match(/^\/dashboard\/jobs\/([^/]+)\/?$/);
if (match) jobView(decodeURIComponent(match[1]));
else if (location.pathname.startsWith("/dashboard/files")) filesView();
else if (location.pathname.startsWith("/dashboard/compare")) {
  compareView((new URLSearchParams(location.search).get("jobs") || "").split(",").filter(Boolean));
} else listView();
