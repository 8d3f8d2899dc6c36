"""A small Keras CNN (or a tf.keras.applications model) trained on synthetic images; prints one JSON line with images/s after warm-up.
Used by container_overhead.py, natively and inside the container, with the same arguments."""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="cnn", help="cnn, or a tf.keras.applications model (weights=None), e.g. "
                   "MobileNetV2, ResNet50")
    p.add_argument("--image-size", type=int, default=32)
    args = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    rng = np.random.default_rng(0)
    size = args.image_size
    x = rng.random((args.steps * args.batch, size, size, 3), dtype=np.float32)
    y = rng.integers(0, 10, args.steps * args.batch)
    if args.model != "cnn":
        model = getattr(tf.keras.applications, args.model)(weights=None, input_shape=(size, size, 3), classes=10)
        model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy())
        return measure(model, x, y, args)
    model = tf.keras.Sequential([
        tf.keras.layers.Input((32, 32, 3)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    measure(model, x, y, args)


def measure(model, x, y, args) -> None:
    model.fit(x[: args.batch * 5], y[: args.batch * 5], batch_size=args.batch, epochs=1, verbose=0)  # trace, warm up
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"images_per_s": args.steps * args.batch / elapsed, "seconds": elapsed}), flush=True)


if __name__ == "__main__":
    main()
