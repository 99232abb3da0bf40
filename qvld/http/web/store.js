"use strict";
// Conversations kept in this browser: IndexedDB database "qvld", store "conversations"
// (one record per conversation, its pictures and clips as Blobs inside it). Where the
// browser keeps no IndexedDB (some private modes), a Map in memory stands in and the
// page says conversations last until it is closed.

const Store = (() => {
  const DB = "qvld";
  const STORE = "conversations";
  let db = null;
  let memory = null; // Map id -> conversation, when IndexedDB is not there

  function request(req) {
    return new Promise((resolve, reject) => {
      req.onsuccess = () => resolve(req.result);
      req.onerror = () => reject(req.error);
    });
  }

  async function open() {
    try {
      const req = indexedDB.open(DB, 1);
      req.onupgradeneeded = () => {
        req.result.createObjectStore(STORE, {keyPath: "id"}).createIndex("updated", "updated");
      };
      db = await request(req);
      return true;
    } catch (err) {
      memory = new Map();
      return false;
    }
  }

  function store(mode) {
    return db.transaction(STORE, mode).objectStore(STORE);
  }

  // Every conversation, newest first (the list shows titles; turns come with them).
  async function all() {
    const found = memory ? [...memory.values()] : await request(store("readonly").getAll());
    return found.sort((a, b) => b.updated - a.updated);
  }

  async function get(id) {
    if (memory) return memory.get(id) || null;
    return (await request(store("readonly").get(id))) || null;
  }

  async function put(conversation) {
    if (memory) {
      memory.set(conversation.id, conversation);
      return;
    }
    await request(store("readwrite").put(conversation));
  }

  async function remove(id) {
    if (memory) {
      memory.delete(id);
      return;
    }
    await request(store("readwrite").delete(id));
  }

  return {open, all, get, put, remove};
})();
