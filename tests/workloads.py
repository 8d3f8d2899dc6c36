"""The training workload the tests share: scikit-learn's digits and a small Keras model (the package's example, so
that the ranks and a kernel import the same functions)."""
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard, digits_torch_model  # noqa: F401
