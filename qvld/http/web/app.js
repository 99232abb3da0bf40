"use strict";
// qvld's page: ask about a picture; the answer streams in from /v1/chat/completions.
// It uses the public API only (what it does, a script could do). Follow-up questions
// continue one session (X-Qvld-Session), so the picture is not encoded again. A key,
// when the server needs one, is kept in sessionStorage: this tab only, never a URL.

const $ = (id) => document.getElementById(id);

const state = {
  key: sessionStorage.getItem("qvld-key") || "",
  session: newSessionId(),
  model: "qvld",
  image: null, // {dataUrl, blobUrl} of the picture for the next question
  controller: null, // the AbortController of the answer being streamed
  latest: null, // {question, blobUrl}: what #latest shows
  turn: 0, // counts questions and new chats: a stopped answer's end is told to its own
  asked: false, // this chat's session has had a question (the system prompt went with it)
};

// Settings kept in this browser (localStorage): what each answer is asked with.
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

function newSessionId() {
  // crypto.getRandomValues works on plain http too (randomUUID needs a secure origin).
  const bytes = new Uint8Array(12);
  crypto.getRandomValues(bytes);
  return "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  if (state.key) out.Authorization = "Bearer " + state.key;
  return out;
}

class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

const REASONS = {
  400: "The server could not use this request",
  401: "The API key was not accepted",
  403: "This user may not use the server",
  404: "The server does not offer this",
  413: "The picture is too large to send",
  429: "The server is busy; try again in a moment",
  503: "The server is not ready (loading, reloading or stopping); try again shortly",
  504: "The answer took too long",
};

async function apiError(response) {
  let message = "";
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || "";
  } catch (err) {
    message = "";
  }
  const reason = REASONS[response.status] || `The server answered ${response.status}`;
  return new ApiError(message ? `${reason}: ${message}` : `${reason}.`, response.status);
}

// -- connecting -------------------------------------------------------------------------

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

// -- the picture ------------------------------------------------------------------------

function takeImage(file) {
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    showError(`${file.name || "That file"} is not a picture.`);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => {
    dropImage();
    state.image = {dataUrl: reader.result, blobUrl: URL.createObjectURL(file)};
    $("preview").src = state.image.blobUrl;
    $("preview").hidden = false;
    $("remove-image").hidden = false;
    hideError();
  };
  reader.onerror = () => showError("The picture could not be read.");
  reader.readAsDataURL(file);
}

function dropImage(keepPreview) {
  // The blob stays alive while the transcript shows it (keepPreview).
  if (state.image && !keepPreview) URL.revokeObjectURL(state.image.blobUrl);
  state.image = null;
  $("image").value = "";
  $("preview").hidden = true;
  $("preview").removeAttribute("src");
  $("remove-image").hidden = true;
}

$("image").addEventListener("change", () => takeImage($("image").files[0]));
$("remove-image").addEventListener("click", () => {
  dropImage();
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
  takeImage(event.dataTransfer.files[0]);
});
document.addEventListener("paste", (event) => {
  const file = Array.from(event.clipboardData.files).find((f) => f.type.startsWith("image/"));
  if (file) {
    event.preventDefault();
    takeImage(file);
  }
});

// -- asking -----------------------------------------------------------------------------

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// The latest answer moves into the transcript when the next question is sent.
function archiveLatest() {
  if (!state.latest) return;
  const turn = document.createElement("article");
  turn.className = "turn";
  const question = document.createElement("p");
  question.className = "question";
  question.textContent = state.latest.question;
  turn.append(who("You"), question);
  if (state.latest.blobUrl) {
    const picture = document.createElement("img");
    picture.src = state.latest.blobUrl;
    picture.alt = "The picture asked about";
    turn.append(picture);
  }
  const answer = document.createElement("p");
  answer.className = "text";
  answer.textContent = $("answer-text").textContent;
  const timings = document.createElement("p");
  timings.className = "timings";
  timings.textContent = $("timings").textContent;
  turn.append(who("qvld"), answer, timings);
  $("transcript").append(turn);
}

function who(name) {
  const label = document.createElement("p");
  label.className = "who";
  label.textContent = name;
  return label;
}

