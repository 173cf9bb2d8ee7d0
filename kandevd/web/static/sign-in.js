// The sign-in form, posted without a navigation: a browser keeps a form's POST body (to
// restore the page) in its session files, never a fetch's. Without script the form
// posts as usual.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  const form = document.querySelector("form.sign-in-form");
  if (!form) return;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = new URLSearchParams(new FormData(form));
    form.elements.token.value = "";
    let answer = null;
    try {
      answer = await fetch(form.action, {method: "POST", body, credentials: "same-origin"});
    } catch (_error) {
      answer = null;
    }
    if (answer && answer.ok) {
      location.replace(form.elements.next.value);
      return;
    }
    const problem = document.getElementById("sign-in-problem");
    problem.textContent = answer && answer.status === 403
      ? "That is not this console's token."
      : "The console did not answer: is the daemon running?";
    problem.hidden = false;
  });
});
