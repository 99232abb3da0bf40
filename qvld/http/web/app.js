"use strict";
// qvld's page: conversations about pictures and clips, kept in this browser (Store),
// answers streamed from /v1/chat/completions and shown as markdown (Markdown). It uses
// the public API only: whatever it does, a script could do.
//
// A conversation is a tree of turns (a question, its picture or clip, its answer): editing
// a question or regenerating an answer adds a sibling, a branch. The branch shown runs
// from the first turn to `leaf`. The daemon keeps one branch's history in a session
// (X-Qvld-Session): a follow-up to the turn the session holds sends only what is new,
// and says how many turns it expects the session to hold (session_turns); anything else
// (another branch, a stopped answer, a session the daemon lost) starts a new session
// with the branch's history sent whole. The prefix cache keeps that cheap.
// A key, when the server needs one, is kept in sessionStorage: this tab only, never a URL.

const $ = (id) => document.getElementById(id);

const state = {
  key: sessionStorage.getItem("qvld-key") || "",
  model: "qvld",
  maxBody: 0, // the largest request body the server takes (0: unknown)
  clipLimits: null, // what a clip may cost the server to decode (/v1/models clip_limits)
  taking: null, // a chosen file being checked (a promise)
  picks: 0, // files chosen so far: a check that ends after a later choice is dropped
  attachment: null, // {kind, type, name, blob, url} for the next question
  controller: null, // the AbortController of the answer being streamed
  conversation: null, // the one shown (a record of Store)
  editing: null, // the turn whose question is being edited
  generation: 0, // bumped when the page moves on: a late answer is not shown
  urls: new Map(), // Blob -> its object URL, while the conversation shown holds it
};

// -- small things -----------------------------------------------------------------------

function randomId(prefix) {
  // crypto.getRandomValues works on plain http too (randomUUID needs a secure origin).
  const bytes = new Uint8Array(12);
  crypto.getRandomValues(bytes);
  return prefix + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function el(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children);
  return node;
}

function button(label, className, onClick, ariaLabel) {
  const node = el("button", className, label);
  node.type = "button";
  if (ariaLabel) node.setAttribute("aria-label", ariaLabel);
  node.addEventListener("click", onClick);
  return node;
}

function blobUrl(blob) {
  if (!state.urls.has(blob)) state.urls.set(blob, URL.createObjectURL(blob));
  return state.urls.get(blob);
}

function forgetUrls() {
  for (const url of state.urls.values()) URL.revokeObjectURL(url);
  state.urls.clear();
}

function dataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  // Plain http to another host: no Clipboard API; a selected textarea and copy instead.
  const area = el("textarea", "offscreen");
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

// A data: URL back to a Blob (fetch() of it would need connect-src data:).
function blobOf(url) {
  const comma = url.indexOf(",");
  const type = url.slice(5, comma).split(";")[0];
  const bytes = Uint8Array.from(atob(url.slice(comma + 1)), (c) => c.charCodeAt(0));
  return new Blob([bytes], {type});
}

function megabytes(bytes) {
  return `${(bytes / 1e6).toFixed(1)} MB`;
}

function sizeText(bytes) {
  return bytes < 1e6 ? `${Math.max(1, Math.round(bytes / 1e3))} KB` : megabytes(bytes);
}

// A clip as a <video> once this browser has decoded its first frame (one without the
// codec never shows it), beside a chip with its name and size that is always there: the
// clip is sent either way, the server decodes it.
function clipView(video, chip, attachment) {
  chip.textContent = `Clip: ${attachment.name} · ${sizeText(attachment.blob.size)}`;
  chip.title = `The clip asked about: ${attachment.name}`;
  chip.hidden = false;
  video.hidden = true;
  video.onloadeddata = () => { video.hidden = false; };
  video.src = blobUrl(attachment.blob);
}

// -- settings kept in this browser (localStorage): what each answer is asked with --------

const SETTINGS_KEY = "qvld-settings";
const SETTING_FIELDS = {system: "set-system", temperature: "set-temperature",
                        top_p: "set-top-p", max_tokens: "set-max-tokens",
                        format: "set-format", schema: "set-schema"};

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
  } catch (err) {
    saved = {};
  }
  for (const [name, id] of Object.entries(SETTING_FIELDS)) {
    if (typeof saved[name] === "string") $(id).value = saved[name];
  }
  showSchema();
}

