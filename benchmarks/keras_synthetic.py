"""Horovod's synthetic benchmark for Keras: a ``tf.keras.applications`` model (``weights=None``) trained on random
inputs, images/s over all ranks after a warm-up. Written for horovodrun, as Horovod's own examples are; it runs
unchanged under ``TrainingSession.run_script`` (see benchmarks/training_user_model.py).

    horovodrun -np 2 python benchmarks/keras_synthetic.py --model MobileNetV2 --batch-size 16 --image-size 64
"""
import argparse
import json
import time

import horovod.tensorflow.keras as hvd
import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", default="MobileNetV2")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--warmup-batches", type=int, default=5)
parser.add_argument("--batches", type=int, default=30)
args = parser.parse_args()

hvd.init()
model = getattr(tf.keras.applications, args.model)(weights=None, input_shape=(args.image_size, args.image_size, 3),
                                                   classes=1000)
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size())),
              loss=tf.keras.losses.SparseCategoricalCrossentropy())
images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
labels = tf.random.uniform([args.batch_size], maxval=1000, dtype=tf.int64)
data = tf.data.Dataset.from_tensors((images, labels)).repeat()


class Timer(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == args.warmup_batches - 1:
            self.t0 = time.perf_counter()
        self.t1 = time.perf_counter()


timer = Timer()
model.fit(data, steps_per_epoch=args.warmup_batches + args.batches, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
if hvd.rank() == 0:
    images_per_s = args.batches * args.batch_size * hvd.size() / (timer.t1 - timer.t0)
    print(json.dumps({"images_per_s": images_per_s, "ranks": hvd.size(), "model": args.model}), flush=True)
