"""What CORE costs: seconds per example of each of its 22 tasks, and at training's cap.

    python -m benchmarks.bench_core --bundle eval_bundle              # the real bundle
    python -m benchmarks.bench_core --presets tiny small --limit 20   # a stand-in (no network)

Each preset's model (freshly initialized: the cost does not depend on what it learned) with
GPT-2's tokens (tiktoken, 50,304 rows: a run on English text prepared with --tokenizer gpt2)
scores each task of the bundle alone, one process, fp32 on the CPU: the first `--limit` examples
after nanochat's shuffle and the cap (their shots drawn from the capped examples, as in
training). Per task it prints the rows per example (choices), the tokens a row takes (after the
block cut it), the seconds per example, and the seconds the task takes at run.eval_core_limit's
500 (its examples times one example's cost, at most 500 of them), each as wall time and as this
process's CPU time (all its threads: the figure a busy machine inflates less); and the seconds
to tokenize the bundle at that cap (once per training, when the scorer is built).

Without `--bundle` it writes a stand-in into --work: the real CORE's 22 tasks, each with its
type, shots, delimiter, choices and size as DCLM's core.yaml and eval_meta_data.csv give them,
and its text of random words of a length estimated for that task (STANDIN): not the real
prompts, so its figures are the cost of prompts of that length. Where a prompt is longer than
the block (most few-shot prompts at the tiny and small presets) the row is the block whatever
the text, so those tasks cost what the real ones do.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import time
from pathlib import Path

import torch

from ddpgpt.config.presets import get_preset
from ddpgpt.data.tokenizer import GPT2Tokenizer
from ddpgpt.distributed.group import DistEnv
from ddpgpt.evals import bundle, core
from ddpgpt.evals.tasks import Task
from ddpgpt.model.gpt import GPT
from ddpgpt.run.precision import flush_denormals

CAP = 500  # run.eval_core_limit's default, nanochat's
# label, type, shots, delimiter, choices, examples (DCLM's core.yaml and eval_meta_data.csv);
# words of the context and of each answer: estimates of ours for the stand-in
A = "\nAnswer: "
STANDIN = [
    ("hellaswag_zeroshot", "multiple_choice", 0, " ", 4, 10042, 40, 20),
    ("jeopardy", "language_modeling", 10, A, 1, 2117, 25, 2),
    ("bigbench_qa_wikidata", "language_modeling", 10, " ", 1, 20321, 10, 2),
    ("arc_easy", "multiple_choice", 10, A, 4, 2376, 25, 4),
    ("arc_challenge", "multiple_choice", 10, A, 4, 2376, 30, 5),
    ("copa", "multiple_choice", 0, " ", 2, 100, 10, 8),
    ("commonsense_qa", "multiple_choice", 10, " ", 5, 1221, 15, 2),
    ("piqa", "multiple_choice", 10, A, 2, 1838, 10, 20),
    ("openbook_qa", "multiple_choice", 0, " ", 4, 500, 15, 4),
    ("lambada_openai", "language_modeling", 0, " ", 1, 5153, 75, 1),
    ("hellaswag", "multiple_choice", 10, " ", 4, 10042, 40, 20),
    ("winograd", "schema", 0, " ", 2, 273, 12, 6),
    ("winogrande", "schema", 0, " ", 2, 1267, 18, 6),
    ("bigbench_dyck_languages", "language_modeling", 10, " ", 1, 1000, 30, 4),
    ("agi_eval_lsat_ar", "multiple_choice", 3, " ", 5, 230, 250, 15),
    ("bigbench_cs_algorithms", "language_modeling", 10, " ", 1, 1320, 30, 1),
    ("bigbench_operators", "language_modeling", 10, " ", 1, 210, 25, 1),
    ("bigbench_repeat_copy_logic", "language_modeling", 10, " ", 1, 32, 20, 15),
    ("squad", "language_modeling", 10, " ", 1, 10570, 150, 3),
    ("coqa", "language_modeling", 0, " ", 1, 7983, 300, 3),
    ("boolq", "multiple_choice", 10, A, 2, 3270, 110, 1),
    ("bigbench_language_identification", "multiple_choice", 10, " ", 11, 10000, 25, 1),
]
WORDS = ("time people year way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money").split()


def standin(out: Path) -> Path:
    """The stand-in bundle: as many examples of each task as the cap scores (at most 500)."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize()

    def apart(texts: list[str]) -> list[str]:
        """Each choice its own text (bundle.read refuses a gold one alike to another): one
        alike to an earlier one gets a word more, the draws left as they were."""
        out = []
        for k, t in enumerate(texts):
            while t in out:
                t += f" {WORDS[k]}"
            out.append(t)
        return out

    tasks = []
    for label, kind, shots, delim, choices, size, context, answer in STANDIN:
        rows = []
        for _ in range(min(size, CAP)):
            if kind == "multiple_choice":
                rows.append({"query": text(context), "gold": 0,
                             "choices": apart([text(answer) for _ in range(choices)])})
            elif kind == "schema":
                rows.append({"context_options": apart([text(context)
                                                       for _ in range(choices)]),
                             "continuation": text(answer), "gold": 0})
            else:
                rows.append({"context": text(context), "continuation": text(answer)})
        (out / "eval_data").mkdir(parents=True, exist_ok=True)
        (out / "eval_data" / f"{label}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
        tasks.append(f"- label: {label}\n  dataset_uri: {label}.jsonl\n  num_fewshot: [{shots}]\n"
                     f"  icl_task_type: {kind}\n  continuation_delimiter: {json.dumps(delim)}\n")
    (out / "core.yaml").write_text("icl_tasks:\n" + "".join(tasks))
    with open(out / "eval_meta_data.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Random baseline"])
        writer.writerows([(t[0], 0) for t in STANDIN])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", help="an eval bundle directory (default: the stand-in)")
    parser.add_argument("--work", default="bench/core", help="where the stand-in is written")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--limit", type=int, default=20, help="examples timed per task")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flush_denormals()
    path = Path(args.bundle) if args.bundle else standin(Path(args.work))
    tok = GPT2Tokenizer()
    start = time.perf_counter()
    capped = bundle.read(path, CAP)
    read_s = time.perf_counter() - start
    for preset in args.presets:
        cfg = get_preset(preset).model
        cfg.vocab_size = 50304
        model = GPT(cfg).eval()
        start = time.perf_counter()
        core.CoreScorer(Task("core", str(path), capped, "core"), tok, cfg.block_size, DistEnv())
        render_s = time.perf_counter() - start
        print(f"\n{preset}: {cfg.n_layer} layers x {cfg.n_embd}, block {cfg.block_size}, vocab "
              f"{cfg.vocab_size}; {torch.get_num_threads()} threads, torch {torch.__version__}; "
              f"{args.limit} examples a task timed; the bundle read in {read_s:.1f} s and "
              f"tokenized at the cap of {CAP} in {render_s:.1f} s")
        print("| task | type | shots | rows | tokens/row | s/example | CPU s/example | examples "
              "at the cap | s at the cap | CPU s at the cap |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        total = total_cpu = 0.0
        warm = core.render(capped[0], [0], tok, cfg.block_size)[0]
        core.correct(model, warm, cfg.block_size, torch.device("cpu"))  # first-call costs
        for part in capped:  # its first examples, their shots drawn as at the cap
            n = min(len(part.examples), args.limit)
            rendered = core.render(part, range(n), tok, cfg.block_size)
            rows = [min(len(h) + len(t), cfg.block_size) for r in rendered
                    for h, t in zip(r.heads, r.tails)]
            start, cpu = time.perf_counter(), time.process_time()
            for r in rendered:
                core.correct(model, r, cfg.block_size, torch.device("cpu"))
            each = (time.perf_counter() - start) / n
            each_cpu = (time.process_time() - cpu) / n
            at_cap = len(part.examples)
            total += each * at_cap
            total_cpu += each_cpu * at_cap
            print(f"| {part.label} | {part.type} | {part.shots} | {len(rows) / n:.0f} | "
                  f"{sum(rows) / len(rows):.0f} | {each:.3f} | {each_cpu:.3f} | {at_cap} | "
                  f"{each * at_cap:.0f} | {each_cpu * at_cap:.0f} |")
        print(f"| all {len(capped)} | | | | | | | {sum(len(p.examples) for p in capped)} | "
              f"{total:.0f} ({total / 60:.0f} min) | {total_cpu:.0f} ({total_cpu / 60:.0f} min) |")


if __name__ == "__main__":
    main()
