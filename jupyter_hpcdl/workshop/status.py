"""Who runs what: one row per attendee's server, from the hub's user models (with each server's state) and one
listing of the batch system's queue for the whole room (pure; the instructor's page and ``hpcdl-workshop status``
render it). Nothing here asks an attendee's server: a server is code its attendee controls."""
from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from ..batchsystems.scheduler import PENDING, JobInfo
from ..controls import escape_controls
from ..jobvalues import parse_walltime

#: Shown where the service's token may not read the servers' state (the spawner's job id lives there).
NO_STATE = "no job id: give the service's role admin:server_state (e.g. admin:server_state!group=<group>)"


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
    job_state: str = ""  # pending, running or ended, then the scheduler's own words and reason
    job_host: str = ""  # the job's first node, where the server runs
    time_left: str = ""  # at most this much walltime is left (counted from the spawn's start)
    last_activity: str = ""
    error: str = ""  # why a column is empty

    def as_dict(self) -> dict:
        return asdict(self)


def _state(server: Mapping) -> str:
    if server.get("pending") == "stop":
        return "stopping"
    if server.get("ready"):
        return "running"
    return "starting"


def _time_left(options: Mapping, started: object, now: datetime) -> str:
    """``H:MM:SS`` of the walltime the spawn asked for, less the time since the spawn began ("" where unknown)."""
    try:
        minutes = parse_walltime(options.get("walltime"))
        began = datetime.fromisoformat(str(started).replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return ""
    if began.tzinfo is None:
        began = began.replace(tzinfo=timezone.utc)
    left = max(0, int(minutes * 60 - (now - began).total_seconds()))
    return f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"


def _job(state: object, jobs: Mapping[str, JobInfo] | None, listing_error: str) -> tuple[str, str, str, str]:
    """(job id, job state, job host, error) of a server's spawner ``state``, by the queue's listing ``jobs``."""
    if not isinstance(state, Mapping):
        return "", "", "", NO_STATE
    job_id, host = str(state.get("job_id") or ""), str(state.get("job_host") or "")
    if not job_id:
        return "", "", host, ""
    if jobs is None:
        return job_id, "", host, f"the batch system did not answer: {listing_error}"
    info = jobs.get(job_id)
    if info is None:
        return job_id, "", host, "not in the batch system's queue"
    words = f"{info.phase}: {info.state}" + (f" ({info.reason})" if info.reason else "")
    return job_id, words, info.batch_host or host, ""


def attendee_rows(users: list[dict], jobs: Mapping[str, JobInfo] | None, now: datetime | None = None,
                  listing_error: str = "") -> list[AttendeeRow]:
    """Rows for the hub's user models ``users`` and the queue's jobs by id (None: the queue could not be read,
    for ``listing_error``). ``now`` is aware (UTC by default)."""
    now = now or datetime.now(timezone.utc)
    rows = []
    for user in sorted(users, key=lambda u: u["name"]):
        servers = user.get("servers") or {}
        if not servers:
            rows.append(AttendeeRow(user["name"], "", "no server", last_activity=user.get("last_activity") or ""))
        for name, server in sorted(servers.items()):
            options = server.get("user_options") or {}
            job_id, job_state, host, error = _job(server.get("state"), jobs, listing_error)
            rows.append(AttendeeRow(
                user["name"], name, _state(server), str(options.get("partition", "")), options.get("nodes"),
                options.get("gpus_per_node"), str(options.get("image", "")), job_id, job_state, host,
                _time_left(options, server.get("started"), now) if server.get("ready") else "",
                server.get("last_activity") or "", error))
    return rows


COLUMNS = ("user", "server", "state", "partition", "nodes", "gpus_per_node", "image", "job_id", "job_state",
           "job_host", "time_left", "last_activity", "error")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def render_lines(rows: list[AttendeeRow]) -> list[str]:
    """``status``'s lines for a terminal: ``column=value`` pairs, control characters escaped (the values come from
    the hub and the queue, which attendees fill)."""
    return ["  ".join(f"{c}={escape_controls(str(getattr(r, c)))}" for c in COLUMNS if getattr(r, c) not in ("", None))
            for r in rows]


def render_page(rows: list[AttendeeRow], group: str, refresh: int = 10) -> str:
    """The instructor's page: a table that reloads itself every ``refresh`` seconds."""
    running = sum(r.state == "running" for r in rows)
    waiting = sum(r.job_state.startswith(f"{PENDING}:") for r in rows)
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{_cell(getattr(r, c))}</td>" for c in COLUMNS) + "</tr>" for r in rows)
    return (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh}">'
            f"<title>Workshop {html.escape(group)}</title><style>body{{font-family:sans-serif}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}</style>"
            f"</head><body><h1>Workshop <code>{html.escape(group)}</code></h1>"
            f"<p>{len({r.user for r in rows})} attendees, {running} servers running, {waiting} jobs waiting "
            f"(reloads every {refresh} s; <a href=\"api/status\">JSON</a>)</p>"
            f'<table id="attendees"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>')
