"""
The validation loss of every run in a folder at one step that all of them evaluated (the last such),
beside the paper's test loss at 128M for the same variant: tools/bench_gpu.sh's loss table. A run
that logged no evaluation (stopped or failed before its first) is a row without numbers.

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
    "last_step", "last_val_loss"}, ...]} at the last step that every run with an evaluation in its log
    evaluated; a run with none (stopped, or failed, before its first) has None for its numbers. A
    ConfigError where no run has one, or the runs' evaluations share no step."""
    evals = {}
    for log in sorted(Path(folder).glob("*/log.jsonl")):
        evals[log.parent.name] = {r["step"]: r for r in read_log(log.parent) if "val_loss" in r}
    if not any(evals.values()):
        raise ConfigError(f"{folder}: no */log.jsonl (train.py's) with an evaluation to read")
    names = sorted(evals, key=lambda name: (list(PAPER).index(name) if name in PAPER else len(PAPER), name))
    steps = set.intersection(*(set(evals[name]) for name in names if evals[name]))
    if not steps:
        raise ConfigError(f"{folder}: no step that every run evaluated: their evaluations' steps differ")
    step = max(steps)
    rows = []
    for name in names:
        at, last = evals[name].get(step, {}), max(evals[name], default=None)
        paper, paper_loss = PAPER.get(name, (None, None))
        rows.append(dict(run=name, val_loss=at.get("val_loss"), val_bpb=at.get("val_bpb"), paper=paper,
                         paper_loss=paper_loss, last_step=last,
                         last_val_loss=evals[name][last]["val_loss"] if evals[name] else None))
    for key, place in (("val_loss", "rank"), ("paper_loss", "paper_rank")):
        for row, rank in zip(rows, ranks([row[key] for row in rows])):
            row[place] = rank
    return dict(step=step, runs=rows)


def markdown(table, tokens_per_step=None):
    def number(x, digits=3):
        return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)

    tokens = f", {table['step'] * tokens_per_step:,} tokens" if tokens_per_step else ""
    lines = [f"Validation loss (nats per token) at step {table['step']}{tokens}, the last step every run "
             "evaluated; one run (one seed) per variant. The paper's: test loss at 128M after 100B tokens "
             "of FineWeb-Edu, of other data and length, to compare in order, not in level.", "",
             "| run | val loss | val BPB | order | paper | paper's loss | paper's order | "
             "last step: val loss |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for row in table["runs"]:
        last = row["last_step"] and f"{row['last_step']}: {number(row['last_val_loss'])}"
        ours = map(number, (row["val_loss"], row["val_bpb"], row["rank"]))
        theirs = map(number, (row["paper_loss"], row["paper_rank"]))
        cells = [row["run"], *ours, row["paper"] or "-", *theirs, last or "no evaluation"]
        lines.append(f"| {' | '.join(cells)} |")
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
