// The playground: builds OpenAI-compatible requests with the verification dial, streams them with the
// provenance extension (`provenance: true`) and marks each token by how it was made. Everything it needs
// comes from the server's public API: /v1/models, /v1/verification and the completion endpoints.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
let dial = null;  // GET /v1/verification
let model = null;
let running = [];  // AbortControllers of the requests in flight

// Slider bounds for parameters without an upper end, and starting values for those without a default.
const OPEN_SLIDER_MAX = 2;
const START = { weight: 0.5, lenience: 0.5, alpha: 0.1, epsilon: 0.1, delta: 0.1 };

async function init() {
  try {
    const [models, verification] = await Promise.all([getJSON("/v1/models"), getJSON("/v1/verification")]);
    model = models.data[0].id;
    dial = verification;
    $("#model").textContent = `model ${model} · server's verification ${dial.default} · heads: ` +
      (models.data[0].heads.join(", ") || "none");
  } catch (error) {
    $("#model").textContent = `could not reach the server: ${error.message}`;
    return;
  }
  const dials = $("#dials");
  dials.append(makeDial("A", dial.default), makeDial("B", "lossy:0.5"));
  dials.children[1].hidden = true;
  $("#compare").addEventListener("change", (event) => { dials.children[1].hidden = !event.target.checked; });
  $("#request").addEventListener("submit", (event) => { event.preventDefault(); generate(); });
  $("#stop").addEventListener("click", stop);
}

