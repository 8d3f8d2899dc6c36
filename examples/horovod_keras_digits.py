"""Digits with Keras and Horovod, written the way Horovod's own Keras examples are: for ``horovodrun``.

    horovodrun -np 2 python horovod_keras_digits.py --epochs 3

In a notebook, the same file runs unchanged on a TrainingSession's ranks:

    session.run_script("horovod_keras_digits.py", ["--epochs", "3"])
"""
import argparse

import horovod.tensorflow.keras as hvd
import tensorflow as tf
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.002, help="learning rate of one worker (scaled by the size)")
parser.add_argument("--history", help="rank 0 writes each epoch's loss and accuracy here (CSV)")
args = parser.parse_args()

hvd.init()
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")  # one each, or all

x, y = load_digits(return_X_y=True)
x, y = (x[hvd.rank()::hvd.size()] / 16.0).astype("float32"), y[hvd.rank()::hvd.size()]

model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(10)])
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(args.lr * hvd.size()))
model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
                    verbose=2 if hvd.rank() == 0 else 0)
if hvd.rank() == 0:
    if args.history:
        with open(args.history, "w") as f:
            f.write("epoch,loss,accuracy\n")
            for epoch, (loss, acc) in enumerate(zip(history.history["loss"], history.history["accuracy"])):
                f.write(f"{epoch},{loss},{acc}\n")
    print(f"final loss {history.history['loss'][-1]:.4f} accuracy {history.history['accuracy'][-1]:.3f}")
