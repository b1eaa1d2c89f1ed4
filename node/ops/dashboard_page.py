"""The job page's HTML: a static shell that polls its live panel, and the panel itself (server-side
SVG charts and tables rendered from one `JobStatus`). No script library, no build chain; every
string from the status is escaped.

Panel: reward over steps; ESS and staleness over steps; policy versions (recent steps); peers
(role, adapter version and lag, groups admitted, rejections by reason, reputation, bans);
recent validator verdicts; delta gossip (who announces which version). Below it, the credit
leaderboard from the trainer's signed statements (`credit_table`), polled every CREDIT_POLL_MS
from /jobs/JOB/credit (hidden where the source has none). The trainer computes no held-out
score, so the page shows none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from swarmrl.protocol.leaderboard import Board
from swarmrl.protocol.pb import swarm_pb2 as pb

POLL_MS = 2000
CREDIT_POLL_MS = 10000
W, H, PAD = 460, 170, 34

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em;color:#222;background:#fafafa}
h1{font-size:1.25em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.2em 0 .3em}
.figs{display:flex;flex-wrap:wrap;gap:1em} .fig{background:#fff;border:1px solid #ddd;padding:.4em}
table{border-collapse:collapse;background:#fff;font-size:13px} td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}
td.l,th.l{text-align:left} .mono{font-family:ui-monospace,monospace} .bad{color:#b00} .ok{color:#070}
.summary span{margin-right:1.1em} #updated{color:#777;font-size:12px}
"""

SCRIPT = """
const panel = document.getElementById('panel'), stamp = document.getElementById('updated');
async function refresh() {
  try {
    const r = await fetch(location.pathname.replace(/\\/$/, '') + '/panel', {cache: 'no-store'});
    if (r.ok) { panel.innerHTML = await r.text(); stamp.textContent = 'updated ' + new Date().toLocaleTimeString(); }
    else { stamp.textContent = 'status ' + r.status; }
  } catch (e) { stamp.textContent = 'unreachable: ' + e; }
}
setInterval(refresh, POLL_MS);
const credit = document.getElementById('credit');
async function refreshCredit() {
  try {
    const r = await fetch(location.pathname.replace(/\\/$/, '') + '/credit', {cache: 'no-store'});
    if (r.ok) { credit.innerHTML = await r.text(); credit.hidden = false; }
  } catch (e) { /* the panel's stamp says when the source is unreachable */ }
}
refreshCredit();
setInterval(refreshCredit, CREDIT_POLL_MS);
""".replace("CREDIT_POLL_MS", str(CREDIT_POLL_MS)).replace("POLL_MS", str(POLL_MS))