async function getJSON(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

// One setting of the dial: rule, its parameters (slider and number kept in step), head and shift, drafter.
function makeDial(name, initial) {
  const node = $("#dial-template").content.firstElementChild.cloneNode(true);
  node.dataset.dial = name;
  $("legend", node).textContent = `Verification ${name}`;
  const rule = $(".rule", node);
  for (const r of dial.rules) rule.add(new Option(r.name, r.name));
  const [initialRule, initialValues] = parseVerification(initial);
  rule.value = dial.rules.some((r) => r.name === initialRule) ? initialRule : "exact";
  const head = $(".head", node);
  const diversed = dial.rules.find((r) => r.name === "diversed");
  for (const h of diversed ? diversed.heads : []) head.add(new Option(h, h));
  const drafter = $(".drafter", node);
  for (const d of dial.drafters) {
    const option = new Option(d.name + (d.available ? "" : " (no draft model)"), d.name);
    option.disabled = !d.available;
    drafter.add(option);
  }
  drafter.value = dial.default_drafter;
  const render = (values = {}) => {
    const spec = dial.rules.find((r) => r.name === rule.value);
    $(".summary", node).textContent = spec.summary;
    const box = $(".parameters", node);
    box.replaceChildren(...spec.parameters.map((p) => makeParameter(name, p, values[p.name])));
    $(".head-row", node).hidden = spec.name !== "diversed";
  };
  rule.addEventListener("change", () => render());
  render(initialValues);
  return node;
}

function makeParameter(dialName, p, value) {
  const row = document.createElement("div");
  row.className = "parameter";
  const id = `dial-${dialName}-${p.name}`;
  const label = document.createElement("label");
  label.htmlFor = id;
  label.textContent = `${p.name} (${p.range})`;
  const slider = document.createElement("input");
  slider.type = "range";
  slider.min = p.min;
  slider.max = p.max ?? Math.max(OPEN_SLIDER_MAX, 4 * (p.default ?? 0));
  slider.step = "any";
  slider.setAttribute("aria-label", `${p.name} slider`);
  const number = document.createElement("input");
  number.type = "number";
  number.id = id;
  number.step = "0.01";
  number.dataset.parameter = p.name;
  number.value = value ?? p.default ?? START[p.name] ?? p.min;
  slider.value = number.value;
  slider.addEventListener("input", () => { number.value = Number(slider.value).toFixed(3).replace(/\.?0+$/, ""); });
  number.addEventListener("input", () => { slider.value = number.value; });
  row.append(label, slider, number);
  return row;
}

// "static:0.7" -> ["static", {weight: "0.7"}]; the first value belongs to the rule's first parameter.
function parseVerification(text) {
  const [name, rest] = text.split(/:(.*)/s);
  const spec = dial.rules.find((r) => r.name === name);
  const values = {};
  if (spec && rest && spec.parameters.length) {
    const [first, ...others] = rest.split(",");
    values[spec.parameters[0].name] = first;
    for (const item of others) {
      const [key, value] = item.split("=");
      values[key] = value;
    }
  }
  return [name, values];
}

// The dial as the request's `verification`, written as --verification spells it; values go as typed, so the
// server judges them (and says what is wrong).
function verification(node) {
  const name = $(".rule", node).value;
  if (name === "diversed") {
    const shift = Number($(".shift", node).value || 0);
    return `diversed:${$(".head", node).value}` + (shift ? `@${shift > 0 ? "+" : ""}${shift}` : "");
  }
  const values = [...node.querySelectorAll(".parameters input[type=number]")]
    .map((input, i) => (i === 0 ? input.value : `${input.dataset.parameter}=${input.value}`));
  return values.length ? `${name}:${values.join(",")}` : name;
}

function requestBody(node) {
  const chat = document.querySelector("input[name=endpoint]:checked").value === "chat";
  const prompt = $("#prompt").value;
  const body = { model, stream: true, stream_options: { include_usage: true }, provenance: true,
                 verification: verification(node), drafter: $(".drafter", node).value };
  // An empty prompt is sent as none, for the server to refuse.
  if (chat) body.messages = prompt ? [{ role: "user", content: prompt }] : [];
  else body.prompt = prompt;
  for (const [field, id] of [["max_tokens", "#max-tokens"], ["temperature", "#temperature"], ["seed", "#seed"]]) {
    const value = $(id).value;
    if (value !== "") body[field] = Number(value);
  }
  const cap = $(".draft-length", node).value;
  if (cap !== "") body.max_drafts = Number(cap);
  const prediction = $("#prediction").value;
  if (prediction) body.prediction = { type: "content", content: prediction };
  return [chat ? "/v1/chat/completions" : "/v1/completions", body];
}

async function generate() {
  stop();
  const nodes = [...$("#dials").children].filter((node) => !node.hidden);
  const answers = $("#answers");
  answers.replaceChildren();
  $("#generate").disabled = true;
  $("#stop").disabled = false;
  await Promise.all(nodes.map((node) => {
    const [url, body] = requestBody(node);
    const panel = new Answer(node.dataset.dial, body.verification);
    answers.append(panel.node);
    return panel.run(url, body);
  }));
  $("#generate").disabled = false;
  $("#stop").disabled = true;
}

function stop() {
  for (const controller of running) controller.abort();
  running = [];
}

// One answer: its tokens as they stream, marked by origin, and its figures.
class Answer {
  constructor(name, verification) {
    this.node = $("#answer-template").content.firstElementChild.cloneNode(true);
    this.node.dataset.dial = name;
    $("h2", this.node).textContent = `${name}: ${verification}`;
    this.text = $(".text", this.node);
    this.records = [];
    this.selected = -1;
    this.text.addEventListener("keydown", (event) => this.key(event));
    this.text.addEventListener("click", (event) => this.pick(event));
    this.text.addEventListener("mouseover", (event) => this.pick(event));
    this.text.addEventListener("focus", () => { if (this.selected < 0 && this.records.length) this.select(0); });
  }

  async run(url, body) {
    const controller = new AbortController();
    running.push(controller);
    this.started = performance.now();
    try {
      const response = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" },
                                          body: JSON.stringify(body), signal: controller.signal });
      if (!response.ok) {
        this.fail(await response.json().catch(() => ({ error: { message: `HTTP ${response.status}` } })));
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          if (event.startsWith("data: ") && event !== "data: [DONE]") this.chunk(JSON.parse(event.slice(6)));
        }
      }
    } catch (error) {
      if (error.name !== "AbortError") this.fail({ error: { message: error.message } });
    }
  }

  chunk(body) {
    if (body.error) return this.fail(body);
    for (const choice of body.choices || []) this.add(choice.provenance || []);
    if (body.speculative) this.finish(body.speculative);
  }

  fail(body) {
    const error = body.error || {};
    const where = error.param ? ` (${error.param})` : "";
    const box = $(".error", this.node);
    box.textContent = `The server refused the request${where}: ${error.message}`;
    box.hidden = false;
  }

  add(records) {
    for (const record of records) {
      const span = document.createElement("span");
      const index = this.records.length;
      span.className = `token origin-${record.origin}`;
      span.id = `${this.node.dataset.dial}-token-${index}`;
      span.dataset.index = index;
      span.dataset.origin = record.origin;
      span.textContent = record.token;
      this.text.append(span);
      this.records.push(record);
    }
    this.figures();
  }

  figures(server) {
    const rounds = new Map();
    const origins = {};
    for (const r of this.records) {
      origins[r.origin] = (origins[r.origin] || 0) + 1;
      const round = rounds.get(r.round) || { drafted: r.drafted, drafter: r.drafter, kept: 0 };
      if (r.origin === "kept" || r.origin === "relaxed") round.kept += 1;
      rounds.set(r.round, round);
    }
    const drafters = {};
    let drafted = 0, kept = 0;
    for (const round of rounds.values()) {
      drafted += round.drafted;
      kept += round.kept;
      if (round.drafted) {
        const d = drafters[round.drafter] || (drafters[round.drafter] = [0, 0]);
        d[0] += round.kept;
        d[1] += round.drafted;
      }
    }
    const seconds = (performance.now() - this.started) / 1000;
    const set = (cls, text) => { $(`.${cls}`, this.node).textContent = text; };
    const perSecond = (this.records.length / seconds).toFixed(1);
    set("tokens-per-s", server ? `${perSecond} (server: ${fixed(server.tokens_per_s, 1)})` : perSecond);
    set("acceptance", drafted ? `${(100 * kept / drafted).toFixed(1)}% (${kept}/${drafted})` : "–");
    set("per-pass", rounds.size ? (this.records.length / rounds.size).toFixed(2) : "–");
    set("drafters", Object.entries(drafters).map(([d, [k, n]]) => `${d} ${k}/${n}`).join(", ") || "–");
    set("origins", Object.entries(origins).map(([o, n]) => `${o} ${n}`).join(", ") || "–");
  }

  finish(speculative) {
    this.figures(speculative);
  }

  pick(event) {
    const span = event.target.closest(".token");
    if (span) this.select(Number(span.dataset.index));
  }

  key(event) {
    const moves = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, Home: -Infinity, End: Infinity };
    if (!(event.key in moves) || !this.records.length) return;
    event.preventDefault();
    const next = Math.min(Math.max((this.selected < 0 ? 0 : this.selected) + moves[event.key], 0),
                          this.records.length - 1);
    this.select(next);
  }

  select(index) {
    const old = this.text.querySelector(".selected");
    if (old) old.classList.remove("selected");
    const span = this.text.children[index];
    span.classList.add("selected");
    this.text.setAttribute("aria-activedescendant", span.id);
    this.selected = index;
    $("#details").textContent = describe(this.records[index], this.node.dataset.dial);
  }
}

function fixed(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function describe(r, dialName) {
  const lines = [`${dialName}: token ${JSON.stringify(r.token)} (id ${r.token_id}), ${r.origin}, verify pass ${r.round}`];
  if (r.drafter) lines.push(`drafter: ${r.drafter}, ${r.drafted} drafted in this pass`);
  lines.push(`target probability p = ${fixed(r.p, 4)}`);
  if (r.origin === "correction") lines.push(`rejected draft ${JSON.stringify(r.rejected)} (id ${r.rejected_token_id})`);
  if (r.q !== null) lines.push(`draft probability q = ${fixed(r.q, 4)} (of the drafted token)`);
  if (r.acceptance !== null) {
    lines.push(`this rule keeps the draft with probability ${fixed(r.acceptance, 4)}; exact with ${fixed(r.exact_acceptance, 4)}`);
  }
  return lines.join("\n");
}

init();