function saveSettings() {
  const values = {};
  for (const [name, id] of Object.entries(SETTING_FIELDS)) values[name] = $(id).value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
}

function showSchema() {
  const wanted = $("set-format").value === "json_schema";
  $("set-schema").hidden = $("set-schema-label").hidden = !wanted;
}

// The request's sampling and format from the settings (the server checks each value).
function askedWith() {
  const body = {};
  for (const [name, id] of [["temperature", "set-temperature"], ["top_p", "set-top-p"],
                            ["max_tokens", "set-max-tokens"]]) {
    const value = $(id).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  const format = $("set-format").value;
  if (format === "json_object") body.response_format = {type: "json_object"};
  if (format === "json_schema") {
    let schema;
    try {
      schema = JSON.parse($("set-schema").value);
    } catch (err) {
      throw new ApiError(`The answer format's schema is not JSON: ${err.message}`, 0);
    }
    body.response_format = {type: "json_schema", json_schema: {name: "answer", schema}};
  }
  return body;
}

// -- the API ----------------------------------------------------------------------------

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  if (state.key) out.Authorization = "Bearer " + state.key;
  return out;
}

class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code || "";
  }
}

const REASONS = {
  400: "The server could not use this request",
  401: "The API key was not accepted",
  403: "This user may not use the server",
  404: "The server does not offer this",
  409: "The server no longer holds this conversation",
  413: "The picture or clip is too large to send",
  429: "The server is busy; try again in a moment",
  503: "The server is not ready (loading, reloading or stopping); try again shortly",
  504: "The answer took too long",
};

async function apiError(response) {
  let message = "";
  let code = "";
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || "";
    code = (body.error && body.error.code) || "";
  } catch (err) {
    message = "";
  }
  const reason = REASONS[response.status] || `The server answered ${response.status}`;
  return new ApiError(message ? `${reason}: ${message}` : `${reason}.`, response.status, code);
}

async function connect() {
  let response;
  try {
    response = await fetch("/v1/models", {headers: headers(false)});
  } catch (err) {
    $("model").textContent = "cannot reach the server";
    return;
  }
  if (response.status === 401) {
    askForKey();
    return;
  }
  if (!response.ok) {
    showError((await apiError(response)).message);
    return;
  }
  $("key-form").hidden = true;
  const model = ((await response.json()).data || [])[0];
  if (model) {
    state.model = model.id;
    state.maxBody = model.max_request_bytes || 0;
    state.clipLimits = model.clip_limits || null;
    const takes = (model.input_modalities || ["text", "image"]).join(", ");
    $("model").textContent = `${model.id} · context ${model.context_length} tokens` +
      (model.runtime ? ` · ${model.runtime}` : "") + ` · takes ${takes}`;
  }
  const health = await fetch("/health").then((r) => r.json()).catch(() => null);
  if (health && !health.ready) $("model").textContent += ` · ${health.status}`;
}

function askForKey() {
  state.key = "";
  sessionStorage.removeItem("qvld-key");
  $("model").textContent = "needs an API key";
  $("key-form").hidden = false;
  $("key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  $("key").value = "";
  if (state.key) sessionStorage.setItem("qvld-key", state.key);
  connect();
});

// Server-Sent Events from a fetch body: "data: JSON" blocks, "data: [DONE]" last.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// -- the picture or clip for the next question ------------------------------------------

