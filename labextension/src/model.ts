/**
 * Keeps the allocation fresh: fetches it every `refreshMs`, and ticks every
 * second so that views can count the walltime down between fetches.
 */
import { ISignal, Signal } from '@lumino/signaling';

import { Allocation } from './api';

export type AllocationState =
  | { kind: 'loading' }
  | { kind: 'error'; message: string }
  | { kind: 'ok'; allocation: Allocation; fetchedAt: number };

export class AllocationModel {
  constructor(
    private readonly _fetch: () => Promise<Allocation>,
    refreshMs = 10000,
    tickMs = 1000
  ) {
    this._refreshTimer = window.setInterval(() => void this.refresh(), refreshMs);
    this._tickTimer = window.setInterval(() => this._ticked.emit(), tickMs);
    void this.refresh();
  }

  /** Emitted after each fetch (success or failure). */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Emitted every second. */
  get ticked(): ISignal<this, void> {
    return this._ticked;
  }

  get state(): AllocationState {
    return this._state;
  }

  /** True while the last successful answer said we are in a batch job. */
  get inJob(): boolean {
    return this._state.kind === 'ok' && this._state.allocation.in_job;
  }

  /** Seconds of walltime left now, counted down since the last fetch; null if unknown. */
  secondsLeft(now: number = Date.now()): number | null {
    const s = this._state;
    if (s.kind !== 'ok' || !s.allocation.in_job) {
      return null;
    }
    const left = s.allocation.time_left_s;
    if (left === null) {
      return null;
    }
    return Math.max(0, left - Math.floor((now - s.fetchedAt) / 1000));
  }

  /** Fetch now; concurrent calls share one request. */
  refresh(): Promise<void> {
    if (!this._pending) {
      this._pending = this._fetch()
        .then(
          allocation => {
            this._state = { kind: 'ok', allocation, fetchedAt: Date.now() };
          },
          error => {
            this._state = {
              kind: 'error',
              message: (error as Error)?.message || String(error)
            };
          }
        )
        .then(() => {
          this._pending = null;
          if (!this._disposed) {
            this._changed.emit();
          }
        });
    }
    return this._pending;
  }

  dispose(): void {
    this._disposed = true;
    window.clearInterval(this._refreshTimer);
    window.clearInterval(this._tickTimer);
    Signal.clearData(this);
  }

  private _state: AllocationState = { kind: 'loading' };
  private _pending: Promise<void> | null = null;
  private _disposed = false;
  private readonly _refreshTimer: number;
  private readonly _tickTimer: number;
  private readonly _changed = new Signal<this, void>(this);
  private readonly _ticked = new Signal<this, void>(this);
}

/** 14292 -> "3:58:12"; 1 day and more -> "1-02:03:04" (Slurm's style). */
export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  const days = Math.floor(s / 86400);
  const h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60);
  const sec = s % 60;
  const mmss = `${pad(m)}:${pad(sec)}`;
  return days > 0 ? `${days}-${pad(h)}:${mmss}` : `${h}:${mmss}`;
}

/** The walltime left as text: counting down if known, else the scheduler's word. */
export function timeLeftText(model: AllocationModel, now?: number): string {
  const left = model.secondsLeft(now);
  if (left !== null) {
    return formatDuration(left);
  }
  const s = model.state;
  if (s.kind === 'ok' && s.allocation.in_job && s.allocation.time_left) {
    return s.allocation.time_left;
  }
  return 'unknown';
}

function pad(n: number): string {
  return n < 10 ? `0${n}` : String(n);
}
