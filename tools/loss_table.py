"""
The validation loss of every run in a folder at one step that all of them evaluated (the last such),
beside the paper's test loss at 128M for the same variant: tools/bench_gpu.sh's loss table.

    python -m tools.loss_table out/gpu/figures --tokens_per_step=32768

Reads each */log.jsonl (train.py's), prints a markdown table and writes it to loss_table.md and
its numbers to loss_table.json in the folder. Runs are named as bench_gpu.sh names them (mha,
lrkv-r16, lrkv-r64, mqa, mla, gqa: LRKV by the paper's ranks of d_h = 128); a run of another name
has no paper column. One run per variant: one seed, whatever the differences say.
"""

import json
import sys
from pathlib import Path

from lib.training.checkpoint import read_log
from lib.training.configurator import ArgumentParser, ConfigError, run_main
from lib.training.data import write_atomic

# ../shared/design/paper.md, section 3: test cross-entropy at 128M after 100B tokens of FineWeb-Edu;
# MHA, GQA, MQA and MLA from its Table 1, LRKV r = 16 and 64 from its rank ablation (its Table 1's
# LRKV, r = 46, has 2.893)
PAPER = {"mha": ("MHA", 2.903), "lrkv-r16": ("LRKV r = 16", 2.905), "lrkv-r64": ("LRKV r = 64", 2.888),
         "mqa": ("MQA", 2.929), "mla": ("MLA", 2.901), "gqa": ("GQA", 2.918)}


def ranks(values):
    """Each value's place, 1 for the smallest, in the order given; None stays None."""
    order = sorted(v for v in values if v is not None)
    return [None if v is None else order.index(v) + 1 for v in values]


def loss_table(folder):
    """{"step", "runs": [{"run", "val_loss", "val_bpb", "rank", "paper", "paper_loss", "paper_rank",
    "last_step", "last_val_loss"}, ...]} at the last step that every run's log has an evaluation of,
    or a ConfigError that says why there is none."""
    evals = {}
    for log in sorted(Path(folder).glob("*/log.jsonl")):
        evals[log.parent.name] = {r["step"]: r for r in read_log(log.parent) if "val_loss" in r}
    if not evals:
        raise ConfigError(f"{folder}: no */log.jsonl (train.py's) to read")
    names = sorted(evals, key=lambda name: (list(PAPER).index(name) if name in PAPER else len(PAPER), name))
    steps = set.intersection(*(set(evals[name]) for name in names))
    if not steps:
        unevaluated = [name for name in names if not evals[name]]
        why = (f"{', '.join(unevaluated)} logged no evaluation" if unevaluated
               else "their evaluations' steps differ")
        raise ConfigError(f"{folder}: no step that every run evaluated: {why}")
    step = max(steps)
    rows = []
    for name in names:
        at, last = evals[name][step], max(evals[name])
        paper, paper_loss = PAPER.get(name, (None, None))
        rows.append(dict(run=name, val_loss=at["val_loss"], val_bpb=at["val_bpb"], paper=paper,
                         paper_loss=paper_loss, last_step=last, last_val_loss=evals[name][last]["val_loss"]))
    for key, place in (("val_loss", "rank"), ("paper_loss", "paper_rank")):
        for row, rank in zip(rows, ranks([row[key] for row in rows])):
            row[place] = rank
    return dict(step=step, runs=rows)


def markdown(table, tokens_per_step=None):
    tokens = f", {table['step'] * tokens_per_step:,} tokens" if tokens_per_step else ""
    lines = [f"Validation loss (nats per token) at step {table['step']}{tokens}, the last step every run "
             "evaluated; one run (one seed) per variant. The paper's: test loss at 128M after 100B tokens "
             "of FineWeb-Edu, of other data and length, to compare in order, not in level.", "",
             "| run | val loss | val BPB | order | paper | paper's loss | paper's order | "
             "last step: val loss |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for row in table["runs"]:
        paper = [row["paper"] or "-", "-" if row["paper_loss"] is None else f"{row['paper_loss']:.3f}",
                 "-" if row["paper_rank"] is None else str(row["paper_rank"])]
        lines.append(f"| {row['run']} | {row['val_loss']:.3f} | {row['val_bpb']:.3f} | {row['rank']} | "
                     f"{' | '.join(paper)} | {row['last_step']}: {row['last_val_loss']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = ArgumentParser(prog="tools.loss_table", description="The runs' validation loss at one step, "
                            "beside the paper's.")
    parser.add_argument("folder", type=Path, help="a folder of train.py runs, */log.jsonl")
    parser.add_argument("--tokens_per_step", type=int, help="to say how many tokens the step is")
    args = parser.parse_args(argv)
    try:
        table = loss_table(args.folder)
    except ConfigError as e:
        sys.exit(f"tools.loss_table: error: {e}")
    text = markdown(table, args.tokens_per_step)
    print(text, end="")
    try:
        write_atomic(args.folder / "loss_table.md", text.encode())
        write_atomic(args.folder / "loss_table.json", json.dumps(table, indent=2).encode())
    except OSError as e:
        sys.exit(f"tools.loss_table: error: {args.folder} cannot be written: {e.strerror}")


if __name__ == "__main__":
    sys.exit(run_main(main))
