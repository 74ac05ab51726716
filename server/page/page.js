// mtpserve chat page. Plain JavaScript, no build step, no other host: it streams
// /v1/chat/completions from this server with the `mtp_trace` extension, which tells, per token,
// whether it was an MTP draft the trunk accepted, and the K of each engine cycle.
'use strict';

const $ = (id) => document.getElementById(id);
const KEY_STORE = 'mtpserve.apiKey';
const SETTINGS_STORE = 'mtpserve.settings';
const SETTING_IDS = ['preset', 'temperature', 'top_p', 'top_k', 'max_tokens', 'draft_tokens', 'thinking', 'extra'];

const state = {
  model: null,
  key: localStorage.getItem(KEY_STORE) || '',
  presets: {},
  history: [], // {role, content} sent back to the server
  controller: null,
  afterKey: null, // what to retry once the user gave a key
};

// ---------------------------------------------------------------------------------------------
// Markdown: a small renderer that escapes every piece of text it emits (the model's output is
// never inserted as HTML). `tok` maps each character of `src` to the token that produced it, so
// characters of accepted drafts are wrapped in <span class="drf">.
// ---------------------------------------------------------------------------------------------
const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
const esc = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

const INLINE = new RegExp(
  [
    '(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)', // 1,2: code span
    '\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*', // 3: strong
    '\\*(?=[^\\s*])([^*]*?[^\\s*])\\*', // 4: emphasis
    '(?<![\\w])_(?=[^\\s_])([^_]*?[^\\s_])_(?![\\w])', // 5: emphasis
    '\\[([^\\]\\n]+)\\]\\((https?:[^\\s)]+)\\)', // 6,7: link
  ].join('|'),
  'g',
);

function renderMarkdown(src, tok, tokens) {
  const txt = (a, b) => {
    if (!tok) return esc(src.slice(a, b));
    let out = '';
    for (let i = a; i < b; ) {
      const t = tok[i];
      let j = i + 1;
      while (j < b && tok[j] === t) j++;
      const piece = esc(src.slice(i, j));
      const info = t >= 0 ? tokens[t] : null;
      out += info && info.drafted
        ? `<span class="drf" data-t="${t}" title="accepted draft, cycle with K=${info.k}">${piece}</span>`
        : piece;
      i = j;
    }
    return out;
  };

  const inline = (a, b) => {
    const s = src.slice(a, b);
    const re = new RegExp(INLINE.source, 'g');
    let out = '';
    let last = 0;
    let m;
    while ((m = re.exec(s)) !== null) {
      const at = a + m.index;
      out += txt(a + last, at);
      if (m[1] !== undefined) {
        const inner = at + m[1].length;
        out += `<code>${txt(inner, inner + m[2].length)}</code>`;
      } else if (m[3] !== undefined) {
        out += `<strong>${inline(at + 2, at + 2 + m[3].length)}</strong>`;
      } else if (m[4] !== undefined || m[5] !== undefined) {
        const body = m[4] !== undefined ? m[4] : m[5];
        out += `<em>${inline(at + 1, at + 1 + body.length)}</em>`;
      } else {
        out += `<a href="${esc(m[7])}" rel="noopener noreferrer" target="_blank">${inline(at + 1, at + 1 + m[6].length)}</a>`;
      }
      last = m.index + m[0].length;
    }
    return out + txt(a + last, b);
  };

  // Lines with their offsets in src.
  const lines = [];
  for (let start = 0; start <= src.length; ) {
    let end = src.indexOf('\n', start);
    if (end < 0) end = src.length;
    lines.push({ a: start, b: end, s: src.slice(start, end) });
    start = end + 1;
  }
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+/;
  const QUOTE = /^ {0,3}> ?/;
  const isBlockStart = (s) => FENCE.test(s) || HEADING.test(s) || RULE.test(s) || ITEM.test(s) || QUOTE.test(s);

  let html = '';
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line.s);
    if (fence) {
      const closer = new RegExp(`^ {0,3}${fence[1][0] === '`' ? '`' : '~'}{${fence[1].length},}\\s*$`);
      const first = i + 1;
      let j = first;
      while (j < lines.length && !closer.test(lines[j].s)) j++;
      const a = first < lines.length ? lines[first].a : line.b;
      const b = j > first ? lines[j - 1].b : a;
      const lang = fence[2] ? `<span class="lang">${esc(fence[2])}</span>` : '';
      html += `<pre>${lang}<code>${txt(a, b)}</code></pre>`;
      i = j + 1;
      continue;
    }
    if (!line.s.trim()) { i++; continue; }
    const heading = HEADING.exec(line.s);
    if (heading) {
      const n = heading[1].length;
      html += `<h${n}>${inline(line.a + heading[0].length, line.b)}</h${n}>`;
      i++;
      continue;
    }
    if (RULE.test(line.s)) { html += '<hr>'; i++; continue; }
    if (QUOTE.test(line.s)) {
      const parts = [];
      while (i < lines.length && QUOTE.test(lines[i].s)) {
        const cut = QUOTE.exec(lines[i].s)[0].length;
        parts.push(inline(lines[i].a + cut, lines[i].b));
        i++;
      }
      html += `<blockquote>${parts.join('<br>')}</blockquote>`;
      continue;
    }
    const item = ITEM.exec(line.s);
    if (item) {
      const ordered = /\d/.test(item[2]);
      const items = [];
      while (i < lines.length) {
        const m = ITEM.exec(lines[i].s);
        if (m && /\d/.test(m[2]) === ordered) {
          items.push(inline(lines[i].a + m[0].length, lines[i].b));
        } else if (lines[i].s.trim() && /^\s+/.test(lines[i].s) && items.length && !isBlockStart(lines[i].s)) {
          items[items.length - 1] += '<br>' + inline(lines[i].a, lines[i].b); // continuation
        } else {
          break;
        }
        i++;
      }
      const tag = ordered ? 'ol' : 'ul';
      html += `<${tag}>${items.map((x) => `<li>${x}</li>`).join('')}</${tag}>`;
      continue;
    }
    const parts = [];
    while (i < lines.length && lines[i].s.trim() && (!parts.length || !isBlockStart(lines[i].s))) {
      parts.push(inline(lines[i].a, lines[i].b));
      i++;
    }
    html += `<p>${parts.join('<br>')}</p>`;
  }
  return html;
}

