"""tools/bench_gpu.sh's phase 1 at toy sizes on this CPU (TINY=1): the pysource corpus, the six runs at
once, the loss table, analyze.py's figures and a sample, checked from what the phase wrote. About a
minute on two cores: make test leaves it out (its time is near its bound), `make test-gpu-phase`
runs it, and CI after make test."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lib.training.checkpoint import read_log
from lib.training.data import get_tokenizer, load_meta, read_shard, shard_paths

REPO = Path(__file__).resolve().parents[1]
RUNS = ["mha", "lrkv-r16", "lrkv-r64", "mqa", "mla", "gqa"]


@pytest.fixture(scope="module")
def phase(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    env = {**os.environ, "TINY": "1", "PHASES": "1", "PYTHON": sys.executable}
    result = subprocess.run(["tools/bench_gpu.sh", str(out)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_phase_ends_well_and_runs_no_other(phase):
    log = (phase / "figures.log").read_text()
    assert log.rstrip().endswith("figures: exit 0"), log[-2000:]
    assert [f"{run}: exit 0;" in log for run in RUNS] == [True] * 6
    assert not any((phase / name).exists() for name in ("decode.json", "train.json", "rivals", "downstream"))


def test_the_corpus_is_pysource_and_meta_json_counts_what_was_written(phase):
    data = phase / "data"
    meta = load_meta(data)
    assert meta["source"].startswith("pysource: ") and meta["tokenizer"] == "gpt2"
    tok = get_tokenizer("gpt2")
    lengths = tok.token_bytes()
    counted = 0
    for split in ("train", "val"):
        tokens = np.concatenate([read_shard(path) for path in shard_paths(data, split)])
        assert meta[f"{split}_tokens"] == len(tokens) > 0
        assert meta[f"{split}_bytes"] == lengths[tokens].sum()
        counted += int((tokens == tok.eot_id).sum())  # each file begins with one
    assert meta["documents"] == counted > 1
    assert meta["train_tokens"] + meta["val_tokens"] == meta["settings"]["max_tokens"]


def test_the_figures_are_written(phase):
    for name in ("effective_rank.png", "head_correlation.png", "rank_during_training.png"):
        assert (phase / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    runs = {Path(run["ckpt"]).parent.name: run for run in
            json.loads((phase / "figures" / "analysis.json").read_text())["runs"]}
    assert sorted(runs) == sorted(RUNS)
    for run in runs.values():  # the ranks at each evaluation, rank_during_training.png's points
        during = run["ranks_during_training"]
        assert len(during["step"]) >= 2 and all(len(ranks) == 12 for ranks in during["effective_rank"])


def test_the_loss_table_has_every_run_at_the_last_step_all_evaluated(phase):
    table = json.loads((phase / "figures" / "loss_table.json").read_text())
    evals = {run: {r["step"]: r for r in read_log(phase / "figures" / run) if "val_loss" in r}
             for run in RUNS}
    assert table["step"] == max(set.intersection(*(set(steps) for steps in evals.values())))
    assert [row["run"] for row in table["runs"]] == RUNS
    for row in table["runs"]:
        logged = evals[row["run"]][table["step"]]
        assert math.isfinite(row["val_loss"]) and row["val_loss"] == logged["val_loss"]
        assert row["val_bpb"] == logged["val_bpb"] and row["paper_loss"] > 2.8
        assert row["rank"] == 1 + sum(other["val_loss"] < row["val_loss"] for other in table["runs"])
    markdown = (phase / "figures" / "loss_table.md").read_text()
    assert f"at step {table['step']}," in markdown and "one seed" in markdown
    rows = [line for line in markdown.splitlines() if line.split(" | ")[0][2:] in RUNS]
    assert len(rows) == 6
