// Tessera chat playground: streams /v1/chat/completions and keeps the conversation in localStorage.
"use strict";

(() => {
  const STORE = "tessera.chat.v1";
  const $ = (id) => document.getElementById(id);
  const els = {
    model: $("model"), system: $("system"), temperature: $("temperature"), top_p: $("top_p"),
    max_tokens: $("max_tokens"), seed: $("seed"), messages: $("messages"), composer: $("composer"),
    prompt: $("prompt"), send: $("send"), stop: $("stop"), status: $("status"), newChat: $("new-chat"),
    settingsPanel: $("settings-panel"), image: $("image"), attach: $("attach"), attachments: $("attachments"),
  };
  // messages: [{role, content, stats?, error?}]; a user message with images has content parts
  // (OpenAI's [{type: "text"}, {type: "image_url"}...]) as the server takes them.
  let state = { messages: [], system: "", model: "", settings: {} };
  let controller = null;
  const MAX_IMAGE_BYTES = 8 * 1024 * 1024; // the server takes 16 MiB bodies; base64 adds a third
  let attached = []; // images chosen for the next message: [{name, url}]
  const seeing = new Set(); // models whose /v1/models card lists the "vision" capability

  function load() {
    try {
      const saved = JSON.parse(localStorage.getItem(STORE) || "null");
      if (saved && Array.isArray(saved.messages)) state = Object.assign(state, saved);
    } catch (e) {
      localStorage.removeItem(STORE);
    }
    els.system.value = state.system || "";
    for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
      if (state.settings[name] !== undefined) els[name].value = state.settings[name];
    }
  }

  function save() {
    state.system = els.system.value;
    state.model = els.model.value;
    state.settings = {};
    for (const name of ["temperature", "top_p", "max_tokens", "seed"]) state.settings[name] = els[name].value;
    try {
      localStorage.setItem(STORE, JSON.stringify(state));
    } catch (e) {
      // Images are what overflow the browser's storage: keep the conversation without them.
      try {
        const slim = Object.assign({}, state, { messages: state.messages.map((m) => Object.assign({}, m, {
          content: Array.isArray(m.content) ? textOf(m.content) + " [image not kept]" : m.content })) });
        localStorage.setItem(STORE, JSON.stringify(slim));
      } catch (e2) {
        setStatus("The conversation could not be saved in this browser: " + e2.message);
      }
    }
  }

  function textOf(content) {
    return Array.isArray(content) ? content.filter((p) => p.type === "text").map((p) => p.text).join("\n") : content;
  }

  function imagesOf(content) {
    return Array.isArray(content) ? content.filter((p) => p.type === "image_url").map((p) => p.image_url.url) : [];
  }

  function renderPending() {
    els.attachments.replaceChildren();
    attached.forEach((img, i) => {
      const li = document.createElement("li");
      const pic = document.createElement("img");
      pic.src = img.url;
      pic.alt = img.name;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "secondary";
      remove.textContent = "×";
      remove.setAttribute("aria-label", "Remove image " + img.name);
      remove.addEventListener("click", () => {
        attached.splice(i, 1);
        renderPending();
      });
      li.append(pic, remove);
      els.attachments.append(li);
    });
  }

  function updateAttach() {
    const sees = seeing.has(els.model.value);
    els.attach.hidden = !sees;
    if (!sees && attached.length) {
      attached = [];
      renderPending();
    }
  }

  function readImage(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve({ name: file.name, url: reader.result });
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  function setStatus(text) {
    els.status.textContent = text;
  }

  function renderMarkdown(el, text) {
    el.innerHTML = DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: false }));
    for (const block of el.querySelectorAll("pre code")) hljs.highlightElement(block);
  }

  function statsText(stats) {
    if (!stats) return "";
    const parts = [];
    if (stats.ttft_ms != null) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
    if (stats.tps != null) parts.push(`${stats.tps.toFixed(1)} tok/s`);
    if (stats.tokens != null) parts.push(`${stats.approx ? "~" : ""}${stats.tokens} tokens`);
    if (stats.finish_reason) parts.push(stats.finish_reason);
    return parts.join(" · ");
  }

  function addMessage(msg) {
    const wrap = document.createElement("article");
    wrap.className = "msg " + msg.role;
    const who = document.createElement("h2");
    who.className = "who";
    who.textContent = msg.role === "user" ? "You" : (msg.model || "Assistant");
    const body = document.createElement("div");
    body.className = "body";
    const meta = document.createElement("p");
    meta.className = "meta";
    wrap.append(who, body, meta);
    els.messages.append(wrap);
    const view = { wrap, body, meta };
    update(view, msg);
    return view;
  }

  function update(view, msg) {
    if (msg.role === "user") {
      view.body.textContent = textOf(msg.content);
      const urls = imagesOf(msg.content);
      if (urls.length) {
        const row = document.createElement("div");
        row.className = "images";
        for (const url of urls) {
          const pic = document.createElement("img");
          pic.src = url;
          pic.alt = "attached image";
          row.append(pic);
        }
        view.body.append(row);
      }
    } else renderMarkdown(view.body, msg.content);
    view.meta.textContent = msg.error ? msg.error : statsText(msg.stats);
    view.meta.classList.toggle("error", Boolean(msg.error));
  }

  function renderAll() {
    els.messages.replaceChildren();
    for (const msg of state.messages) addMessage(msg);
    scrollDown();
  }

  function scrollDown() {
    els.messages.scrollTop = els.messages.scrollHeight;
  }

  async function loadModels() {
    try {
      const r = await tesseraFetch("/v1/models");
      const body = await r.json();
      els.model.replaceChildren();
      for (const m of body.data || []) {
        const opt = document.createElement("option");
        opt.value = m.id;
        opt.textContent = m.max_model_len ? `${m.id} (${m.max_model_len} tokens)` : m.id;
        els.model.append(opt);
        if ((m.capabilities || []).includes("vision")) seeing.add(m.id);
      }
      if (state.model && [...els.model.options].some((o) => o.value === state.model)) els.model.value = state.model;
      updateAttach();
    } catch (e) {
      setStatus("Could not list the server's models: " + e.message);
    }
  }

  function requestBody() {
    const messages = [];
    const system = els.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of state.messages) {
      if (!m.error || m.content) messages.push({ role: m.role, content: m.content });
    }
    const body = { model: els.model.value, messages, stream: true, stream_options: { include_usage: true } };
    const num = (name, parse) => {
      const v = els[name].value.trim();
      if (v !== "") body[name] = parse(v);
    };
    num("temperature", parseFloat);
    num("top_p", parseFloat);
    num("max_tokens", (v) => parseInt(v, 10));
    num("seed", (v) => parseInt(v, 10));
    return body;
  }

  // Reads an SSE body, calling onEvent with each parsed `data:` payload.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data === "[DONE]") return;
        if (data) onEvent(JSON.parse(data));
      }
    }
  }

  async function send(text) {
    const content = attached.length
      ? [{ type: "text", text }, ...attached.map((p) => ({ type: "image_url", image_url: { url: p.url } }))]
      : text;
    attached = [];
    renderPending();
    state.messages.push({ role: "user", content });
    addMessage(state.messages[state.messages.length - 1]);
    const reply = { role: "assistant", content: "", model: els.model.value, stats: null };
    const body = requestBody();
    state.messages.push(reply);
    const view = addMessage(reply);
    view.wrap.setAttribute("aria-busy", "true");
    scrollDown();
    controller = new AbortController();
    setBusy(true);
    setStatus("Generating…");
    const started = performance.now();
    let first = null;
    let deltas = 0;
    let usage = null;
    let finish = null;
    let pending = false;
    const paint = () => {
      pending = false;
      update(view, reply);
      scrollDown();
    };
    try {
      const r = await tesseraFetch("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!r.ok) {
        let message = `HTTP ${r.status}`;
        try {
          message = (await r.json()).error.message || message;
        } catch (e) { /* not JSON */ }
        throw new Error(message);
      }
      await readEvents(r, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || "the server ended the stream with an error");
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            if (first === null) first = performance.now();
            deltas += 1;
            reply.content += piece;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (!pending) {
          pending = true;
          requestAnimationFrame(paint);
        }
      });
      setStatus("");
    } catch (e) {
      if (e.name === "AbortError") {
        finish = "stopped";
        setStatus("Stopped.");
      } else {
        reply.error = "Error: " + e.message;
        setStatus(reply.error);
      }
    } finally {
      controller.abort(); // a no-op after a complete stream; frees the request server-side otherwise
      const end = performance.now();
      const tokens = usage ? usage.completion_tokens : deltas;
      reply.stats = {
        ttft_ms: first === null ? null : first - started,
        tokens,
        approx: !usage,
        tps: first !== null && end > first && tokens > 1 ? (tokens - 1) / ((end - first) / 1000) : null,
        finish_reason: finish,
      };
      controller = null;
      setBusy(false);
      update(view, reply);
      view.wrap.removeAttribute("aria-busy");
      save();
      els.prompt.focus();
    }
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.disabled = !busy;
    document.body.dataset.busy = busy ? "true" : "false";
  }

  function stop() {
    if (controller) controller.abort();
  }

  els.composer.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = els.prompt.value.trim();
    if (!text || controller) return;
    els.prompt.value = "";
    send(text);
  });
  els.prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      els.composer.requestSubmit();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && controller) stop();
  });
  els.stop.addEventListener("click", stop);
  els.newChat.addEventListener("click", () => {
    stop();
    state.messages = [];
    save();
    renderAll();
    setStatus("New conversation.");
    els.prompt.focus();
  });
  for (const el of [els.system, els.temperature, els.top_p, els.max_tokens, els.seed, els.model]) {
    el.addEventListener("change", save);
  }
  els.model.addEventListener("change", updateAttach);
  els.image.addEventListener("change", async () => {
    for (const file of els.image.files) {
      if (file.size > MAX_IMAGE_BYTES) {
        setStatus(`${file.name} is larger than ${MAX_IMAGE_BYTES / 1024 / 1024} MiB; not attached.`);
        continue;
      }
      try {
        attached.push(await readImage(file));
      } catch (e) {
        setStatus(`${file.name} could not be read: ${e.message}`);
      }
    }
    els.image.value = "";
    renderPending();
  });
  if (window.matchMedia("(max-width: 720px)").matches) els.settingsPanel.open = false;

  load();
  renderAll();
  loadModels();
  setBusy(false);
})();