// ---------------------------------------------------------------------------------------------
// One assistant reply: its text, the token behind each character, and the cycle figures.
// ---------------------------------------------------------------------------------------------
// Tokens whose whole text is a tag (<think>, </think>, <tool_call>, ...) are markup the server
// removes from the text; they are not aligned with characters.
const MARKUP = /^<\/?[A-Za-z_][\w-]*>$/;

class Reply {
  constructor(view) {
    this.view = view;
    this.reasoning = '';
    this.content = '';
    this.rTok = [];
    this.cTok = [];
    this.rawText = ''; // the tokens' own text, in order, markup left out
    this.rawTok = [];
    this.rawPos = 0;
    this.tokens = []; // {drafted, k}
    this.cycles = []; // {k, accepted, n}
    this.deltas = 0;
    this.started = performance.now();
    this.firstAt = null;
    this.lastAt = null;
    this.usage = null;
    this.finish = null;
    this.traced = false;
  }

  addTrace(trace) {
    this.traced = true;
    const k = trace.draft_tokens ?? 0;
    let accepted = 0;
    for (const token of trace.tokens) {
      const t = this.tokens.length;
      this.tokens.push({ drafted: token.drafted, k });
      if (token.drafted) accepted++;
      if (!MARKUP.test(token.text)) {
        this.rawText += token.text;
        for (let i = 0; i < token.text.length; i++) this.rawTok.push(t);
      }
    }
    this.cycles.push({ k, accepted, n: trace.tokens.length });
  }

  // The token index of each character of `s`, a piece of the reply's reasoning or content.
  align(s) {
    const out = new Array(s.length).fill(-1);
    const at = this.rawText.indexOf(s, this.rawPos);
    if (at >= 0) {
      for (let i = 0; i < s.length; i++) out[i] = this.rawTok[at + i];
      this.rawPos = at + s.length;
      return out;
    }
    let p = this.rawPos; // the server reshaped the text: match character by character
    for (let i = 0; i < s.length; i++) {
      const j = this.rawText.indexOf(s[i], p);
      if (j >= 0) { out[i] = this.rawTok[j]; p = j + 1; }
    }
    this.rawPos = p;
    return out;
  }