def page(st: pb.JobStatus, source: str) -> str:
    """The whole page of one job (the panel inline; the script then refreshes it in place)."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>swarmrl job {escape(st.job_id[:12])}</title>"
            f"<style>{CSS}</style></head><body><h1>swarmrl job <span class='mono'>{escape(st.job_id)}</span></h1>"
            f"<div id='updated'>{escape(source)}</div><main id='panel'>{panel(st)}</main>"
            f"<section id='credit' hidden></section><script>{SCRIPT}</script></body></html>")


def index(jobs: Sequence[tuple[str, pb.JobStatus | None]]) -> str:
    """The jobs served here side by side (one column each: state, steps, reward, groups, a reward
    chart; a link to its page); it reloads itself every few seconds. A job whose status could not
    be read is listed by its link alone."""
    known = [(j, st) for j, st in jobs if st is not None]
    unknown = "".join(f"<li><a class='mono' href='/jobs/{escape(j)}'>{escape(j)}</a></li>" for j, st in jobs if st is None)
    body = side_by_side(known) if known else ("<p>no jobs yet</p>" if not unknown else "")
    return (f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{POLL_MS // 500}'>"
            f"<title>swarmrl jobs</title><style>{CSS}</style></head><body><h1>swarmrl jobs</h1>{body}"
            + (f"<ul>{unknown}</ul>" if unknown else "") + "</body></html>")


def side_by_side(jobs: Sequence[tuple[str, pb.JobStatus]]) -> str:
    """A table with one column per job (`jobs-side-by-side`) and each job's reward chart beside the others'."""
    def row(label: str, cells: Sequence[str]) -> str:
        return f"<tr><th class='l'>{escape(label)}</th>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"

    sts = [st for _, st in jobs]
    last = [st.history[-1].reward_mean if st.history else math.nan for st in sts]
    head = "".join(f"<th><a class='mono' href='/jobs/{escape(j)}'>{escape(j[:12])}</a></th>" for j, _ in jobs)
    rows = [row("state", [escape(st.state) for st in sts]),
            row("step", [f"{st.step}/{st.total_steps}" for st in sts]),
            row("reward (last step)", [_f(r) for r in last]),
            row("groups admitted", [str(st.groups_admitted) for st in sts]),
            row("groups trained", [str(st.groups_trained) for st in sts]),
            row("workers serving", [str(st.serving_workers) if st.HasField("serving_workers") else "-" for st in sts]),
            row("peers submitting", [str(sum(1 for p in st.peers if p.groups_admitted)) for st in sts])]
    charts = "".join(chart(f"reward, job {j[:12]}", [("mean reward", "#1f77b4", [float(m.step) for m in st.history],
                                                      [m.reward_mean for m in st.history])]) for j, st in jobs)
    return (f"<table class='jobs-side-by-side'><thead><tr><th class='l'>job</th>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table><div class='figs'>{charts}</div>")


def panel(st: pb.JobStatus) -> str:
    """The live part of the page."""
    h = list(st.history)
    steps = [float(m.step) for m in h]
    reward = chart("reward", [("mean reward", "#1f77b4", steps, [m.reward_mean for m in h])])
    ess = chart("ESS (share of batch)", [("ESS", "#2ca02c", steps, [m.extra.get("ess", math.nan) for m in h])])
    stale = chart("staleness (versions)", [("mean", "#d62728", steps, [m.staleness_mean for m in h]),
                                           ("max", "#ff9896", steps, [m.extra.get("staleness_max", math.nan) for m in h])])
    return (summary(st) + f"<div class='figs'>{reward}{ess}{stale}</div>" + versions_table(h) + peers_table(st)
            + verdicts_table(st) + gossip_table(st))


def summary(st: pb.JobStatus) -> str:
    """HTML of the job's headline figures (state, step, version, groups), escaped."""
    rejected = ", ".join(f"{escape(k)} {v}" for k, v in sorted(st.groups_rejected.items())) or "none"
    items = [f"state <b id='state'>{escape(st.state)}</b>", f"step <b id='step'>{st.step}</b>/{st.total_steps}",
             f"version {st.policy_version} <span class='mono'>{st.adapter_hash.hex()[:12]}</span>",
             f"admitted {st.groups_admitted}", f"on probation {st.groups_on_probation}",
             f"dropped {st.groups_dropped} (bans {st.groups_dropped_banned})", f"rejected: {rejected}",
             f"validator checked {st.validator_checked}, failed {st.validator_failed}",
             f"trainer <span class='mono'>{escape(st.trainer_id[:16])}</span>"]
    if st.cotrainers:
        items.append(f"cotrainers {len(st.cotrainers)} (averaged steps {st.averaging_rounds})")
    return "<p class='summary'>" + "".join(f"<span>{i}</span>" for i in items) + "</p>"


Series = tuple[str, str, list[float], list[float]]   # (label, colour, xs, ys)


