"""A small real problem that ships with a package (scikit-learn's digits) for demos, workshops and tests: a Keras
model, each rank's shard, and the loss. Nothing is downloaded. The model and the loss are the Horovod backend's
(Keras); the shard is any backend's."""
from ..backends.horovod.examples import digits_loss, digits_model

__all__ = ["digits_loss", "digits_model", "digits_shard"]


def digits_shard(rank, size):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return (x[rank::size] / 16.0).astype("float32"), y[rank::size]
