// The two pages of `somatize serve`: the runs of a store, and one run as it trains.
// Each opens one event stream; the server sends the whole state first, then what moved.
// Everything from the store is put in as text (textContent), never as markup.
"use strict";

(function () {
  const body = document.body;
  const main = document.getElementById("main");
  const link = document.getElementById("link");

  function el(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes || {})) {
      if (value !== undefined && value !== null) node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // A store may say any time: one no Date can hold is shown as a dash, not thrown.
  function when(seconds) {
    const moment = new Date(seconds * 1000);
    if (typeof seconds !== "number" || isNaN(moment.getTime())) return "—";
    return moment.toISOString().replace("T", " ").slice(0, 19) + " UTC";
  }

  function ago(seconds) {
    if (typeof seconds !== "number" || !isFinite(seconds)) return "—";
    if (seconds < 60) return Math.floor(seconds) + " s ago";
    if (seconds < 3600) return Math.floor(seconds / 60) + " min ago";
    if (seconds < 86400) return Math.floor(seconds / 3600) + " h ago";
    return Math.floor(seconds / 86400) + " d ago";
  }

  function shown(value) {
    if (value === null || value === undefined) return "—";
    if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toPrecision(5);
    return String(value);  // 'nan' and 'inf' come as words
  }

  function listen(url, handlers) {
    const stream = new EventSource(url);
    stream.onopen = () => { link.textContent = "live"; link.className = "link up"; };
    stream.onerror = () => { link.textContent = "reconnecting…"; link.className = "link down"; };
    for (const [kind, handle] of Object.entries(handlers)) {
      stream.addEventListener(kind, (event) => handle(JSON.parse(event.data)));
    }
    return stream;
  }

  // Labels such as "4 s ago" keep counting between messages.
  const ticking = [];
  setInterval(() => {
    const now = performance.now();
    for (const label of ticking) label.node.textContent = ago(label.ago + (now - label.at) / 1000);
  }, 1000);

  function ticker(seconds) {
    const node = el("span", {}, ago(seconds));
    ticking.push({ node, ago: seconds, at: performance.now() });
    return node;
  }

  // -- the runs of a store -----------------------------------------------------------------
  function runsPage() {
    const summary = el("p", { class: "facts", id: "summary" }, "reading the store…");
    const rows = el("tbody");
    const table = el("table", { class: "runs", id: "runs" },
      el("thead", {}, el("tr", {}, ...["run", "forwards", "started", "last forward", "last loss",
        "findings"].map((h) => el("th", {}, h)))), rows);
    main.append(el("h1", {}, "Runs"), summary, table);
    listen("/events/runs", {
      runs(found) {
        ticking.length = 0;
        rows.replaceChildren(...found.map(runRow));
        const live = found.filter((r) => r.live).length;
        summary.textContent = found.length === 0
          ? "No runs yet: a Recorder(store) writes one; this page shows it as soon as it does."
          : `${found.length} run${found.length === 1 ? "" : "s"}, newest first` +
            (live ? ` · ${live} recording now` : "");
      },
    });
  }

  function flags(findings) {
    if (findings === null) return el("span", { class: "note" }, "judging…");
    if (findings.length === 0) return el("span", { class: "clean" }, "none");
    return el("span", {}, ...findings.map((f) =>
      el("span", { class: "flag", title: `since step ${f.since}` }, `${f.what} · ${f.where}`)));
  }

  function damage(reasons) {
    if (!reasons || reasons.length === 0) return null;
    return el("span", { class: "badge damaged", title: reasons.join("\n") },
      `damaged: ${reasons.length === 1 ? "1 record" : reasons.length + " records"}`);
  }

  function runRow(run) {
    const name = el("a", { class: "run-link", href: "/run/" + encodeURIComponent(run.name) }, run.name);
    return el("tr", { "data-run": run.name },
      el("td", {}, name, " ", run.live ? el("span", { class: "badge live" }, "recording") : null,
        " ", damage(run.damaged)),
      el("td", { class: "number forwards" }, run.forwards),
      el("td", {}, when(run.first)),
      el("td", {}, ticker(run.ago)),
      el("td", { class: "number" }, shown(run.loss)),
      el("td", {}, flags(run.findings)));
  }

  // -- one run -----------------------------------------------------------------------------
  function runPage(run) {
    const status = el("span", { id: "status", class: "badge" }, "…");
    const facts = el("p", { class: "facts", id: "facts" }, "reading the run…");
    const card = (label, id) => el("div", { class: "card" }, el("div", { class: "label" }, label),
      el("div", { class: "value", id }, "…"));
    main.append(el("h1", {}, "Run ", el("span", { class: "name" }, run), status), facts,
      el("div", { class: "cards" }, card("forwards", "forwards"), card("last loss", "loss"),
        card("forwards per second", "rate"), card("findings", "findings-count")),
      el("div", { id: "sections" }));
    const curve = { run, points: [], drawn: false, lastX: -1, weight: 0.9, average: 0, seen: 0 };
    listen("/events/run/" + encodeURIComponent(run), {
      state(state) { showState(state, status, facts, curve); },
      sections(drawn) { showSections(drawn.sections, curve); },
    });
  }

  function showState(state, status, facts, curve) {
    document.getElementById("forwards").textContent = state.forwards;
    document.getElementById("loss").textContent = shown(state.loss);
    document.getElementById("rate").textContent = state.rate === null ? "—" : state.rate.toPrecision(3);
    // Said again on every state, and the server sends one when the run stops too.
    status.textContent = state.live ? "recording" : "stopped";
    status.className = state.live ? "badge live" : "badge stopped";
    status.title = state.live ? "forwards are still being bound"
      : `no forward since ${when(state.last)}: the run has stopped, or paused`;
    ticking.length = 0;
    facts.replaceChildren(`started ${when(state.first)} · last forward `, ticker(state.ago));
    // A stream opened again (the server restarted) sends every point again: keep each once.
    const known = curve.points.length ? curve.points[curve.points.length - 1][0] : -1;
    curve.points.push(...state.points.filter(([x]) => x > known));
    extend(curve, state.points);
    retitle(curve);
  }

  function escaped(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  // The progress figure's title counts the forwards and names the last and lowest loss:
  // kept true as points arrive between two drawings, as the cards beside it are.
  function retitle(curve) {
    const div = document.getElementById("figure-progress");
    if (!curve.drawn || !div || curve.points.length === 0) return;
    const said = curve.points.filter(([, y]) => y !== null);
    const last = curve.points[curve.points.length - 1][1];
    let best = null;
    for (const [x, y] of said) if (best === null || y < best[1]) best = [x, y];
    const number = (v) => (v === null ? "nan" : Number(v).toPrecision(4).replace(/\.?0+(e|$)/, "$1"));
    const text = `<b>${escaped(curve.run)}</b> — loss over ${curve.points.length} forwards ` +
      `(last ${number(last)}` + (best ? `, lowest ${number(best[1])} at forward ${best[0]})` : ")");
    if ((div.layout.title || {}).text !== text) Plotly.relayout(div, { "title.text": text });
  }

  // The progress figure comes with the sections; between two drawings the newest losses
  // are added to it here, smoothed as the server smooths them (a debiased moving average).
  function extend(curve, points) {
    const fresh = points.filter(([x]) => x > curve.lastX);
    const div = document.getElementById("figure-progress");
    if (!curve.drawn || !div || fresh.length === 0) return;
    const xs = [], raw = [], smooth = [];
    for (const [x, y] of fresh) {
      if (y !== null) {
        curve.average = curve.weight * curve.average + (1 - curve.weight) * y;
        curve.seen += 1;
      }
      xs.push(x); raw.push(y);
      smooth.push(curve.seen ? curve.average / (1 - Math.pow(curve.weight, curve.seen)) : null);
    }
    curve.lastX = fresh[fresh.length - 1][0];
    Plotly.extendTraces(div, { x: [xs, xs.slice()], y: [raw, smooth] }, [0, 1]);
  }

  function restart(curve, figure) {
    const raw = figure.data[0] || { x: [], y: [] };
    const named = /smoothed ([0-9.]+)/.exec((figure.data[1] || {}).name || "");
    curve.weight = named ? parseFloat(named[1]) : 0.9;
    curve.average = 0; curve.seen = 0; curve.lastX = -1;
    (raw.y || []).forEach((y, at) => {
      if (y !== null) {
        curve.average = curve.weight * curve.average + (1 - curve.weight) * y;
        curve.seen += 1;
      }
      curve.lastX = Math.max(curve.lastX, raw.x[at]);
    });
    curve.drawn = true;
  }

  function section(key, title) {
    let node = document.getElementById("section-" + key);
    if (!node) {
      node = el("section", { id: "section-" + key }, el("h2", {}, title), el("div", { class: "body" }),
        el("div", { class: "figure", id: "figure-" + key }));
      document.getElementById("sections").append(node);
    }
    node.querySelector("h2").textContent = title;
    return node;
  }

  function showSections(sections, curve) {
    const sent = new Set(sections.map((part) => part.key));
    for (const node of document.querySelectorAll("#sections > section")) {
      node.hidden = !sent.has(node.id.slice("section-".length));  // one no longer sent
    }
    for (const part of sections) {
      const node = section(part.key, part.title);
      const text = node.querySelector(".body");
      const figure = node.querySelector(".figure");
      text.replaceChildren();
      if (part.findings !== undefined) {
        text.append(findingsTable(part.findings));
        document.getElementById("findings-count").textContent = part.findings.length;
      }
      if (part.note) text.append(el("p", { class: "note" }, part.note));
      if (part.figure) {
        // The toolbar has a strip of its own above the figure (page.css): standing in
        // the figure, it covered a title or, upright at the right edge, a legend.
        const layout = part.figure.layout;
        Plotly.react(figure, part.figure.data, layout, { displaylogo: false, responsive: true });
        if (part.key === "progress") {
          restart(curve, part.figure);
          extend(curve, curve.points);
          retitle(curve);
        }
      } else {
        if (figure.data) Plotly.purge(figure);
        if (part.key === "progress") curve.drawn = false;
      }
    }
  }

  function findingsTable(findings) {
    if (findings.length === 0) return el("p", {}, "No findings at the default thresholds.");
    const advised = findings.some((f) => f.advice);
    const head = ["where", "what", "since step", "evidence"].concat(advised ? ["what to try"] : []);
    return el("table", { class: "findings", id: "findings" },
      el("tr", {}, ...head.map((h) => el("th", {}, h))),
      ...findings.map((f) => el("tr", {}, el("td", {}, f.where), el("td", { class: "what" }, f.what),
        el("td", {}, f.since), el("td", {}, f.evidence),
        advised ? el("td", { class: "advice" }, f.advice || "") : null)));
  }

  if (body.dataset.page === "run") runPage(body.dataset.run);
  else runsPage();
})();