// The question being answered, with its picture (it stays in its turn).
function showLatest(question, blobUrl) {
  $("latest-question").textContent = question;
  $("latest-question").hidden = false;
  $("latest-you").hidden = $("latest-qvld").hidden = false;
  const picture = $("latest-picture");
  picture.hidden = !blobUrl;
  if (blobUrl) picture.src = blobUrl;
  else picture.removeAttribute("src");
  $("answer-text").textContent = "";
  $("answer-text").classList.remove("placeholder");
  $("timings").textContent = "";
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

async function send() {
  if (state.controller) return; // one answer at a time
  const question = $("question").value.trim();
  if (!question) {
    $("question").focus();
    return;
  }
  hideError();
  const content = [];
  const image = state.image;
  if (image) content.push({type: "image_url", image_url: {url: image.dataUrl}});
  content.push({type: "text", text: question});
  archiveLatest();
  state.latest = {question, blobUrl: image ? image.blobUrl : null};
  showLatest(question, image ? image.blobUrl : null);
  $("question").value = "";
  dropImage(true);
  const controller = new AbortController();
  state.controller = controller;
  const turn = ++state.turn;
  busy(true);
  const text = $("answer-text");
  let finish = null;
  const started = performance.now();
  let firstPiece = null; // when the first words arrived, as this page saw it
  try {
    const messages = [{role: "user", content}];
    const system = $("set-system").value.trim();
    // The session keeps the history: the system prompt goes with its first question.
    if (system && !state.asked) messages.unshift({role: "system", content: system});
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: {...headers(true), "X-Qvld-Session": state.session},
      body: JSON.stringify({model: state.model, stream: true,
                            stream_options: {include_usage: true},
                            ...askedWith(), messages}),
      signal: controller.signal,
    });
    if (!response.ok) throw await apiError(response);
    state.asked = true;
    await readEvents(response, (event) => {
      if (event.error) throw new ApiError(event.error.message, 0);
      const choice = (event.choices || [])[0];
      if (choice && choice.delta && choice.delta.content) {
        if (firstPiece === null) firstPiece = performance.now();
        text.append(document.createTextNode(choice.delta.content)); // as it arrives
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (event.usage) $("timings").textContent = timingsLine(event.usage, event.timings);
    });
    if (finish === "length") text.append(document.createTextNode(" …(cut at the token limit)"));
  } catch (err) {
    if (turn !== state.turn) {
      // A new chat began meanwhile: this answer is gone from the page.
    } else if (err.name === "AbortError") {
      text.append(document.createTextNode(" …(stopped)"));
      // The daemon's own timings never came: what this page measured instead.
      const parts = [];
      if (firstPiece !== null) parts.push(`first token ${((firstPiece - started) / 1000).toFixed(2)} s`);
      parts.push(`stopped after ${((performance.now() - started) / 1000).toFixed(2)} s`);
      $("timings").textContent = parts.join(" · ");
    } else {
      if (err.status === 401) askForKey();
      if (!text.textContent) text.textContent = "(no answer)";
      showError(err instanceof ApiError ? err.message : `The connection failed: ${err.message}`);
    }
  } finally {
    state.controller = null;
    busy(false);
    $("question").focus();
  }
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
  }
});
$("stop").addEventListener("click", stop);
function newChat() {
  stop();
  state.turn += 1;
  state.session = newSessionId();
  state.latest = null;
  $("transcript").replaceChildren();
  $("latest-question").hidden = true;
  $("latest-you").hidden = $("latest-qvld").hidden = $("latest-picture").hidden = true;
  $("answer-text").textContent = "Pick a picture and ask about it.";
  $("answer-text").classList.add("placeholder");
  $("timings").textContent = "";
  dropImage();
  hideError();
  state.asked = false;
  $("question").focus();
}
$("new-chat").addEventListener("click", newChat);
$("settings-form").addEventListener("input", (event) => {
  saveSettings();
  showSchema();
  if (event.target.id === "set-system" && state.asked) state.pendingNewChat = true;
});
$("set-system").addEventListener("change", () => {
  if (state.pendingNewChat) {
    state.pendingNewChat = false;
    newChat(); // a system prompt opens a conversation: the next question starts one
  }
});
$("settings-form").addEventListener("submit", (event) => event.preventDefault());
loadSettings();

connect();