def chart(title: str, series: Sequence[Series]) -> str:
    """A line chart as inline SVG; NaNs are skipped. `data-points` counts the plotted steps."""
    pts = [(x, y) for _, _, xs, ys in series for x, y in zip(xs, ys) if math.isfinite(y)]
    n = len({x for _, _, xs, ys in series[:1] for x, y in zip(xs, ys) if math.isfinite(y)})
    head = f"<div class='fig'><svg class='chart' data-points='{n}' width='{W}' height='{H}' role='img'>" \
           f"<title>{escape(title)}</title><text x='{PAD}' y='14' font-size='13'>{escape(title)}</text>"
    if not pts:
        return head + f"<text x='{W / 2 - 40}' y='{H / 2}' fill='#888'>no steps yet</text></svg></div>"
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 == x0:
        x1 = x0 + 1

    def sx(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0) * (W - PAD - 10)

    def sy(y: float) -> float:
        return H - 22 - (y - y0) / (y1 - y0) * (H - 44)

    body = [f"<line x1='{PAD}' y1='{H - 22}' x2='{W - 10}' y2='{H - 22}' stroke='#999'/>",
            f"<line x1='{PAD}' y1='22' x2='{PAD}' y2='{H - 22}' stroke='#999'/>",
            f"<text x='2' y='26' font-size='10'>{y1:.3g}</text><text x='2' y='{H - 22}' font-size='10'>{y0:.3g}</text>",
            (f"<text x='{PAD}' y='{H - 6}' font-size='10'>step {x0:g}</text>"
             f"<text x='{W - 60}' y='{H - 6}' font-size='10'>step {x1:g}</text>")]
    for i, (label, colour, xs, ys) in enumerate(series):
        xy = [(sx(x), sy(y)) for x, y in zip(xs, ys) if math.isfinite(y)]
        if not xy:
            continue
        body.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' "
                    f"points='{' '.join(f'{a:.1f},{b:.1f}' for a, b in xy)}'/>")
        body += [f"<circle cx='{a:.1f}' cy='{b:.1f}' r='2' fill='{colour}'/>" for a, b in xy[-200:]]
        body.append(f"<text x='{W - 150 + 70 * i}' y='14' font-size='11' fill='{colour}'>{escape(label)}</text>")
    return head + "".join(body) + "</svg></div>"


def _table(title: str, cls: str, header: Sequence[str], rows: Sequence[str]) -> str:
    ths = "".join(f"<th class='l'>{escape(c)}</th>" if i == 0 else f"<th>{escape(c)}</th>" for i, c in enumerate(header))
    body = "".join(rows) or f"<tr><td class='l' colspan='{len(header)}'>none yet</td></tr>"
    return f"<h2>{escape(title)}</h2><table class='{cls}'><thead><tr>{ths}</tr></thead><tbody>{body}</tbody></table>"


def _f(v: float, fmt: str = ".3f") -> str:
    return format(v, fmt) if math.isfinite(v) else "-"


def versions_table(history: Sequence[pb.StepMetrics], last: int = 8) -> str:
    """HTML table of the `last` steps of `history` (version, reward, loss, ESS, staleness, groups, seconds)."""
    rows = [f"<tr><td class='l'>{m.step}</td><td>{m.policy_version}</td><td>{_f(m.reward_mean)}</td>"
            f"<td>{_f(m.loss, '.4f')}</td><td>{_f(m.extra.get('ess', math.nan))}</td><td>{_f(m.staleness_mean, '.2f')}</td>"
            f"<td>{m.groups_trained}</td><td>{m.groups_rejected}</td><td>{_f(m.seconds, '.1f')}</td></tr>"
            for m in reversed(list(history)[-last:])]
    return _table("policy versions (newest first)", "versions",
                  ["step", "version", "reward", "loss", "ESS", "staleness", "groups trained", "rejected", "seconds"], rows)


def peers_table(st: pb.JobStatus) -> str:
    """Workers (from the trainer's ledger), cotrainers and the validators whose verdicts arrived."""
    rows = []
    for p in st.peers:
        lag = str(st.policy_version - p.adapter_version) if p.HasField("adapter_version") else "-"
        held = str(p.adapter_version) if p.HasField("adapter_version") else "-"
        reasons = ", ".join(f"{escape(k)} {v}" for k, v in sorted(p.rejected_by_reason.items())) or ""
        ban = f"<span class='bad'>{escape(p.ban_reason)}</span>" if p.banned else ""
        rows.append(f"<tr data-peer='{escape(p.peer_id)}' data-role='worker'><td class='l mono'>{escape(p.peer_id)}</td>"
                    f"<td class='l'>worker</td><td>{held}</td><td>{lag}</td><td class='admitted'>{p.groups_admitted}</td>"
                    f"<td>{p.groups_trained}</td><td class='rejected'>{p.groups_rejected}</td><td class='l'>{reasons}</td>"
                    f"<td>{p.verdicts_checked} ({p.verdicts_failed})</td><td>{p.strikes}</td>"
                    f"<td>{p.reputation:.2f}</td><td class='l'>{ban}</td></tr>")
    for c in st.cotrainers:
        rows.append(_other_row(c, "trainer"))
    for v in sorted({r.validator_id for r in st.recent_verdicts}):
        rows.append(_other_row(v, "validator"))
    header = ["peer", "role", "adapter", "lag", "admitted", "groups trained into versions", "rejected",
              "rejections by reason", "verdicts (failed)", "strikes", "reputation", "ban"]
    return _table(f"peers, over all {st.step} steps", "peers", header, rows)


