"""The training workload the tests share: scikit-learn's digits and a small Keras model (functions that travel to
the ranks by value, or as source text into a kernel)."""


def digits_model():
    import tensorflow as tf
    return tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                                tf.keras.layers.Dense(10)])


def digits_shard(rank, size):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return (x[rank::size] / 16.0).astype("float32"), y[rank::size]
