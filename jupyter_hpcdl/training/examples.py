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


def digits_loss():
    import tensorflow as tf
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
