"""`ddpgpt prepare` against an llm.c-style baseline on a parquet corpus, at 1 core and at all.

    python -m benchmarks.bench_prepare [--mb 200] [--work bench/prepare] [--json FILE]

The corpus (made once, kept in --work): documents of 10 to 300 lines cut from the Python standard
library's files at random (seeded), written as 4 parquet files of row groups of 1,000 rows, about
--mb MB of text. Each case runs as its own process tree pinned to k cores (sched_setaffinity):

- ddpgpt: `ddpgpt prepare CORPUS --tokenizer gpt2 --workers k` (reading, encoding, the shards);
- baseline: what llm.c's fineweb.py does: tiktoken's `encode_ordinary` for each document (EOT
  first) in `multiprocessing.Pool(k).imap(..., chunksize=16)`, uint16 arrays written to one file;
- bpe: `ddpgpt prepare --tokenizer bpe` (trained on its first --bpe-train-mb, training
  included), all cores, on a quarter of the corpus (1 file);
- memory: ddpgpt gpt2 at all cores on a quarter of the corpus (1 file) and on all of it (4x).

It reports tokens/s, tokens/s per core and the peak resident memory of the whole process tree
(summed over processes, sampled every 50 ms); with --repeats R each gpt2 case runs R times,
alternating with the baseline, and the fastest run of each counts (for a shared machine). Both
tools must produce the same number of tokens (the same documents, the same tokenizer): the
benchmark checks it. GPT-2's tokenizer files come
from ../shared/data/tiktoken-gpt2 when TIKTOKEN_CACHE_DIR is unset; without them it says so and
stops.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TIKTOKEN_GPT2 = REPO.parent / "shared" / "data" / "tiktoken-gpt2"
ROW_GROUP_ROWS = 1000
FILES = 4


def make_corpus(root: Path, mb: int) -> list[Path]:
    """4 parquet files of about `mb` MB of text in all (made once; kept by its size)."""
    import sysconfig

    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [root / f"part_{i}.parquet" for i in range(FILES)]
    stamp = root / f"made-{mb}mb"
    if stamp.is_file() and all(f.is_file() for f in files):
        return files
    root.mkdir(parents=True, exist_ok=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_text(errors="replace").splitlines(keepends=True)
               for p in sorted(lib.rglob("*.py")) if "site-packages" not in p.parts]
    sources = [s for s in sources if len(s) >= 10]
    rng = np.random.default_rng(0)
    per_file = (mb << 20) // FILES
    for path in files:
        docs, size = [], 0
        while size < per_file:
            lines = sources[rng.integers(len(sources))]
            n = int(rng.integers(10, 301))
            start = int(rng.integers(0, max(1, len(lines) - n)))
            doc = "".join(lines[start:start + n])
            docs.append(doc)
            size += len(doc.encode())
        pq.write_table(pa.table({"text": docs}), path, row_group_size=ROW_GROUP_ROWS)
    stamp.write_text("")
    return files


# --- the baseline, as llm.c's fineweb.py does it ----------------------------------------------

_enc = None


def _tokenize(doc: str) -> np.ndarray:
    tokens = [_enc.eot_token, *_enc.encode_ordinary(doc)]
    return np.array(tokens, dtype=np.uint16)


def _init() -> None:
    global _enc
    import tiktoken
    _enc = tiktoken.get_encoding("gpt2")


def _documents(files: list[str]):
    import pyarrow.parquet as pq
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
            yield from batch.column(0).to_pylist()


def baseline(files: list[str], cores: int, out: str) -> None:
    import multiprocessing
    count = 0
    with multiprocessing.Pool(cores, initializer=_init) as pool, open(out, "wb") as f:
        for tokens in pool.imap(_tokenize, _documents(files), chunksize=16):
            f.write(tokens.tobytes())
            count += len(tokens)
    print(json.dumps({"tokens": count}))


# --- measuring a process tree --------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def measure(argv: list[str], cores: list[int], env: dict) -> tuple[float, float, int, str]:
    """Runs argv pinned to `cores`; returns (seconds, CPU seconds of its tree, peak RSS of its
    tree in bytes, stdout). The CPU seconds are those of every process of the tree that was
    waited for (both tools join their workers): on a shared machine, where other work takes
    turns on the same cores, they measure the work itself."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    peak = 0
    while proc.poll() is None:
        peak = max(peak, sum(_rss(p) for p in _tree(proc.pid)))
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"bench_prepare: {' '.join(argv[:6])} ... failed:\n{err}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu, peak, out


def _prepare_tokens(out: Path) -> int:
    meta = json.loads((out / "meta.json").read_text())
    return sum(s["tokens"] for split in meta["shards"].values() for s in split)


