"""The Keras side of the digits example (:mod:`jupyter_hpcdl.training.examples`): the model and the loss."""


def digits_model():
    import tensorflow as tf
    return tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                                tf.keras.layers.Dense(10)])


def digits_loss(y_true, y_pred):
    """Cross-entropy on the model's logits; a plain function, so the kernel need not import TensorFlow."""
    import tensorflow as tf
    return tf.keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
