"""Who runs what and how far: one row per attendee's server, from the hub's user models and each server's
allocation report (pure; the instructor's page and ``hpcdl-workshop status`` render it)."""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AttendeeRow:
    user: str
    server: str  # "" for the default server
    state: str  # "no server", "starting", "running", "stopping"
    partition: str = ""
    nodes: int | None = None
    gpus_per_node: int | None = None
    image: str = ""
    job_id: str = ""
    job_nodes: str = ""
    time_left: str = ""
    session: str = ""  # the training session's state: none, starting, idle, training, stopped, failed, walltime
    ranks: int = 0
    loss: float | None = None  # the mean of the ranks' latest losses
    samples_per_s: float | None = None  # over all ranks
    last_activity: str = ""
    error: str = ""  # why the server's report could not be read

    def as_dict(self) -> dict:
        return asdict(self)


def _state(server: dict) -> str:
    if server.get("pending") == "stop":
        return "stopping"
    if server.get("ready"):
        return "running"
    return "starting"


def attendee_rows(users: list[dict], allocations: dict[tuple[str, str], dict | None]) -> list[AttendeeRow]:
    """Rows for the hub's user models ``users`` and the servers' allocation reports, by (user, server)."""
    rows = []
    for user in sorted(users, key=lambda u: u["name"]):
        servers = user.get("servers") or {}
        if not servers:
            rows.append(AttendeeRow(user["name"], "", "no server", last_activity=user.get("last_activity") or ""))
        for name, server in sorted(servers.items()):
            options = server.get("user_options") or {}
            alloc = allocations.get((user["name"], name)) or {}
            ranks = [r for r in alloc.get("ranks") or [] if isinstance(r, dict)]
            losses = [r["loss"] for r in ranks if isinstance(r.get("loss"), (int, float))]
            speeds = [r["samples_per_s"] for r in ranks if isinstance(r.get("samples_per_s"), (int, float))]
            rows.append(AttendeeRow(
                user["name"], name, _state(server), str(options.get("partition", "")), options.get("nodes"),
                options.get("gpus_per_node"), str(options.get("image", "")), str(alloc.get("job_id") or ""),
                ",".join(alloc.get("nodes") or []), str(alloc.get("time_left") or ""), str(alloc.get("session") or ""),
                len(ranks), sum(losses) / len(losses) if losses else None, sum(speeds) if speeds else None,
                server.get("last_activity") or "", str(alloc.get("error") or "")))
    return rows


COLUMNS = ("user", "server", "state", "partition", "nodes", "gpus_per_node", "image", "job_id", "job_nodes",
           "time_left", "session", "ranks", "loss", "samples_per_s", "last_activity", "error")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def render_page(rows: list[AttendeeRow], group: str, refresh: int = 10) -> str:
    """The instructor's page: a table that reloads itself every ``refresh`` seconds."""
    running = sum(r.state == "running" for r in rows)
    training = sum(r.session == "training" for r in rows)
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{_cell(getattr(r, c))}</td>" for c in COLUMNS) + "</tr>" for r in rows)
    return (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh}">'
            f"<title>Workshop {html.escape(group)}</title><style>body{{font-family:sans-serif}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}</style>"
            f"</head><body><h1>Workshop <code>{html.escape(group)}</code></h1>"
            f"<p>{len({r.user for r in rows})} attendees, {running} servers running, {training} training now "
            f"(reloads every {refresh} s; <a href=\"api/status\">JSON</a>)</p>"
            f'<table id="attendees"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>')


def collect(api, group: str) -> list[AttendeeRow]:
    """The group's rows, asked of the hub (``api``: a :class:`~.hub.HubAPI`)."""
    users = [api.user(name) for name in api.members(group)]
    allocations = {(u["name"], name): api.allocation(u["name"], name)
                   for u in users for name, server in (u.get("servers") or {}).items() if server.get("ready")}
    return attendee_rows(users, allocations)