def run_cases(a, files: list[Path], env: dict) -> list[dict]:
    work, allowed = Path(a.work), sorted(os.sched_getaffinity(0))
    py, rows = sys.executable, []
    names = [str(f) for f in files]

    def ours(label, k, sources, tokenizer="gpt2", extra=()):
        out = work / f"out-{label}"
        argv = [py, "-m", "ddpgpt", "prepare", *sources, "--tokenizer", tokenizer,
                "--workers", str(k), "--out", str(out), "--force", *extra]
        seconds, cpu, peak, _ = measure(argv, allowed[:k], env)
        rows.append({"case": label, "cores": k, "seconds": seconds, "cpu_s": cpu,
                     "peak_rss": peak, "tokens": _prepare_tokens(out)})
        shutil.rmtree(out)  # only the corpus is kept between runs

    def base(k):
        argv = [py, "-m", "benchmarks.bench_prepare", "--baseline", str(k), "--out",
                str(work / "baseline.bin"), *names]
        seconds, cpu, peak, out = measure(argv, allowed[:k], env)
        rows.append({"case": "baseline gpt2", "cores": k, "seconds": seconds, "cpu_s": cpu,
                     "peak_rss": peak, "tokens": json.loads(out)["tokens"]})
        (work / "baseline.bin").unlink()

    for k in sorted({1, len(allowed)}):
        for _ in range(a.repeats):  # alternated: a busy moment of the machine hits both
            base(k)
            ours(f"ddpgpt gpt2 {k}", k, names)
    ours("ddpgpt bpe 1/4 corpus", len(allowed), names[:1], "bpe",
         ["--bpe-train-mb", str(a.bpe_train_mb)])
    ours("ddpgpt gpt2 1/4 corpus", len(allowed), names[:1])
    return rows


def best(rows: list[dict]) -> list[dict]:
    """One row per case and core count: the fastest of its repeats."""
    out: dict = {}
    for r in rows:
        key = (r["case"], r["cores"])
        if key not in out or r["seconds"] < out[key]["seconds"]:
            out[key] = r
    return list(out.values())


def report(rows: list[dict]) -> None:
    print(f"{'case':<24} {'cores':>5} {'seconds':>8} {'Mtok/s':>7} {'per core':>8} "
          f"{'CPU s':>6} {'Mtok/CPU s':>10} {'peak RSS MB':>11}")
    for r in rows:
        rate = r["tokens"] / r["seconds"] / 1e6
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        label = "ddpgpt gpt2" if r["case"] == f"ddpgpt gpt2 {r['cores']}" else r["case"]
        print(f"{label:<24} {r['cores']:>5} {r['seconds']:>8.1f} {rate:>7.2f} "
              f"{rate / r['cores']:>8.2f} {r['cpu_s']:>6.1f} "
              f"{r['tokens'] / r['cpu_s'] / 1e6:>10.2f} {r['peak_rss'] / 1e6:>11.0f}")
    for k in sorted({r["cores"] for r in rows if r["case"] == "baseline gpt2"}):
        b = next(r for r in rows if r["case"] == "baseline gpt2" and r["cores"] == k)
        o = next(r for r in rows if r["case"] == f"ddpgpt gpt2 {k}")
        if o["tokens"] != b["tokens"]:
            raise SystemExit(f"bench_prepare: token counts differ at {k} cores: ddpgpt "
                             f"{o['tokens']:,}, baseline {b['tokens']:,}")
        print(f"ddpgpt / baseline at {k} core{'s' if k > 1 else ''}: "
              f"{b['seconds'] / o['seconds']:.2f}x in time, {b['cpu_s'] / o['cpu_s']:.2f}x in CPU "
              f"({o['tokens']:,} tokens each)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=200, help="corpus size in MB of text")
    p.add_argument("--work", default="bench/prepare", help="corpus and outputs go here")
    p.add_argument("--bpe-train-mb", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each gpt2 case, alternating with the baseline; the best counts")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--baseline", type=int, help=argparse.SUPPRESS)  # the baseline's process
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.baseline:
        return baseline(a.files, a.baseline, a.out)
    env = dict(os.environ)
    if "TIKTOKEN_CACHE_DIR" not in env and TIKTOKEN_GPT2.is_dir():
        env["TIKTOKEN_CACHE_DIR"] = str(TIKTOKEN_GPT2)
    os.environ.update(env)
    try:
        _init()
    except Exception as e:
        print(f"bench_prepare: skipped: tiktoken cannot load gpt2 ({type(e).__name__}); set "
              f"TIKTOKEN_CACHE_DIR to its files (see {TIKTOKEN_GPT2})")
        return
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    files = make_corpus(Path(a.work) / "corpus", a.mb)
    size = sum(f.stat().st_size for f in files)
    print(f"corpus: {len(files)} parquet files, {size / 1e6:.0f} MB on disk "
          f"({a.mb} MB of text); {len(os.sched_getaffinity(0))} cores")
    rows = best(run_cases(a, files, env))
    report(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
