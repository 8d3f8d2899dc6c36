import { LabIcon } from '@jupyterlab/ui-components';

/** A small rack of three nodes. */
const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M4 3h16a1 1 0 0 1 1 1v4a1 1 0 0 1-1 1H4a1 1 0 0 1-1-1V4a1 1 0 0 1 1-1zm2 2.5v1h2v-1zm4 0v1h2v-1z"/>
    <path d="M4 10h16a1 1 0 0 1 1 1v2a1 1 0 0 1-1 1H4a1 1 0 0 1-1-1v-2a1 1 0 0 1 1-1zm2 1.5v1h2v-1zm4 0v1h2v-1z"/>
    <path d="M4 15h16a1 1 0 0 1 1 1v4a1 1 0 0 1-1 1H4a1 1 0 0 1-1-1v-4a1 1 0 0 1 1-1zm2 2.5v1h2v-1zm4 0v1h2v-1z"/>
  </g>
</svg>`;

export const hpcIcon = new LabIcon({ name: 'jupyter-hpcdl:allocation', svgstr: svg });