const KINDS = {image: /^image\//, video: /^video\/(mp4|webm|x-matroska|matroska|quicktime)$/};
const NAMES = {image: "picture", video: "clip"};

function kindOf(file) {
  if (KINDS.image.test(file.type)) return "image";
  if (KINDS.video.test(file.type) || /\.(mp4|webm|mkv|mov)$/i.test(file.name || "")) return "video";
  return null;
}

// A clip's header is read before it is taken (a clip the server would refuse is refused
// here, in its words); Send waits for that (state.taking), so a question sent at once
// still goes with its clip.
function takeAttachment(file) {
  state.picks += 1;
  const taking = take(file, state.picks);
  state.taking = taking;
  taking.finally(() => {
    if (state.taking === taking) state.taking = null;
  });
  return taking;
}

// A file not taken: said why, and no longer named by the file input (the picture or clip
// taken before, if any, stays, in its preview).
function refuseFile(message) {
  showError(message);
  $("image").value = "";
}

// True when the file was refused (said why).
async function take(file, pick) {
  if (!file) return false;
  const kind = kindOf(file);
  if (!kind) {
    refuseFile(`${file.name || "That file"} is neither a picture nor a clip ` +
               "(PNG, JPEG, WebP, GIF, BMP; MP4, WebM, MKV, MOV).");
    return true;
  }
  // As a data: URL the bytes grow by a third; the rest of the request is small.
  if (state.maxBody && file.size * 4 / 3 + 64 * 1024 > state.maxBody) {
    refuseFile(`${file.name || "That file"} is ${megabytes(file.size)}; this server takes ` +
               `a ${NAMES[kind]} of up to about ${megabytes((state.maxBody - 64 * 1024) * 3 / 4)}.`);
    return true;
  }
  if (kind === "video" && state.clipLimits) {
    const reason = ClipHeader.refusal(await ClipHeader.read(file), state.clipLimits);
    if (pick !== state.picks) return false; // another file was chosen meanwhile
    if (reason) {
      refuseFile(`${file.name || "That clip"} is not sent: ${reason}.`);
      return true;
    }
  }
  dropAttachment();
  const type = file.type || (kind === "video" ? "video/mp4" : "image/png");
  state.attachment = {kind, type, name: file.name || NAMES[kind], blob: file};
  showAttachment();
  hideError();
  return false;
}

function showAttachment() {
  const item = state.attachment;
  const picture = $("preview");
  const clip = $("preview-video");
  const chip = $("preview-file");
  picture.hidden = !item || item.kind !== "image";
  clip.hidden = chip.hidden = true;
  clip.onloadeddata = null;
  picture.removeAttribute("src");
  clip.removeAttribute("src");
  if (item && item.kind === "image") picture.src = blobUrl(item.blob);
  else if (item) clipView(clip, chip, item);
  $("remove-image").hidden = !item;
}

function dropAttachment() {
  state.attachment = null;
  $("image").value = "";
  showAttachment();
}

$("image").addEventListener("change", () => takeAttachment($("image").files[0]));
$("remove-image").addEventListener("click", () => {
  dropAttachment();
  $("image").focus();
});
const drop = $("drop");
drop.addEventListener("dragover", (event) => {
  event.preventDefault();
  drop.classList.add("over");
});
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  takeAttachment(event.dataTransfer.files[0]);
});
document.addEventListener("paste", (event) => {
  const file = Array.from(event.clipboardData.files).find((f) => kindOf(f));
  if (file) {
    event.preventDefault();
    takeAttachment(file);
  }
});

// -- conversations: the tree of turns ---------------------------------------------------

function newConversation() {
  const now = Date.now();
  return {id: randomId("c-"), title: "", created: now, updated: now, turns: {}, seq: 0,
          leaf: null, system: $("set-system").value.trim(), session: null};
}

function children(conversation, parent) {
  return Object.values(conversation.turns).filter((t) => t.parent === parent)
    .sort((a, b) => a.seq - b.seq);
}

// The turns from the first to `leaf`.
function branch(conversation, leaf) {
  const out = [];
  for (let id = leaf; id; id = conversation.turns[id].parent) out.unshift(conversation.turns[id]);
  return out;
}

// The newest turn at the end of the branch through `turn`.
function newestLeaf(conversation, turn) {
  let at = turn;
  for (let next = children(conversation, at.id); next.length; next = children(conversation, at.id)) {
    at = next[next.length - 1];
  }
  return at.id;
}

function titleOf(conversation) {
  if (conversation.title) return conversation.title;
  const first = children(conversation, null)[0];
  return first ? first.question.slice(0, 60) : "New chat";
}

const OPEN_KEY = "qvld-open"; // localStorage: the conversation shown, for a reload

async function save(conversation) {
  conversation.updated = Date.now();
  await Store.put(conversation);
  if (state.conversation === conversation) localStorage.setItem(OPEN_KEY, conversation.id);
  await showList();
}

