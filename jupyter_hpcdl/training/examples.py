"""A small real problem that ships with a package (scikit-learn's digits) for demos, workshops and tests: a Keras
model and its loss (the Horovod backend's), a PyTorch module with its optimizer and scheduler (the torch backend's),
and each rank's shard (any backend's). Nothing is downloaded."""
from ..backends.horovod.examples import digits_loss, digits_model
from ..backends.pytorch.examples import digits_torch_model

__all__ = ["digits_loss", "digits_model", "digits_shard", "digits_torch_model"]


def digits_shard(rank, size):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return (x[rank::size] / 16.0).astype("float32"), y[rank::size]
