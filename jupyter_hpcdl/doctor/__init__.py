"""``hpcdl-doctor``: what is wrong with a site, checked where it matters and said with what to do.

On the hub host it checks the configuration, the batch system's CLI and the hub's API; then it submits a small batch
job (``probe``) that checks, on a compute node: the hub's callback URL, shared home directories, udocker and its
engine tools offline, each image of the catalogue (present or pullable, starts, versions) and the job's GPUs. The
probe reports facts; ``assess`` turns them into findings (pure, tested on recorded facts); ``hubchecks`` are the
hub host's checks, ``nodejob`` the node job's submission and wait; ``cli`` runs it all.
"""