  addDelta(delta) {
    const now = performance.now();
    if (this.firstAt === null) this.firstAt = now;
    this.lastAt = now;
    this.deltas++;
    if (delta.reasoning_content) {
      this.reasoning += delta.reasoning_content;
      this.rTok.push(...this.align(delta.reasoning_content));
    }
    if (delta.content) {
      this.content += delta.content;
      this.cTok.push(...this.align(delta.content));
    }
  }

  get markedDrafts() {
    return this.tokens.reduce((n, t) => n + (t.drafted ? 1 : 0), 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Views
// ---------------------------------------------------------------------------------------------
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function scrollToEnd() {
  const log = $('log');
  log.scrollTop = log.scrollHeight;
}

function userView(text) {
  const box = el('div', 'msg user');
  const body = el('div', 'md');
  body.innerHTML = renderMarkdown(text, null, null);
  box.append(body);
  $('log').append(box);
  scrollToEnd();
  return box;
}

function assistantView() {
  const box = el('div', 'msg assistant');
  const reasoning = el('details', 'reasoning');
  reasoning.hidden = true;
  const summary = el('summary', '', 'Reasoning');
  const reasoningBody = el('div', 'md');
  reasoning.append(summary, reasoningBody);
  const content = el('div', 'md content');
  const status = el('div', 'state', 'waiting for the model…');
  const figures = el('div', 'figures');
  figures.hidden = true;
  box.append(reasoning, content, status, figures);
  $('log').append(box);
  scrollToEnd();
  return { box, reasoning, summary, reasoningBody, content, status, figures };
}

const SVG = 'http://www.w3.org/2000/svg';

function kChart(cycles) {
  const svg = document.createElementNS(SVG, 'svg');
  const n = Math.max(cycles.length, 40);
  const kMax = Math.max(4, ...cycles.map((c) => c.k));
  const w = 10;
  svg.setAttribute('viewBox', `0 0 ${n * w} ${kMax * 10 + 2}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('role', 'img');
  svg.setAttribute('aria-label', `K per cycle over ${cycles.length} cycles`);
  const bar = (cls, x, h) => {
    const r = document.createElementNS(SVG, 'rect');
    r.setAttribute('class', cls);
    r.setAttribute('x', x + 1);
    r.setAttribute('width', w - 2);
    r.setAttribute('y', kMax * 10 + 2 - h);
    r.setAttribute('height', h);
    svg.append(r);
  };
  cycles.forEach((c, i) => {
    bar('k', i * w, c.k * 10 + 2); // a plain cycle (K=0) shows as a thin line
    if (c.accepted) bar('acc', i * w, c.accepted * 10);
  });
  return svg;
}

function pct(x) { return `${(100 * x).toFixed(0)}%`; }

function renderFigures(reply) {
  const f = reply.view.figures;
  const spec = reply.usage ? reply.usage.speculative || {} : null;
  const tokens = reply.usage ? reply.usage.completion_tokens : reply.tokens.length || reply.deltas;
  const cycles = reply.traced ? reply.cycles.length : spec ? spec.cycles : 0;
  const proposed = reply.cycles.reduce((n, c) => n + c.k, 0);
  const marked = reply.markedDrafts;
  let tps;
  if (spec && spec.generation_tokens_per_second) {
    tps = spec.generation_tokens_per_second;
  } else if (reply.firstAt !== null && reply.lastAt > reply.firstAt) {
    tps = (tokens - 1) / ((reply.lastAt - reply.firstAt) / 1000);
  }
  const rate = spec ? spec.acceptance_rate : proposed ? marked / proposed : 0;
  const accepted = spec ? spec.accepted : marked;
  const perCycle = cycles ? tokens / cycles : 0;
  const nums = el('div', 'nums');
  const item = (label, value, name) => {
    const span = el('span');
    span.append(`${label} `);
    const b = el('b', '', value);
    if (name) b.dataset.name = name;
    span.append(b);
    nums.append(span);
  };
  item('tokens', String(tokens), 'tokens');
  item('tokens/s', tps ? tps.toFixed(1) : '…', 'tps');
  item('acceptance', `${pct(rate)} (${accepted}/${spec ? spec.proposed : proposed})`, 'acceptance');
  item('tokens/cycle', perCycle ? perCycle.toFixed(2) : '…', 'per-cycle');
  item('cycles', String(cycles), 'cycles');
  f.replaceChildren(nums);
  if (reply.cycles.length) {
    f.append(kChart(reply.cycles));
    f.append(el('div', 'caption', 'K per cycle (grey: drafts proposed, green: drafts accepted). '
      + 'Highlighted text: drafts the trunk accepted.'));
  }
  f.dataset.marked = String(marked);
  f.dataset.usageAccepted = spec ? String(spec.accepted) : '';
  f.hidden = false;
}

function renderReply(reply) {
  const v = reply.view;
  if (reply.reasoning) {
    v.reasoning.hidden = false;
    v.reasoningBody.innerHTML = renderMarkdown(reply.reasoning, reply.rTok, reply.tokens);
    v.summary.textContent = reply.finish || reply.content ? 'Reasoning' : 'Reasoning…';
  }
  v.content.innerHTML = renderMarkdown(reply.content, reply.cTok, reply.tokens);
  renderFigures(reply);
  scrollToEnd();
}

let pending = null;
function scheduleRender(reply) {
  if (pending) return;
  pending = requestAnimationFrame(() => {
    pending = null;
    renderReply(reply);
  });
}

// ---------------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------------
function readSettings() {
  const num = (id) => {
    const v = $(id).value.trim();
    return v === '' ? undefined : Number(v);
  };
  const body = {};
  const preset = state.presets[$('preset').value];
  if (preset) Object.assign(body, preset);
  for (const id of ['temperature', 'top_p', 'top_k', 'max_tokens']) {
    const v = num(id);
    if (v !== undefined && !Number.isNaN(v)) body[id] = v;
  }
  const k = $('draft_tokens').value;
  if (k !== '') body.draft_tokens = k === 'auto' ? 'auto' : Number(k);
  body.chat_template_kwargs = { enable_thinking: $('thinking').checked };
  const extra = $('extra').value.trim();
  if (extra) {
    const parsed = JSON.parse(extra); // a SyntaxError is shown to the user
    if (typeof parsed !== 'object' || parsed === null || Array.isArray(parsed)) {
      throw new Error('extra request fields must be a JSON object');
    }
    Object.assign(body, parsed);
  }
  return body;
}

function saveSettings() {
  const saved = {};
  for (const id of SETTING_IDS) saved[id] = $(id).type === 'checkbox' ? $(id).checked : $(id).value;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(saved));
}

function restoreSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || '{}'); } catch { saved = {}; }
  for (const id of SETTING_IDS) {
    if (!(id in saved)) continue;
    if ($(id).type === 'checkbox') $(id).checked = Boolean(saved[id]);
    else $(id).value = saved[id];
  }
}

function applyPreset() {
  const preset = state.presets[$('preset').value];
  if (!preset) return;
  for (const id of ['temperature', 'top_p', 'top_k']) {
    if (preset[id] !== undefined) $(id).value = preset[id];
  }
}

async function loadPresets() {
  try {
    const r = await fetch('/page/presets.json');
    state.presets = r.ok ? await r.json() : {};
  } catch { state.presets = {}; }
  const select = $('preset');
  const chosen = select.value;
  for (const name of Object.keys(state.presets)) {
    const option = el('option', '', name);
    option.value = name;
    select.append(option);
  }
  select.value = chosen;
}

// ---------------------------------------------------------------------------------------------
// Talking to the server
// ---------------------------------------------------------------------------------------------
function headers() {
  const h = { 'Content-Type': 'application/json' };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

function askKey(retry) {
  state.afterKey = retry;
  $('key').value = '';
  $('key-dialog').showModal();
  $('key').focus();
}

async function loadModel() {
  let r;
  try {
    r = await fetch('/v1/models', { headers: headers() });
  } catch (err) {
    $('model').textContent = `server unreachable (${err.message})`;
    return;
  }
  if (r.status === 401) { askKey(loadModel); return; }
  if (!r.ok) { $('model').textContent = `models: HTTP ${r.status}`; return; }
  const data = await r.json();
  state.model = data.data && data.data.length ? data.data[0].id : null;
  $('model').textContent = state.model || 'no model';
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch { /* not JSON */ }
  return `HTTP ${response.status}`;
}

function setBusy(busy) {
  $('send').hidden = busy;
  $('stop').hidden = !busy;
  document.body.classList.toggle('busy', busy);
}

// SSE frames ("data: {json}\n\n") from a fetch body.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = frame.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
      if (data) yield data;
    }
  }
}

async function send() {
  const text = $('prompt').value;
  if (!text.trim() || state.controller) return;
  if (!state.model) await loadModel();
  if (!state.model) return;
  let settings;
  try {
    settings = readSettings();
  } catch (err) {
    $('settings').hidden = false;
    $('settings-toggle').setAttribute('aria-expanded', 'true');
    $('extra').focus();
    alert(`Settings: ${err.message}`);
    return;
  }
  saveSettings();
  $('intro').hidden = true;
  $('prompt').value = '';
  const userBox = userView(text);
  const messages = [...state.history, { role: 'user', content: text }];
  const view = assistantView();
  const reply = new Reply(view);
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const body = {
    ...settings,
    model: state.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    mtp_trace: true,
  };
  let stopped = false;
  let failed = null;
  try {
    const response = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: headers(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (response.status === 401) {
      userBox.remove();
      view.box.remove();
      $('prompt').value = text;
      state.controller = null;
      setBusy(false);
      askKey(send);
      return;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    view.status.textContent = 'streaming…';
    for await (const data of sseEvents(response)) {
      if (data === '[DONE]') break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || 'error');
      if (chunk.usage) reply.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.index !== 0) continue;
        if (choice.mtp_trace) reply.addTrace(choice.mtp_trace);
        if (choice.delta) reply.addDelta(choice.delta);
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
      scheduleRender(reply);
    }
  } catch (err) {
    if (err.name === 'AbortError') stopped = true;
    else failed = err.message;
  } finally {
    state.controller = null;
    setBusy(false);
  }
  if (pending) { cancelAnimationFrame(pending); pending = null; }
  renderReply(reply);
  view.box.dataset.done = stopped ? 'stopped' : failed ? 'error' : 'finished';
  view.status.className = failed ? 'state error' : 'state';
  view.status.textContent = failed
    ? `Error: ${failed}`
    : stopped ? 'stopped' : reply.finish === 'length' ? 'cut at max tokens' : '';
  view.status.hidden = !view.status.textContent;
  if (reply.content || reply.reasoning) {
    state.history = [...messages, { role: 'assistant', content: reply.content }];
  } else {
    state.history = messages;
  }
  $('prompt').focus();
}

function stop() {
  if (state.controller) state.controller.abort();
}

// ---------------------------------------------------------------------------------------------
// Wiring
// ---------------------------------------------------------------------------------------------
function init() {
  restoreSettings();
  $('composer').addEventListener('submit', (e) => { e.preventDefault(); send(); });
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    } else if (e.key === 'Escape') {
      stop();
    }
  });
  $('stop').addEventListener('click', () => { stop(); $('prompt').focus(); });
  $('settings-toggle').addEventListener('click', () => {
    const panel = $('settings');
    panel.hidden = !panel.hidden;
    $('settings-toggle').setAttribute('aria-expanded', String(!panel.hidden));
    if (!panel.hidden) $('preset').focus();
  });
  $('settings').addEventListener('submit', (e) => e.preventDefault());
  $('settings').addEventListener('change', saveSettings);
  $('preset').addEventListener('change', () => { applyPreset(); saveSettings(); });
  $('mark').addEventListener('change', () => $('log').classList.toggle('nomark', !$('mark').checked));
  $('new-chat').addEventListener('click', () => {
    stop();
    state.history = [];
    for (const node of [...$('log').querySelectorAll('.msg')]) node.remove();
    $('intro').hidden = false;
    $('prompt').focus();
  });
  $('forget-key').addEventListener('click', () => {
    state.key = '';
    localStorage.removeItem(KEY_STORE);
  });
  $('key-form').addEventListener('submit', () => {
    state.key = $('key').value.trim();
    localStorage.setItem(KEY_STORE, state.key);
    const retry = state.afterKey;
    state.afterKey = null;
    if (retry) retry();
  });
  // Focus goes back to the message box once the dialog has closed (not while it is modal).
  $('key-dialog').addEventListener('close', () => $('prompt').focus());
  loadPresets().then(restoreSettings);
  loadModel();
  $('prompt').focus();
}

init();
