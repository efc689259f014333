// sqlease dashboard: local times, and live fragments by short polling (no framework).
(function () {
  "use strict";
  function pad(n, w) { return String(n).padStart(w || 2, "0"); }
  function localIso(d) {
    var off = -d.getTimezoneOffset(), sign = off >= 0 ? "+" : "-";
    off = Math.abs(off);
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + "T" +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) +
      sign + pad(Math.floor(off / 60)) + ":" + pad(off % 60);
  }
  function relative(ms) {
    var s = Math.round((ms - Date.now()) / 1000), a = Math.abs(s), text;
    if (a < 5) return "just now";
    if (a < 90) text = a + " s";
    else if (a < 5400) text = Math.round(a / 60) + " min";
    else if (a < 129600) text = Math.round(a / 3600) + " h";
    else text = Math.round(a / 86400) + " d";
    return s < 0 ? text + " ago" : "in " + text;
  }
  function showTimes(root) {
    root.querySelectorAll("time[data-ms]").forEach(function (el) {
      var ms = Number(el.dataset.ms), d = new Date(ms);
      el.title = el.getAttribute("datetime");
      el.textContent = localIso(d);
      var rel = document.createElement("span");
      rel.className = "rel";
      rel.textContent = "(" + relative(ms) + ")";
      el.appendChild(rel);
    });
  }
  function busy(box) {
    if (box.querySelector("input:checked")) return true;
    var typed = Array.prototype.some.call(
      box.querySelectorAll("input[type=text], input:not([type]), textarea"),
      function (el) { return el.value !== ""; });
    return typed || box.contains(document.activeElement) && document.activeElement.matches("input, textarea");
  }
  function poll(box) {
    var every = Number(box.dataset.every || 3) * 1000;
    function tick() {
      if (document.hidden || busy(box)) {
        return setTimeout(tick, every);  // hidden, or the person is choosing or typing
      }
      fetch(box.dataset.fragment, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html !== null && !busy(box)) {
            box.innerHTML = html;
            showTimes(box);
            box.dataset.refreshed = String(Date.now());
          }
        })
        .catch(function () { /* the next tick tries again */ })
        .then(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    showTimes(document);
    document.querySelectorAll("[data-fragment]").forEach(poll);
  });
})();
