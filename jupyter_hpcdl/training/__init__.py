"""Interactive distributed training: Horovod ranks as ipyparallel engines, driven from the notebook
(:class:`TrainingSession`, its ranks' place in a new allocation: :class:`NewAllocation`), and batch runs that
outlive the notebook (:class:`BatchRun`)."""
from ..job.newjob import NewAllocation  # noqa: F401
from .batchrun import BatchRun, runs  # noqa: F401
from .placement import EnginesFailed  # noqa: F401
from .results import FitResult, RankError, ScriptFailed, ScriptResult, WorldDiverged  # noqa: F401
from .session import TrainingSession  # noqa: F401
