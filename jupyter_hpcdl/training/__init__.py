"""Interactive distributed training: Horovod ranks as ipyparallel engines, driven from the notebook."""
from .session import FitResult, RankError, ScriptFailed, ScriptResult, TrainingSession, WorldDiverged  # noqa: F401
