"""The batch-system adapters (used by the hub side and the job's side alike): one traitlets ``Configurable`` per
scheduler, each a set of pure argv builders and output parsers, registered under the entry point group
``jupyter_hpcdl.schedulers``. ``scheduler`` is the interface; ``slurm``, ``gridengine``, ``pbs`` and ``lsf`` are the
adapters."""
