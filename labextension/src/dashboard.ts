/**
 * "Open dashboard": a new notebook on the default kernel whose first cell
 * shows the training dashboard, run at once.
 */
import { JupyterFrontEnd } from '@jupyterlab/application';
import { NotebookActions, NotebookPanel } from '@jupyterlab/notebook';

export const DASHBOARD_CODE =
  'from jupyter_hpcdl.dashboard import Dashboard\nDashboard()';

export async function openDashboard(app: JupyterFrontEnd): Promise<NotebookPanel> {
  const specs = app.serviceManager.kernelspecs;
  await specs.ready;
  const kernelName = specs.specs?.default;
  // With no kernel name, JupyterLab would ask which kernel to start.
  const panel = (await app.commands.execute('notebook:create-new', {
    ...(kernelName ? { kernelName } : {})
  })) as NotebookPanel;
  await panel.context.ready;
  await panel.sessionContext.ready;

  const shared = panel.content.model!.sharedModel;
  const first = shared.cells[0];
  if (first && first.cell_type === 'code' && first.getSource() === '') {
    first.setSource(DASHBOARD_CODE);
  } else {
    shared.insertCell(0, { cell_type: 'code', source: DASHBOARD_CODE });
  }
  panel.content.activeCellIndex = 0;
  await NotebookActions.run(panel.content, panel.sessionContext);
  return panel;
}
