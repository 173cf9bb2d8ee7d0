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

function liveFragments() {
  for (const box of document.querySelectorAll("[data-live][data-events]")) {
    const source = new EventSource(box.dataset.events);
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
    // A reconnection resumes from the last event's id (the offset): nothing twice.
    const source = new EventSource(url);
    pre.classList.add("following");
    source.addEventListener("append", (event) => {
      const data = JSON.parse(event.data);
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.append(document.createTextNode(data.text));
      if (atEnd) pre.scrollTop = pre.scrollHeight;
    });
    source.addEventListener("end", () => {
      source.close();
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
  for (const input of inputs) {
    input.addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(refresh, 300);
    });
  }
  refresh();
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
  document.documentElement.dataset.ready = "yes";
});
