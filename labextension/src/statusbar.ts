/**
 * The status-bar item: "Job 42 · 3:58:12 left"; hidden outside a batch job.
 */
import { Widget } from '@lumino/widgets';

import { AllocationModel, timeLeftText } from './model';

export class AllocationStatus extends Widget {
  constructor(private readonly _model: AllocationModel) {
    super({ node: document.createElement('span') });
    this.addClass('jp-hpcdl-statusbar');
    this.addClass('jp-StatusBar-TextItem');
    this.node.title = 'HPC batch job: walltime left';
    _model.changed.connect(this._update, this);
    _model.ticked.connect(this._update, this);
    this._update();
  }

  dispose(): void {
    this._model.changed.disconnect(this._update, this);
    this._model.ticked.disconnect(this._update, this);
    super.dispose();
  }

  private _update(): void {
    const s = this._model.state;
    if (s.kind !== 'ok' || !s.allocation.in_job) {
      this.node.textContent = ''; // the status bar hides the item (isActive)
      return;
    }
    const known = this._model.secondsLeft() !== null;
    const time = timeLeftText(this._model);
    this.node.textContent = `Job ${s.allocation.job_id} · ${known ? `${time} left` : time}`;
  }
}