def _other_row(peer_id: str, role: str) -> str:
    return (f"<tr data-peer='{escape(peer_id)}' data-role='{role}'><td class='l mono'>{escape(peer_id)}</td>"
            f"<td class='l'>{role}</td>" + "<td></td>" * 10 + "</tr>")


def verdicts_table(st: pb.JobStatus) -> str:
    """HTML table of the job's recent validator verdicts (peer, prompt, check, result)."""
    rows = [f"<tr><td class='l mono'>{escape(r.verdict.peer_id[:16])}</td><td>{r.verdict.prompt_index}</td>"
            f"<td class='l'>{escape(r.verdict.check)}</td>"
            f"<td class='l {'ok' if r.verdict.passed else 'bad'}'>{'passed' if r.verdict.passed else 'failed'}</td>"
            f"<td class='l'>{escape(r.verdict.detail[:80])}</td><td class='l mono'>{escape(r.validator_id[:16])}</td></tr>"
            for r in st.recent_verdicts]
    return _table("recent validator verdicts", "verdicts", ["peer", "prompt", "check", "result", "detail", "validator"],
                  rows)


def gossip_table(st: pb.JobStatus) -> str:
    """HTML table of delta-gossip holders: newest version each holds and its lag behind the policy."""
    rows = [f"<tr><td class='l mono'>{escape(h)}</td><td>{v}</td><td>{st.policy_version - v}</td></tr>"
            for h, v in sorted(st.holder_versions.items(), key=lambda kv: (-kv[1], kv[0]))]
    return _table("delta gossip: who holds which version", "gossip", ["holder", "newest version", "lag"], rows)


def credit_table(b: Board) -> str:
    """HTML of a job's leaderboard (`protocol.leaderboard.Board`): one row per peer (groups,
    share, tokens, batches, versions, dropped by reason, checked and verified share, ban),
    titled with the statements it sums; what the checks found, in red; links to JSON and CSV."""
    rows = []
    for r in b.rows:
        dropped = ", ".join(f"{escape(k)} {v}" for k, v in sorted(r.dropped.items()))
        vs = "-" if r.verified_share is None else f"{100 * r.verified_share:.0f}%"
        rows.append(f"<tr data-peer='{escape(r.peer_id)}'><td class='l mono'>{escape(r.peer_id)}</td>"
                    f"<td class='groups'>{r.groups}</td><td>{100 * r.share:.1f}%</td><td>{r.tokens}</td>"
                    f"<td>{r.batches}</td><td>{r.versions}</td><td class='l'>{dropped}</td><td>{r.checked}</td>"
                    f"<td class='verified'>{vs}</td><td class='l bad'>{escape(r.banned)}</td></tr>")
    title = (f"credit from {b.statements} signed statements (versions {b.first_version}-{b.head_version}): "
             f"{b.groups} groups, {b.tokens} tokens")
    found = (f"<p class='bad'>the checks found {escape(str(dict(b.findings)))}: run swarmrl audit for the details</p>"
             if b.findings else "")
    links = f"<p><a href='/jobs/{escape(b.job_id)}/credit.json'>JSON</a> <a href='/jobs/{escape(b.job_id)}/credit.csv'>CSV</a></p>"
    return _table(title, "credit", ["peer", "groups", "share", "tokens", "batches", "versions", "dropped",
                                    "checked", "verified share", "banned"], rows) + found + links
