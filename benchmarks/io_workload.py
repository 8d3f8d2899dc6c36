"""Small-file I/O as data loading and checkpoints do it: write N small files, read them back, then write one
checkpoint-sized file with fsync; prints one JSON line with the seconds of each. Used by container_overhead.py,
natively and in the container, on the same directory."""
import argparse
import json
import os
import shutil
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--checkpoint-mb", type=int, default=64)
    args = p.parse_args()
    root = os.path.join(args.directory, f"io-{os.getpid()}")
    os.makedirs(root)
    blob = os.urandom(args.size)
    try:
        t0 = time.perf_counter()
        for i in range(args.files):
            with open(os.path.join(root, f"sample-{i:06d}.bin"), "wb") as f:
                f.write(blob)
        t1 = time.perf_counter()
        total = 0
        for name in sorted(os.listdir(root)):
            with open(os.path.join(root, name), "rb") as f:
                total += len(f.read())
        t2 = time.perf_counter()
        with open(os.path.join(root, "checkpoint.bin"), "wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(args.checkpoint_mb):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        t3 = time.perf_counter()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"write_files_s": t1 - t0, "read_files_s": t2 - t1, "checkpoint_s": t3 - t2,
                      "read_bytes": total}), flush=True)


if __name__ == "__main__":
    main()
