// kandevd console: the few live parts of server-rendered pages. No library, no other origin.
"use strict";

function localTimes(root) {
  for (const el of root.querySelectorAll("time[datetime]")) {
    const when = new Date(el.getAttribute("datetime"));
    if (isNaN(when)) continue;
    el.textContent = when.toLocaleString(undefined, {
      year: "numeric", month: "short", day: "numeric",
      hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short",
    });
  }
}

function confirmations(root) {
  for (const form of root.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
}

// The page's live views: their streams, and the ids the console gave them.
const liveSources = new Set();

// The notice above a live view that is not live (busy, reconnecting, refused).
function liveNotice(anchor, text) {
  let notice = anchor.previousElementSibling;
  if (!notice || !notice.classList.contains("live-notice")) {
    notice = document.createElement("p");
    notice.className = "live-notice";
    notice.setAttribute("role", "status");
    anchor.before(notice);
  }
  notice.textContent = text;
  return notice;
}

// A live view's event stream. The console serves a few at once: one refused gets
// "busy" (its browser tries again by itself), one accepted starts with "ready". A
// stream that breaks is tried again by the browser ("reconnecting"); one the console
// refuses (signed out, or it has another token now) is given up, and the page says so.
function liveSource(url, anchor) {
  const source = new EventSource(url);
  liveSources.add(source);
  source.addEventListener("busy", (event) => {
    const data = JSON.parse(event.data);
    liveNotice(anchor, `Busy, retrying: the console already follows ${data.open} live ` +
      `views (other tabs or pages); this one tries again every ${data.retry_s} s and ` +
      "updates by itself once one of them closes.");
    anchor.dataset.liveState = "busy";
  });
  source.addEventListener("ready", (event) => {
    source.streamId = JSON.parse(event.data).id;
    const notice = anchor.previousElementSibling;
    if (notice && notice.classList.contains("live-notice")) notice.remove();
    anchor.dataset.liveState = "live";
  });
  source.addEventListener("error", () => {
    if (!liveSources.has(source)) return;  // (closed by the page itself)
    // (It stays among the page's sources: a page going away may see this first, as its
    // stream is cut, and must still say it leaves.)
    if (source.readyState === EventSource.CLOSED) {
      const notice = liveNotice(anchor, "Not live any more: the console refused this " +
        "page's updates (signed out, or it has another token now). ");
      const again = document.createElement("a");
      again.href = window.location.href;
      again.textContent = "Load the page again";
      notice.append(again, " to sign in.");
      anchor.dataset.liveState = "closed";
    } else if (anchor.dataset.liveState === "live") {
      liveNotice(anchor, "Reconnecting: the console cannot be reached just now; this " +
        "view updates again by itself once it can.");
      anchor.dataset.liveState = "reconnecting";
    }
  });
  return source;
}

function liveFragments() {
  for (const box of document.querySelectorAll("[data-live][data-events]")) {
    const source = liveSource(box.dataset.events, box);
    source.addEventListener("refresh", async () => {
      const answer = await fetch(box.dataset.live, { credentials: "same-origin" });
      if (!answer.ok) return;
      box.innerHTML = await answer.text();
      localTimes(box);
      confirmations(box);
      box.dataset.refreshed = String(Number(box.dataset.refreshed || 0) + 1);
    });
  }
}

function logStreams() {
  for (const pre of document.querySelectorAll("pre[data-stream]")) {
    const url = new URL(pre.dataset.stream, window.location.href);
    url.searchParams.set("from", pre.dataset.from || "0");
    url.searchParams.set("out", pre.dataset.out || "0");
    // A reconnection resumes from the last event's id (the offset): nothing twice.
    const source = liveSource(url, pre);
    pre.classList.add("following");
    source.addEventListener("append", (event) => {
      const data = JSON.parse(event.data);
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      const note = pre.parentElement.querySelector(".log-note");
      if (note) note.remove();
      // The log, then the agent's stdout: where the stdout lands in the log at the end.
      const part = pre.querySelector(`[data-part="${data.part}"]`) || pre;
      part.append(document.createTextNode(data.text));
      if (atEnd) pre.scrollTop = pre.scrollHeight;
    });
    source.addEventListener("end", () => {
      source.close();
      liveSources.delete(source);
      pre.classList.remove("following");
      pre.classList.add("ended");
      // The run's page shows its outcome (or a session's next turn) once it is written.
      setTimeout(() => window.location.reload(), 800);
    });
  }
}

function waitingPages() {
  // A page whose subject goes on with nothing to follow yet (a session between turns).
  const waiting = document.querySelector("[data-reload-after]");
  if (waiting) setTimeout(() => window.location.reload(), 1000 * Number(waiting.dataset.reloadAfter));
}

function previews() {
  const inputs = document.querySelectorAll("[data-preview]");
  if (!inputs.length) return;
  const target = document.querySelector(inputs[0].dataset.preview);
  const cron = document.querySelector("#f-cron");
  const zone = document.querySelector("#f-timezone");
  let timer = null;
  const refresh = async () => {
    const query = new URLSearchParams({ cron_expression: cron.value, timezone: zone.value });
    const answer = await fetch("/schedules/preview?" + query, { credentials: "same-origin" });
    if (!answer.ok) return;
    target.innerHTML = await answer.text();
    localTimes(target);
  };
  // A problem the server found in a field is said beside it; the preview would say it a
  // second time: it starts once the field changes (and the old problem goes then).
  const problemsOf = (input) => input.closest(".field").querySelectorAll(".field-error");
  let said = false;
  for (const input of inputs) {
    if (problemsOf(input).length) said = true;
    input.addEventListener("input", () => {
      for (const problem of problemsOf(input)) problem.remove();
      clearTimeout(timer);
      timer = setTimeout(refresh, 300);
    });
  }
  if (!said) refresh();
}

function cronOf(form) {
  const value = (name) => form.elements[name].value;
  const at = (name) => {
    const [hour, minute] = (value(name) || "09:00").split(":").map(Number);
    return `${minute} ${hour}`;
  };
  switch (form.elements.preset.value) {
    case "minutes": return `*/${Math.max(1, Number(value("every")) || 1)} * * * *`;
    case "hourly": return `${Number(value("minute")) || 0} * * * *`;
    case "daily": return `${at("daily")} * * *`;
    case "weekdays": return `${at("weekdays")} * * 1-5`;
    case "weekly": return `${at("weekly")} * * ${value("weekday")}`;
    case "monthly": return `${at("monthly")} ${Number(value("day")) || 1} * *`;
    default: return null;
  }
}

function presets() {
  for (const button of document.querySelectorAll("button[data-open]")) {
    const dialog = document.querySelector(button.dataset.open);
    button.addEventListener("click", () => dialog.showModal());
  }
  for (const form of document.querySelectorAll("form[data-presets-for]")) {
    const input = document.querySelector(form.dataset.presetsFor);
    const shown = form.querySelector("[data-preset-result]");
    const show = () => { const cron = cronOf(form); shown.textContent = cron ? `Cron: ${cron}` : ""; };
    form.addEventListener("input", show);
    form.addEventListener("change", show);
    show();
    form.addEventListener("submit", (event) => {
      if (event.submitter && event.submitter.value !== "apply") return;
      const cron = cronOf(form);
      if (cron) {
        input.value = cron;
        input.dispatchEvent(new Event("input", { bubbles: true }));
      }
      input.focus();
    });
  }
}

function groupsReload() {
  const select = document.querySelector("select[data-reload-groups]");
  if (!select) return;
  select.addEventListener("change", () => {
    window.location.assign("/schedules/new?workflow=" + encodeURIComponent(select.value));
  });
}

function browserZone() {
  // Date and time pickers give a wall time: it is read in the browser's own zone.
  const zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
  if (!zone) return;
  for (const input of document.querySelectorAll("input[data-browser-zone]")) input.value = zone;
  for (const name of document.querySelectorAll("[data-zone-name]")) name.textContent = zone;
}

function elapsed(seconds) {
  // (as the server writes durations: kandevd/web/context.py, duration)
  if (seconds < 60) return `${seconds.toFixed(0)}s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes}m ${String(Math.floor(seconds % 60)).padStart(2, "0")}s`;
  const hours = Math.floor(minutes / 60);
  if (hours < 48) return `${hours}h ${String(minutes % 60).padStart(2, "0")}m`;
  return `${Math.floor(hours / 24)}d ${hours % 24}h`;
}

function clocks() {
  // "running for", "waiting": counted on in the browser from the moment the page names
  // (looked up at each tick: a live view may have replaced or added them).
  const tick = () => {
    for (const el of document.querySelectorAll("[data-since]")) {
      const since = new Date(el.dataset.since);
      if (!isNaN(since)) el.textContent = elapsed(Math.max(0, (Date.now() - since) / 1000));
    }
  };
  tick();
  setInterval(tick, 1000);
}

function selectAll() {
  for (const box of document.querySelectorAll("input[data-select-all]")) {
    box.addEventListener("change", () => {
      for (const other of box.form.querySelectorAll(`input[name="${box.dataset.selectAll}"]`)) {
        other.checked = box.checked;
      }
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  localTimes(document);
  confirmations(document);
  liveFragments();
  logStreams();
  waitingPages();
  previews();
  presets();
  groupsReload();
  selectAll();
  browserZone();
  clocks();
  document.documentElement.dataset.ready = "yes";
});

// A page going away ends its live views now: the console would only notice at a stream's
// next keep-alive, and quick navigation would find every slot held by pages already left.
// (A page kept by the browser to come back to is loaded afresh, with new streams.)
window.addEventListener("pagehide", () => {
  const ids = [];
  for (const source of liveSources) {
    source.close();
    if (source.streamId) ids.push(source.streamId);
  }
  liveSources.clear();
  if (!ids.length) return;
  const csrf = document.querySelector('meta[name="csrf-token"]');
  navigator.sendBeacon("/events/leave", new URLSearchParams({
    streams: ids.join(","), csrf: csrf ? csrf.content : "",
  }));
});
window.addEventListener("pageshow", (event) => {
  if (event.persisted && document.querySelector("[data-events], pre[data-stream]")) {
    window.location.reload();
  }
});
