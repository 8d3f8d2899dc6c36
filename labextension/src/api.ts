/**
 * The server endpoints the front end uses: GET <baseUrl>jupyter-hpcdl/allocation
 * and POST <baseUrl>jupyter-hpcdl/notebooks.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** What a training session of the notebook is doing. */
export type SessionState =
  | 'none'
  | 'starting'
  | 'idle'
  | 'training'
  | 'stopped'
  | 'failed'
  | 'walltime' // stopped and checkpointed before the job's walltime ends
  | 'stale'; // reported as training, then silent (its kernel gone?)

/** One rank (one engine process) of the training world. */
export interface IRank {
  rank: number;
  node: string;
  gpu: string | null;
  /** The container mode it runs in ("userns": the fast path; "P1": proot), or null outside a container. */
  container: string | null;
  state: string;
  straggler: boolean;
  loss: number | null;
  samples_per_s: number | null;
}

/** One training session a kernel of the job reported. */
export interface ISession {
  id: string;
  session: SessionState;
  ranks: IRank[];
  /** What the session said last (e.g. where it checkpointed before the walltime), or null. */
  message: string | null;
}

/** How containers run on the job's first node (its kernels'), as the node's probe decided. */
export interface IContainerMode {
  /** "userns": the fast path (user namespaces, no ptrace); "P1": udocker's proot. */
  mode: string;
  /** Why this mode (the probe's answer, or the site's setting). */
  reason: string;
}

/** The server's answer outside a batch job. */
export interface INotInJob {
  in_job: false;
  message: string;
}

/** The server's answer inside a batch job. */
export interface IInJob {
  in_job: true;
  job_id: string;
  partition: string | null;
  nodes: string[];
  gpus_per_node: number | null;
  gres: string | null;
  /** The containers' mode on this node, or null before a first container start probed it. */
  containers: IContainerMode | null;
  /** Scheduler's own text, e.g. "3:58:12" or "UNLIMITED". */
  time_left: string | null;
  /** Seconds left, or null when unknown or unlimited. */
  time_left_s: number | null;
  ranks: IRank[];
  session: SessionState;
  /** What the session said last (e.g. where it checkpointed before the walltime), or null. */
  session_message: string | null;
  /** Every active session of the job, newest first (the fields above are the first one's). */
  sessions: ISession[];
}

export type Allocation = INotInJob | IInJob;

/** An error the panel shows as text. */
export class AllocationError extends Error {}

/**
 * Fetch the allocation. Rejects with an AllocationError whose message is fit
 * to show to the user.
 */
export async function fetchAllocation(
  settings: ServerConnection.ISettings
): Promise<Allocation> {
  const body = await requestJson(
    settings,
    'allocation',
    {},
    'Allocation endpoint'
  );
  if (!isObject(body) || typeof body.in_job !== 'boolean') {
    throw new AllocationError('Allocation endpoint: unexpected answer');
  }
  if (!body.in_job) {
    return {
      in_job: false,
      message: String(body.message ?? 'Not in a batch job.')
    };
  }
  const ranks = Array.isArray(body.ranks) ? body.ranks.map(toRank) : [];
  const session = toState(body.session);
  const sessionMessage = optString(body.message);
  let sessions: ISession[];
  if (Array.isArray(body.all_sessions)) {
    sessions = body.all_sessions.map(toSession);
  } else if (session !== 'none' || ranks.length > 0) {
    // an older server: only its most recently reported session
    sessions = [{ id: '', session, ranks, message: sessionMessage }];
  } else {
    sessions = [];
  }
  return {
    in_job: true,
    job_id: String(body.job_id ?? ''),
    partition: optString(body.partition),
    nodes: Array.isArray(body.nodes) ? body.nodes.map(String) : [],
    gpus_per_node: optNumber(body.gpus_per_node),
    gres: optString(body.gres),
    containers: toContainerMode(body.containers),
    time_left: optString(body.time_left),
    time_left_s: optNumber(body.time_left_s),
    ranks,
    session,
    session_message: sessionMessage,
    sessions
  };
}

/**
 * A request to the server endpoint `<baseUrl>jupyter-hpcdl/<path>`, and its
 * JSON body (undefined if there is none). Rejects with an AllocationError,
 * prefixed with `what`, when the server cannot be reached or answers with an
 * error: the server's message, else its status.
 */
async function requestJson(
  settings: ServerConnection.ISettings,
  path: string,
  init: RequestInit,
  what: string
): Promise<unknown> {
  const url = URLExt.join(settings.baseUrl, 'jupyter-hpcdl', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new AllocationError(
      `Cannot reach the server: ${(error as Error).message}`
    );
  }
  const text = await response.text();
  let body: unknown = undefined;
  try {
    body = text ? JSON.parse(text) : undefined;
  } catch {
    // not JSON (e.g. an HTML error page): reported below by status
  }
  if (!response.ok) {
    const message =
      isObject(body) && typeof body.message === 'string' && body.message
        ? body.message
        : `${response.status} ${response.statusText}`.trim();
    throw new AllocationError(`${what}: ${message}`);
  }
  return body;
}

function toState(raw: unknown): SessionState {
  return (optString(raw) ?? 'none') as SessionState;
}

function toSession(raw: unknown): ISession {
  const s = isObject(raw) ? raw : {};
  return {
    id: String(s.id ?? ''),
    session: toState(s.session),
    ranks: Array.isArray(s.ranks) ? s.ranks.map(toRank) : [],
    message: optString(s.message)
  };
}

function toRank(raw: unknown): IRank {
  const r = isObject(raw) ? raw : {};
  return {
    rank: Number(r.rank ?? -1),
    node: String(r.node ?? ''),
    gpu: optString(r.gpu),
    container: optString(r.container),
    state: String(r.state ?? ''),
    straggler: r.straggler === true,
    loss: optNumber(r.loss),
    samples_per_s: optNumber(r.samples_per_s)
  };
}

function toContainerMode(raw: unknown): IContainerMode | null {
  if (!isObject(raw) || typeof raw.mode !== 'string') {
    return null;
  }
  return { mode: raw.mode, reason: String(raw.reason ?? '') };
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function optString(value: unknown): string | null {
  return value === null || value === undefined ? null : String(value);
}

function optNumber(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

/** What POST <baseUrl>jupyter-hpcdl/notebooks did. */
export interface INotebooksCopy {
  /** The directory, relative to the server's root (the home). */
  directory: string;
  /** The first notebook's path, relative to the server's root. */
  first: string;
  copied: string[];
  /** Files already there that differ (the user's changes): never overwritten. */
  kept: string[];
  message: string;
}

/**
 * Copy the package's notebooks into the user's home (keeping what is there).
 * Rejects with an AllocationError whose message is fit to show.
 */
export async function copyNotebooks(
  settings: ServerConnection.ISettings
): Promise<INotebooksCopy> {
  const body = await requestJson(
    settings,
    'notebooks',
    { method: 'POST' },
    'Notebooks'
  );
  if (!isObject(body) || typeof body.first !== 'string') {
    throw new AllocationError('Notebooks: unexpected answer');
  }
  const names = (raw: unknown) => (Array.isArray(raw) ? raw.map(String) : []);
  return {
    directory: String(body.directory ?? ''),
    first: String(body.first),
    copied: names(body.copied),
    kept: names(body.kept),
    message: String(body.message ?? '')
  };
}