async function showList() {
  const query = $("search").value.trim().toLowerCase();
  const list = $("conversation-list");
  const all = await Store.all();
  const shown = all.filter((c) => !query || titleOf(c).toLowerCase().includes(query) ||
    Object.values(c.turns).some((t) => t.question.toLowerCase().includes(query) ||
                                       (t.answer || "").toLowerCase().includes(query)));
  list.replaceChildren(...shown.map(listItem));
  $("no-conversations").hidden = all.length > 0;
  if (all.length && !shown.length) {
    list.append(el("li", "muted", "No conversation has those words."));
  }
}

function listItem(conversation) {
  const title = titleOf(conversation);
  const open = button(title, "open", () => openConversation(conversation.id));
  if (state.conversation && state.conversation.id === conversation.id) {
    open.setAttribute("aria-current", "true");
  }
  const item = el("li", "conversation", open,
    button("Rename", "small", () => rename(conversation.id, item), `Rename ${title}`),
    button("Delete", "small", () => remove(conversation.id), `Delete ${title}`));
  return item;
}

function rename(id, item) {
  const input = el("input");
  input.type = "text";
  input.setAttribute("aria-label", "New name");
  input.value = item.querySelector(".open").textContent;
  item.replaceChildren(input);
  input.focus();
  input.select();
  let done = false;
  const finish = async (keep) => {
    if (done) return;
    done = true;
    const conversation = await Store.get(id);
    if (conversation && keep && input.value.trim()) {
      conversation.title = input.value.trim();
      if (state.conversation && state.conversation.id === id) state.conversation.title = conversation.title;
      await Store.put(conversation);
    }
    await showList();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") {
      event.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
}

async function remove(id) {
  const conversation = await Store.get(id);
  if (!conversation || !confirm(`Delete “${titleOf(conversation)}”?`)) return;
  await Store.remove(id);
  if (state.conversation && state.conversation.id === id) newChat();
  await showList();
}

async function openConversation(id) {
  const conversation = await Store.get(id);
  if (!conversation) return;
  leave();
  state.conversation = conversation;
  localStorage.setItem(OPEN_KEY, conversation.id);
  render();
  await showList();
  $("question").focus();
  $("conversations").classList.remove("open");
  $("show-conversations").setAttribute("aria-expanded", "false");
}

// What the page stops doing when it shows another conversation (or a new one).
function leave() {
  stop();
  state.generation += 1;
  cancelEdit();
  forgetUrls();
  dropAttachment();
  hideError();
  hideNotice();
}

function newChat() {
  leave();
  state.conversation = null;
  localStorage.removeItem(OPEN_KEY);
  render();
  showList();
  $("question").focus();
}

// -- export and import (JSON; pictures and clips as data: URLs) -------------------------

async function exportAll() {
  const conversations = [];
  for (const conversation of await Store.all()) {
    const turns = {};
    for (const [id, turn] of Object.entries(conversation.turns)) {
      const attachment = turn.attachment && {...turn.attachment, blob: undefined,
                                             data: await dataUrl(turn.attachment.blob)};
      turns[id] = {...turn, attachment};
    }
    conversations.push({...conversation, turns, session: null});
  }
  const file = new Blob([JSON.stringify({qvld_conversations: 1, conversations}, null, 1)],
                        {type: "application/json"});
  const link = el("a");
  link.href = URL.createObjectURL(file);
  link.download = `qvld-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

async function importFile(file) {
  let parsed;
  try {
    parsed = JSON.parse(await file.text());
  } catch (err) {
    showError(`${file.name} is not JSON: ${err.message}`);
    return;
  }
  if (!parsed || parsed.qvld_conversations !== 1 || !Array.isArray(parsed.conversations)) {
    showError(`${file.name} is not a qvld conversations export.`);
    return;
  }
  let count = 0;
  for (const conversation of parsed.conversations) {
    if (!conversation || typeof conversation.id !== "string" ||
        typeof conversation.turns !== "object") continue;
    for (const turn of Object.values(conversation.turns)) {
      if (turn.attachment && typeof turn.attachment.data === "string") {
        turn.attachment.blob = blobOf(turn.attachment.data);
        delete turn.attachment.data;
      } else {
        turn.attachment = null;
      }
    }
    conversation.session = null; // this daemon never held it
    await Store.put(conversation);
    count += 1;
  }
  showNotice(`Imported ${count} conversation${count === 1 ? "" : "s"}.`);
  await showList();
}

$("export").addEventListener("click", () => exportAll().catch((err) => showError(err.message)));
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", () => {
  const file = $("import-file").files[0];
  $("import-file").value = "";
  if (file) importFile(file);
});
$("search").addEventListener("input", () => showList());

// -- showing a conversation -------------------------------------------------------------

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function showNotice(message) {
  $("notice").textContent = message;
  $("notice").hidden = false;
}

function hideNotice() {
  $("notice").hidden = true;
  $("notice").textContent = "";
}

function who(name) {
  return el("p", "who", name);
}

function timingsLine(usage, timings) {
  const parts = [];
  if (timings) {
    parts.push(`first token ${timings.ttft_s.toFixed(2)} s`);
    if (timings.decode_s > 0 && usage.completion_tokens > 1) {
      parts.push(`${((usage.completion_tokens - 1) / timings.decode_s).toFixed(1)} tokens/s`);
    }
  }
  parts.push(`prompt ${usage.prompt_tokens} tokens`);
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  parts.push(`cached ${cached}`);
  parts.push(`answer ${usage.completion_tokens} tokens`);
  return parts.join(" · ");
}

const ENDINGS = {length: " …(cut at the token limit)", stopped: " …(stopped)"};

function fillAnswer(node, turn) {
  node.replaceChildren(Markdown.render(turn.answer || ""));
  if (ENDINGS[turn.finish]) node.append(el("p", "ending", ENDINGS[turn.finish].trim()));
  else if (turn.finish === "error" && !turn.answer) node.append(el("p", "ending", "(no answer)"));
}

function render() {
  const conversation = state.conversation;
  const transcript = $("transcript");
  const turns = conversation ? branch(conversation, conversation.leaf) : [];
  $("placeholder").hidden = turns.length > 0;
  transcript.replaceChildren($("placeholder"), ...turns.map((t, i) =>
    turnView(conversation, t, i === turns.length - 1)));
}

function turnView(conversation, turn, last) {
  const article = el("article", last ? "turn latest" : "turn");
  article.dataset.turn = turn.id;
  article.append(who("You"), el("p", "question", turn.question));
  if (turn.attachment) {
    if (turn.attachment.kind === "video") {
      const clip = el("video", "attachment");
      clip.controls = true;
      clip.muted = true;
      clip.setAttribute("aria-label", "The clip asked about");
      const chip = el("span", "file-chip");
      clipView(clip, chip, turn.attachment);
      article.append(clip, el("p", "", chip));
    } else {
      const picture = el("img", "attachment");
      picture.src = blobUrl(turn.attachment.blob);
      picture.alt = "The picture asked about";
      article.append(picture);
    }
  }
  const tools = el("div", "turn-tools");
  const siblings = children(conversation, turn.parent);
  if (siblings.length > 1) {
    const at = siblings.indexOf(turn);
    const go = (to) => () => {
      if (state.controller) return;
      conversation.leaf = newestLeaf(conversation, siblings[to]);
      save(conversation);
      render();
    };
    const back = button("‹", "small", go(at - 1), "Previous branch");
    const next = button("›", "small", go(at + 1), "Next branch");
    back.disabled = at === 0;
    next.disabled = at === siblings.length - 1;
    tools.append(back, el("span", "muted", `branch ${at + 1} of ${siblings.length}`), next);
  }
  tools.append(button("Edit", "small", () => edit(turn), "Edit this question"));
  article.append(tools, who("qvld"));
  const answer = el("div", "text answer");
  fillAnswer(answer, turn);
  const timings = el("p", "timings", turn.timings || "");
  if (last) {
    answer.id = "answer-text";
    timings.id = "timings";
    const live = el("div", "", answer, timings);
    live.id = "answer";
    live.setAttribute("aria-live", "polite");
    article.append(live);
  } else {
    article.append(answer, timings);
  }
  const actions = el("div", "turn-tools");
  actions.append(button("Copy", "small", () => copyAnswer(turn, actions), "Copy this answer"));
  if (last) actions.append(button("Regenerate", "small", () => regenerate(turn), "Regenerate this answer"));
  article.append(actions);
  return article;
}

async function copyAnswer(turn, where) {
  try {
    await copyText(turn.answer || "");
    showNotice("The answer was copied.");
  } catch (err) {
    showError(`The answer could not be copied: ${err.message}`);
  }
  where.querySelector("button").focus();
}

// A code block's Copy button (rendered by Markdown).
$("transcript").addEventListener("click", async (event) => {
  const target = event.target.closest(".copy-code");
  if (!target) return;
  try {
    await copyText(target.closest(".code").querySelector("pre").textContent);
    target.textContent = "Copied";
    setTimeout(() => (target.textContent = "Copy"), 1500);
  } catch (err) {
    showError(`The code could not be copied: ${err.message}`);
  }
});

// -- editing and regenerating: new branches ---------------------------------------------

function edit(turn) {
  if (state.controller) return;
  state.editing = turn;
  $("question").value = turn.question;
  state.attachment = turn.attachment ? {...turn.attachment} : null;
  showAttachment();
  $("editing-what").textContent = "Editing a question: Send starts a new branch from there.";
  $("editing").hidden = false;
  $("question").focus();
}

function cancelEdit() {
  if (!state.editing) return;
  state.editing = null;
  $("editing").hidden = true;
  $("question").value = "";
  dropAttachment();
}

$("cancel-edit").addEventListener("click", () => {
  cancelEdit();
  $("question").focus();
});

function regenerate(turn) {
  if (state.controller) return;
  ask(turn.question, turn.attachment, turn.parent);
}

// -- asking -----------------------------------------------------------------------------

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  for (const node of document.querySelectorAll(".turn-tools button")) node.disabled = on;
}

async function messageOf(turn) {
  const content = [];
  if (turn.attachment) {
    const url = await dataUrl(turn.attachment.blob);
    content.push(turn.attachment.kind === "video"
      ? {type: "video_url", video_url: {url}}
      : {type: "image_url", image_url: {url}});
  }
  content.push({type: "text", text: turn.question});
  return {role: "user", content};
}

// What the daemon is sent for `turn`: only the new question where the session holds the
// turn it follows, else the branch's whole history on a new session.
async function requestFor(conversation, turn, whole) {
  const held = conversation.session;
  if (!whole && held && turn.parent && held.leaf === turn.parent) {
    return {session: held.id, session_turns: held.turns, messages: [await messageOf(turn)]};
  }
  const messages = [];
  if (conversation.system) messages.push({role: "system", content: conversation.system});
  for (const earlier of branch(conversation, turn.parent)) {
    messages.push(await messageOf(earlier));
    messages.push({role: "assistant", content: earlier.answer || ""});
  }
  messages.push(await messageOf(turn));
  return {session: randomId("web-"), session_turns: 0, messages};
}

async function send() {
  if (state.controller) return; // one answer at a time
  // A clip being checked goes with this question; one refused keeps it in the box.
  if (state.taking && await state.taking) return;
  const question = $("question").value.trim();
  if (!question) {
    $("question").focus();
    return;
  }
  const parent = state.editing ? state.editing.parent
    : state.conversation ? state.conversation.leaf : null;
  const attachment = state.attachment ? {...state.attachment} : null;
  state.editing = null;
  $("editing").hidden = true;
  $("question").value = "";
  state.attachment = null;
  $("image").value = "";
  showAttachment();
  await ask(question, attachment, parent);
}

async function ask(question, attachment, parent) {
  hideError();
  hideNotice();
  if (!state.conversation) state.conversation = newConversation();
  const conversation = state.conversation;
  conversation.seq += 1;
  const turn = {id: randomId("t-"), parent, seq: conversation.seq, question, attachment,
                answer: "", timings: "", finish: "", at: Date.now()};
  conversation.turns[turn.id] = turn;
  conversation.leaf = turn.id;
  render();
  const controller = new AbortController();
  state.controller = controller;
  const generation = state.generation;
  busy(true);
  const text = $("answer-text");
  let pending = false;
  const show = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      if (generation === state.generation) fillAnswer(text, turn);
    });
  };
  const started = performance.now();
  let firstPiece = null; // when the first words arrived, as this page saw it
  try { // Send comes back only once the turn is kept: a reload then finds it
    try {
      let asked = await requestFor(conversation, turn, false);
      let response = await post(asked, controller);
      if (response.status === 409) {
        const lost = await apiError(response);
        if (lost.code !== "session_lost") throw lost;
        // The daemon restarted or let the session go: the history this page holds, again.
        showNotice("The server no longer held this conversation (it restarted, or the " +
                   "session ended); the page sent the history it keeps again.");
        asked = await requestFor(conversation, turn, true);
        response = await post(asked, controller);
      }
      if (!response.ok) throw await apiError(response);
      await readEvents(response, (event) => {
        if (event.error) throw new ApiError(event.error.message, 0);
        const choice = (event.choices || [])[0];
        if (choice && choice.delta && choice.delta.content) {
          if (firstPiece === null) firstPiece = performance.now();
          turn.answer += choice.delta.content;
          show();
        }
        if (choice && choice.finish_reason) turn.finish = choice.finish_reason;
        if (event.usage) {
          turn.timings = timingsLine(event.usage, event.timings);
          if (generation === state.generation) $("timings").textContent = turn.timings;
        }
        if (event.session) {
          conversation.session = {id: event.session.id, turns: event.session.turns, leaf: turn.id};
        }
      });
      turn.finish = turn.finish || "stop";
    } catch (err) {
      if (err.name === "AbortError") {
        turn.finish = "stopped";
        // The daemon's own timings never came: what this page measured instead.
        const parts = [];
        if (firstPiece !== null) parts.push(`first token ${((firstPiece - started) / 1000).toFixed(2)} s`);
        parts.push(`stopped after ${((performance.now() - started) / 1000).toFixed(2)} s`);
        turn.timings = parts.join(" · ");
      } else {
        turn.finish = "error";
        if (err.status === 401) askForKey();
        if (generation === state.generation) {
          showError(err instanceof ApiError ? err.message : `The connection failed: ${err.message}`);
        }
      }
    }
    if (turn.finish === "error" && !turn.answer) {
      // Nothing came: the question goes back to the box, and no empty turn is kept.
      delete conversation.turns[turn.id];
      conversation.leaf = parent;
      if (generation === state.generation) {
        $("question").value = question;
        if (attachment) {
          state.attachment = attachment;
          showAttachment();
        }
      }
    }
    if (Object.keys(conversation.turns).length) await save(conversation);
  } finally {
    state.controller = null;
    busy(false);
  }
  if (generation === state.generation) {
    render();
    $("question").focus();
  }
}

function post(asked, controller) {
  return fetch("/v1/chat/completions", {
    method: "POST",
    headers: {...headers(true), "X-Qvld-Session": asked.session},
    body: JSON.stringify({model: state.model, stream: true, stream_options: {include_usage: true},
                          session_turns: asked.session_turns, ...askedWith(),
                          messages: asked.messages}),
    signal: controller.signal,
  });
}

function stop() {
  if (state.controller) state.controller.abort(); // the server stops at its next step
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("question").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
// Escape stops an answer wherever the focus is (the Stop button, the transcript, none).
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && state.controller) {
    event.preventDefault();
    stop();
  } else if (event.key === "Escape" && state.editing) {
    cancelEdit();
  }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", newChat);
$("show-conversations").addEventListener("click", () => {
  const open = $("conversations").classList.toggle("open");
  $("show-conversations").setAttribute("aria-expanded", String(open));
  if (open) $("search").focus();
});
$("settings-form").addEventListener("input", (event) => {
  saveSettings();
  showSchema();
  if (event.target.id === "set-system" && state.conversation) state.pendingNewChat = true;
});
$("set-system").addEventListener("change", () => {
  if (state.pendingNewChat) {
    state.pendingNewChat = false;
    newChat(); // a system prompt opens a conversation: the next question starts one
  }
});
$("settings-form").addEventListener("submit", (event) => event.preventDefault());

async function start() {
  loadSettings();
  if (!(await Store.open())) $("store-note").hidden = false;
  // The conversation shown last comes back after a reload.
  const last = localStorage.getItem(OPEN_KEY);
  if (last && await Store.get(last)) await openConversation(last);
  else render();
  await showList();
  connect();
}

start();
