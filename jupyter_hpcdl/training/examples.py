"""A small real problem that ships with a package (scikit-learn's digits) for demos, workshops and tests: a Keras
model, each rank's shard, and the loss. Nothing is downloaded."""


def digits_model():
    import tensorflow as tf
    return tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                                tf.keras.layers.Dense(10)])


def digits_shard(rank, size):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return (x[rank::size] / 16.0).astype("float32"), y[rank::size]


def digits_loss(y_true, y_pred):
    """Cross-entropy on the model's logits; a plain function, so the kernel need not import TensorFlow."""
    import tensorflow as tf
    return tf.keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
