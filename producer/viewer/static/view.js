// cchatq view: the pages' live parts. An element with data-refresh="URL" is replaced by the
// HTML fragment that URL answers: every second while its data-live is "true", every
// data-idle milliseconds otherwise (0: it stops). Open <details> stay open across refreshes.
(function () {
  "use strict";
  var LIVE_MS = 1000;
  var RETRY_MS = 5000;

  function openDetails(root) {
    var open = [];
    root.querySelectorAll("details").forEach(function (d, i) {
      if (d.open) {
        open.push(i);
      }
    });
    return open;
  }

  function schedule(el, ms) {
    var wait = ms;
    if (wait === undefined) {
      wait = el.dataset.live === "true" ? LIVE_MS : parseInt(el.dataset.idle || "0", 10);
    }
    if (!wait) {
      return;
    }
    window.setTimeout(function () { refresh(el); }, wait);
  }

  function refresh(el) {
    if (!el.isConnected) {
      return;
    }
    fetch(el.dataset.refresh, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) {
          schedule(el, RETRY_MS);
          return;
        }
        var holder = document.createElement("template");
        holder.innerHTML = html.trim();
        var fresh = holder.content.firstElementChild;
        if (!fresh || fresh.id !== el.id) {
          schedule(el, RETRY_MS);
          return;
        }
        var wasOpen = openDetails(el);
        el.replaceWith(fresh);
        var details = fresh.querySelectorAll("details");
        wasOpen.forEach(function (i) {
          if (details[i]) {
            details[i].open = true;
          }
        });
        schedule(fresh);
      })
      .catch(function () { schedule(el, RETRY_MS); });
  }

  function autoSubmit() {
    var form = document.getElementById("filter");
    if (!form) {
      return;
    }
    form.querySelectorAll("select").forEach(function (select) {
      select.addEventListener("change", function () { form.submit(); });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(function (el) { schedule(el); });
    autoSubmit();
  });
})();
