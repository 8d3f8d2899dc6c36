/**
 * The left sidebar panel: the batch job's allocation and its ranks.
 */
import { Widget } from '@lumino/widgets';

import { IContainerMode, IInJob, IRank, ISession } from './api';
import { AllocationModel, timeLeftText } from './model';

/** Below this many seconds the walltime left is shown as a warning. */
const WARN_SECONDS = 15 * 60;

export class AllocationPanel extends Widget {
  constructor(
    private readonly _model: AllocationModel,
    onOpenDashboard: () => Promise<unknown>,
    onGetNotebooks: () => Promise<string>
  ) {
    super();
    this.addClass('jp-hpcdl-panel');

    const header = document.createElement('h2');
    header.className = 'jp-hpcdl-header';
    header.textContent = 'HPC allocation';

    this._body.className = 'jp-hpcdl-body';

    const button = document.createElement('button');
    button.className = 'jp-hpcdl-open-dashboard jp-mod-styled jp-mod-accept';
    button.textContent = 'Open dashboard';
    button.title = 'New notebook that shows the training dashboard';
    button.addEventListener('click', () => {
      button.disabled = true;
      this._actionError.hidden = true;
      onOpenDashboard()
        .catch(error => this._showActionError('Cannot open the dashboard', error))
        .finally(() => (button.disabled = false));
    });

    const notebooks = document.createElement('button');
    notebooks.className = 'jp-hpcdl-get-notebooks jp-mod-styled';
    notebooks.textContent = 'Get the notebooks';
    notebooks.title =
      'Copy the tutorial notebooks into ~/hpcdl-notebooks (your changes are kept) and open the first';
    notebooks.addEventListener('click', () => {
      notebooks.disabled = true;
      this._actionError.hidden = true;
      onGetNotebooks()
        .then(message => {
          this._actionNote.textContent = message;
          this._actionNote.hidden = false;
        })
        .catch(error => this._showActionError('Cannot get the notebooks', error))
        .finally(() => (notebooks.disabled = false));
    });
    this._actionNote.className = 'jp-hpcdl-note';
    this._actionNote.hidden = true;

    this._actionError.className = 'jp-hpcdl-error';
    this._actionError.hidden = true;

    const actions = document.createElement('div');
    actions.className = 'jp-hpcdl-actions';
    actions.append(button, notebooks, this._actionNote, this._actionError);

    this.node.append(header, this._body, actions);

    _model.changed.connect(this._render, this);
    _model.ticked.connect(this._tick, this);
    this._render();
  }

  dispose(): void {
    this._model.changed.disconnect(this._render, this);
    this._model.ticked.disconnect(this._tick, this);
    super.dispose();
  }

  private _render(): void {
    const state = this._model.state;
    this._body.replaceChildren();
    this._timeLeft = null;
    if (state.kind === 'loading') {
      this._body.append(para('jp-hpcdl-loading', 'Loading the allocation…'));
    } else if (state.kind === 'error') {
      this._body.append(para('jp-hpcdl-error', state.message));
    } else if (!state.allocation.in_job) {
      this._body.append(para('jp-hpcdl-not-in-job', state.allocation.message));
    } else {
      this._renderJob(state.allocation);
    }
  }

  private _renderJob(job: IInJob): void {
    const list = document.createElement('dl');
    list.className = 'jp-hpcdl-facts';
    const fact = (label: string, cls: string, value: string, title = '') =>
      addFact(list, label, cls, value, title);
    fact('Job', 'jp-hpcdl-job-id', job.job_id);
    fact('Partition', 'jp-hpcdl-partition', job.partition ?? '–');
    fact('Nodes', 'jp-hpcdl-nodes', job.nodes.join(', ') || '–');
    fact('GPUs', 'jp-hpcdl-gpus', gpusText(job), job.gres ? `gres ${job.gres}` : '');
    fact(
      'Containers',
      'jp-hpcdl-containers',
      containersText(job.containers),
      job.containers?.reason ?? ''
    );
    this._timeLeft = fact('Time left', 'jp-hpcdl-time-left', '');
    this._body.append(list);
    if (job.sessions.length === 0) {
      fact('Session', 'jp-hpcdl-session', 'none');
      this._body.append(this._ranksWrap([]));
    } else {
      const sessions = document.createElement('div');
      sessions.className = 'jp-hpcdl-sessions';
      sessions.append(...job.sessions.map(s => this._sessionBlock(s)));
      this._body.append(sessions);
    }
    this._tick();
  }

