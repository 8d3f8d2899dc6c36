"""The job's side: what runs in a batch job, on its hosts, outside the user's container.

- ``server``: the job's main process; starts the user's JupyterLab (subreaper of its tree) and reports to the hub
- ``subreaper``: keeps every orphan of the server's tree in the job, and ends them with it
- ``allocation``: the allocation's owner inside that server: the job's hosts and walltime, engine tasks, jobs it
  submits for kernels (a Unix socket only the user can reach); ``ownerapi`` its routes, ``serverext`` its face for
  JupyterLab, ``owner`` what kernels share with it (its socket, its client, the engines' command line)
- ``client``: the batch commands of a kernel in its container, answered by the owner
- ``tasks``: one task per rank over the job (``python -m jupyter_hpcdl.job.tasks``)
- ``launch``: ``hpcdl-launch``, Horovod ranks in containers over the job (batch runs)
- ``newjob``: the scripts of new jobs a kernel asks for (pure)
- ``world``: each rank's Horovod slot and the environment that joins it (pure)

The batch system itself is an adapter (:mod:`jupyter_hpcdl.batchsystems`); nothing here names its commands."""
