"""A loaded export against ``kiln.compile``: issue 22's "loaded program, the same speed".

    python benchmarks/exported_speed.py [--models tiny_gpt,small_cnn,gpt2_tiny,bert_tiny]
        [--device cpu] [--threads 1]

Per model (inference, float32, the suite's batch and first input set), two child processes:
the first builds the model, runs ``kiln.export`` on it and saves the program and its inputs to a
temporary folder; the second, a fresh process, times ``kiln.load`` plus its first call, then
the median step of eager, ``kiln.compile(model)`` and the loaded program on the same inputs,
interleaved (each runner after each other as often), and checks the loaded program's output
against eager's.

The children run with glibc's malloc thresholds pinned (``MALLOC_TUNABLES``). With its automatic
ones, in two processes of three (the thresholds alike in all: the heap's layout decides)
each eager step of bert_tiny grew the heap by 4 MB and the next ``free`` gave 8 MB back to the
OS, so the runner after eager faulted its buffers in again (~1,000 minor faults, 2 ms of a 5 ms
step) and eager paid as much itself; the order, rotated, put ``kiln.compile`` after eager twice
as often as the loaded program (bert_tiny: 7.4 ms against 5.1).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Fixed thresholds: glibc then neither trims the heap's top nor moves the mmap threshold, so
# the memory a runner frees stays mapped for the next one (no runner pays another's faults).
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824"


def child_env(folder: str) -> dict[str, str]:
    """The children's environment: their own cache directory, malloc's thresholds pinned."""
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), MALLOC_TUNABLES]))
    return dict(os.environ, KILN_CACHE_DIR=os.path.join(folder, "cache"), GLIBC_TUNABLES=tunables)


def balanced_order(keys: list[str], rounds: int) -> list[str]:
    """Three runners, each right after each of the others ``rounds`` times (a step still
    runs slower after eager's, whose traffic evicts its data from the caches):

    >>> balanced_order(["e", "c", "l"], 1)
    ['e', 'c', 'l', 'e', 'l', 'c']
    """
    assert len(keys) == 3
    return [*keys, keys[0], keys[2], keys[1]] * rounds


def save(name: str, device: str, folder: str) -> None:
    import torch

    import kiln
    from kiln.bench.worker import prepare

    model, inputs, _ = prepare(name, "infer", torch.device(device), torch.float32)
    # (a decoder's key-value cache is an object an exported program cannot return)
    kwargs = (
        {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    )
    with torch.no_grad():
        program = kiln.export(model.eval(), inputs, kwargs)
    program.save(os.path.join(folder, "program.kiln"))
    torch.save((inputs, kwargs), os.path.join(folder, "inputs.pt"))


def measure(name: str, device: str, folder: str) -> None:
    import torch

    import kiln
    from kiln.bench.worker import prepare
    from kiln.capture.guards import native_guards

    inputs, kwargs = torch.load(os.path.join(folder, "inputs.pt"))
    start = time.perf_counter()
    loaded = kiln.load(os.path.join(folder, "program.kiln"))
    with torch.no_grad():
        first = loaded(*inputs, **kwargs)
    load_s = time.perf_counter() - start
    model, _, _ = prepare(name, "infer", torch.device(device), torch.float32)
    model.eval()
    compiled = kiln.compile(model)
    runners = {"eager": model, "kiln.compile": compiled, "loaded": loaded}
    times: dict[str, list[float]] = {key: [] for key in runners}
    with torch.no_grad():
        expected = model(*inputs, **kwargs)
        for _ in range(3):  # warm-up (kiln.compile compiles here)
            for runner in runners.values():
                runner(*inputs, **kwargs)
        # (a background g++ build of the native guard checks would share the CPU with the timing)
        native_guards.wait(timeout=120)
        for key in balanced_order(list(runners), rounds=10):
            runner = runners[key]
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            runner(*inputs, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            times[key].append(time.perf_counter() - start)
    out = first[0] if isinstance(first, (tuple, list)) else first
    want = expected[0] if isinstance(expected, (tuple, list)) else expected
    want = getattr(want, "logits", want)
    out = getattr(out, "logits", out)
    error = float((out - want).abs().max() / want.abs().max())
    medians = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    print(json.dumps({"load_s": load_s, "ms": medians, "max_rel_err": error}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny_gpt,small_cnn,gpt2_tiny,bert_tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        step, name, folder = args.child
        return (save if step == "save" else measure)(name, args.device, folder)
    columns = ["eager ms", "kiln.compile ms", "loaded ms", "loaded / compiled"]
    columns += ["load + first call s", "max rel err"]
    print("| model | " + " | ".join(columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as folder:
            env = child_env(folder)
            base = [
                sys.executable,
                __file__,
                "--device",
                args.device,
                "--threads",
                str(args.threads),
            ]
            for step in ("save", "measure"):
                done = subprocess.run(
                    [*base, "--child", step, name, folder], env=env, capture_output=True, text=True
                )
                if done.returncode:
                    print(f"| {name} | {step} failed: {done.stderr.strip().splitlines()[-1]} |")
                    break
            else:
                report = json.loads(done.stdout.strip().splitlines()[-1])
                ms = report["ms"]
                cells = [ms["eager"], ms["kiln.compile"], ms["loaded"]]
                text = " | ".join(f"{value:.3f}" for value in cells)
                ratio = ms["loaded"] / ms["kiln.compile"]
                tail = f"{ratio:.2f} | {report['load_s']:.3f} | {report['max_rel_err']:.1e}"
                print(f"| {name} | {text} | {tail} |")


if __name__ == "__main__":
    main()
