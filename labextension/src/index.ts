/**
 * jupyter-hpcdl's JupyterLab front end: a sidebar panel with the batch job's
 * allocation and ranks, a status-bar item with the walltime left, a
 * command that opens the training dashboard in a new notebook, and one that
 * copies the tutorial notebooks into the home and opens the first.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { IStatusBar } from '@jupyterlab/statusbar';

import { copyNotebooks, fetchAllocation } from './api';
import { openDashboard } from './dashboard';
import { hpcIcon } from './icon';
import { AllocationModel } from './model';
import { AllocationPanel } from './panel';
import { AllocationStatus } from './statusbar';

const PANEL_ID = 'jupyter-hpcdl-panel';
const OPEN_DASHBOARD = 'jupyter-hpcdl:open-dashboard';
const GET_NOTEBOOKS = 'jupyter-hpcdl:get-notebooks';

const plugin: JupyterFrontEndPlugin<void> = {
  id: '@jupyter-hpcdl/labextension:plugin',
  description: 'HPC allocation panel, walltime in the status bar, training dashboard.',
  autoStart: true,
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, statusBar: IStatusBar | null) => {
    const settings = app.serviceManager.serverSettings;
    const model = new AllocationModel(() => fetchAllocation(settings));

    app.commands.addCommand(OPEN_DASHBOARD, {
      label: 'Open HPC Training Dashboard',
      caption: 'New notebook that shows the training dashboard',
      icon: hpcIcon,
      execute: () => openDashboard(app)
    });

    app.commands.addCommand(GET_NOTEBOOKS, {
      label: 'Get the jupyter-hpcdl Notebooks',
      caption:
        'Copy the tutorial notebooks into ~/hpcdl-notebooks (your changes are kept) and open the first',
      icon: hpcIcon,
      execute: async () => {
        const copy = await copyNotebooks(settings);
        await app.commands.execute('docmanager:open', { path: copy.first });
        return copy.message;
      }
    });

    const panel = new AllocationPanel(
      model,
      () => app.commands.execute(OPEN_DASHBOARD),
      () => app.commands.execute(GET_NOTEBOOKS) as Promise<string>
    );
    panel.id = PANEL_ID;
    panel.title.icon = hpcIcon;
    panel.title.caption = 'HPC allocation';
    app.shell.add(panel, 'left', { rank: 600 });

    if (statusBar) {
      statusBar.registerStatusItem('@jupyter-hpcdl/labextension:status', {
        item: new AllocationStatus(model),
        align: 'left',
        rank: 10,
        // hidden outside a batch job (and until the first answer)
        isActive: () => model.inJob,
        activeStateChanged: model.changed
      });
    }
  }
};

export default plugin;
