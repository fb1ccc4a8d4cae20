// Tessera pages' API key: asked for once, when the server first answers 401, and kept in
// sessionStorage (this tab only, gone when it closes). Every API call of the pages goes through
// tesseraFetch, which sends it as `Authorization: Bearer`. A 403 for a missing scope (the
// dashboard needs an admin key) asks for another key the same way.
"use strict";

(() => {
  const STORE = "tessera.apiKey";
  let asking = null; // one prompt at a time, however many requests got a 401 together
  let declined = false; // cancelled: not asked again until the page is reloaded (the dashboard polls)

  function askForKey(why) {
    if (declined) return Promise.resolve(false);
    if (!asking) {
      asking = Promise.resolve().then(() => {
        const text = { missing: "This server needs an API key:", refused: "The server refused this API key. API key:",
          scope: "This page needs a key with more scopes (the dashboard: admin). API key:" }[why];
        const key = window.prompt(text, "");
        if (key && key.trim()) sessionStorage.setItem(STORE, key.trim());
        else sessionStorage.removeItem(STORE);
        declined = !(key && key.trim());
        return !declined;
      }).finally(() => { asking = null; });
    }
    return asking;
  }

  function withKey(options) {
    const key = sessionStorage.getItem(STORE);
    const headers = new Headers((options && options.headers) || {});
    if (key) headers.set("Authorization", `Bearer ${key}`);
    return Object.assign({}, options, { headers });
  }

  async function missingScope(r) {
    try {
      return (await r.clone().json()).error.code === "missing_scope";
    } catch (e) {
      return false;
    }
  }

  // fetch() with the tab's key; on a 401 (or a 403 for a scope), asks for a key once and retries.
  window.tesseraFetch = async (url, options) => {
    const sent = sessionStorage.getItem(STORE);
    let r = await fetch(url, withKey(options));
    const scope = r.status === 403 && await missingScope(r);
    if (r.status !== 401 && !scope) return r;
    if (sessionStorage.getItem(STORE) !== sent) return fetch(url, withKey(options)); // answered meanwhile
    if (await askForKey(scope ? "scope" : sent ? "refused" : "missing")) r = await fetch(url, withKey(options));
    return r;
  };
})();