  /** One session: its state, what it said last, and its own ranks. */
  private _sessionBlock(session: ISession): HTMLDivElement {
    const block = document.createElement('div');
    block.className = 'jp-hpcdl-session-block';
    block.dataset.sessionId = session.id;
    const list = document.createElement('dl');
    list.className = 'jp-hpcdl-facts';
    addFact(list, 'Session', 'jp-hpcdl-session', session.session);
    if (session.id) {
      // as in the names of its walltime checkpoints
      addFact(list, 'Id', 'jp-hpcdl-session-id', session.id.slice(0, 12), session.id);
    }
    block.append(list);
    if (session.message) {
      block.append(para('jp-hpcdl-session-message', session.message));
    }
    block.append(this._ranksWrap(session.ranks));
    return block;
  }

  private _ranksWrap(ranks: IRank[]): HTMLDivElement {
    const wrap = document.createElement('div');
    wrap.className = 'jp-hpcdl-ranks-wrap'; // scrolls sideways in a narrow sidebar
    wrap.append(this._ranksTable(ranks));
    return wrap;
  }

  private _ranksTable(ranks: IRank[]): HTMLTableElement {
    const table = document.createElement('table');
    table.className = 'jp-hpcdl-ranks';
    const head = table.createTHead().insertRow();
    const columns: [string, string][] = [
      ['#', 'Rank'],
      ['Node', 'Node'],
      ['GPU', 'GPU'],
      ['Ctr', 'Container mode'],
      ['State', 'State'],
      ['⚠', 'Straggler'],
      ['Loss', 'Loss'],
      ['Samp/s', 'Samples per second']
    ];
    for (const [label, title] of columns) {
      const th = document.createElement('th');
      th.textContent = label;
      th.title = title;
      head.append(th);
    }
    const body = table.createTBody();
    if (ranks.length === 0) {
      const cell = body.insertRow().insertCell();
      cell.colSpan = columns.length;
      cell.className = 'jp-hpcdl-no-ranks';
      cell.textContent = 'No ranks running.';
    }
    for (const r of ranks) {
      const row = body.insertRow();
      row.dataset.rank = String(r.rank);
      row.dataset.straggler = String(r.straggler);
      row.classList.toggle('jp-mod-straggler', r.straggler);
      const cells = [
        String(r.rank),
        r.node,
        r.gpu ?? '–',
        r.container ?? '–',
        r.state,
        r.straggler ? '⚠' : '',
        r.loss === null ? '–' : String(Number(r.loss.toPrecision(3))),
        r.samples_per_s === null ? '–' : r.samples_per_s.toFixed(0)
      ];
      for (const text of cells) {
        row.insertCell().textContent = text;
      }
      if (r.straggler) {
        row.title = `Rank ${r.rank} is a straggler`;
      }
    }
    return table;
  }

  private _tick(): void {
    if (!this._timeLeft) {
      return;
    }
    this._timeLeft.textContent = timeLeftText(this._model);
    const left = this._model.secondsLeft();
    this._timeLeft.classList.toggle('jp-mod-warn', left !== null && left < WARN_SECONDS);
  }

  private _showActionError(what: string, error: unknown): void {
    this._actionError.textContent = `${what}: ${
      (error as Error)?.message || String(error)
    }`;
    this._actionError.hidden = false;
  }

  private readonly _body = document.createElement('div');
  private readonly _actionError = document.createElement('p');
  private readonly _actionNote = document.createElement('p');
  private _timeLeft: HTMLElement | null = null;
}

/** "2 × 2 = 4": GPUs per node × nodes. */
export function gpusText(job: IInJob): string {
  const per = job.gpus_per_node ?? 0;
  const n = job.nodes.length;
  if (per === 0) {
    return 'none';
  }
  return `${per} × ${n} = ${per * n}`;
}

/** "fast path (user namespaces)", "P1 (proot)", or "not started yet" before a first container start. */
export function containersText(containers: IContainerMode | null): string {
  if (!containers) {
    return 'not started yet';
  }
  if (containers.mode === 'userns') {
    return 'fast path (user namespaces)';
  }
  return containers.mode.startsWith('P') ? `${containers.mode} (proot)` : containers.mode;
}

/** A label and its value in a list of facts; returns the value's element. */
function addFact(
  list: HTMLDListElement,
  label: string,
  cls: string,
  value: string,
  title = ''
): HTMLElement {
  const dt = document.createElement('dt');
  dt.textContent = label;
  const dd = document.createElement('dd');
  dd.className = cls;
  dd.textContent = value;
  if (title) {
    dd.title = title;
  }
  list.append(dt, dd);
  return dd;
}

function para(cls: string, text: string): HTMLParagraphElement {
  const p = document.createElement('p');
  p.className = cls;
  p.textContent = text;
  return p;
}
