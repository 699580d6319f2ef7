"""tools/loss_table.py on logs written here: each run's validation loss at the last step that every
run evaluated, its order and the paper's, and one line where no step is common."""

import json

import pytest

from tools import loss_table


def write_log(folder, evals, train_steps=()):
    """A log.jsonl as train.py writes it: step records, and evaluations {step: (val_loss, val_bpb)}."""
    folder.mkdir(parents=True)
    records = [dict(step=s, loss=9.0) for s in train_steps]
    records += [dict(step=s, val_loss=loss, val_bpb=bpb, effective_rank=None)
                for s, (loss, bpb) in evals.items()]
    records.sort(key=lambda r: r["step"])
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_table_is_at_the_last_step_every_run_evaluated(tmp_path, capsys):
    # mqa stopped early (its last evaluation at 20), so the table is at 20, not at 30
    write_log(tmp_path / "mha", {10: (5.0, 2.0), 20: (4.0, 1.6), 30: (3.5, 1.4)}, train_steps=(5, 15, 25))
    write_log(tmp_path / "mqa", {10: (5.1, 2.1), 20: (4.2, 1.7)})
    write_log(tmp_path / "lrkv-r16", {10: (4.9, 1.9), 20: (4.1, 1.65), 30: (3.4, 1.3)})
    write_log(tmp_path / "gta", {20: (3.9, 1.5), 30: (3.3, 1.2)})  # no paper number
    loss_table.main([str(tmp_path), "--tokens_per_step=100"])
    table = json.loads((tmp_path / "loss_table.json").read_text())
    assert table["step"] == 20
    assert [(r["run"], r["val_loss"], r["val_bpb"], r["rank"]) for r in table["runs"]] == [
        ("mha", 4.0, 1.6, 2), ("lrkv-r16", 4.1, 1.65, 3), ("mqa", 4.2, 1.7, 4), ("gta", 3.9, 1.5, 1)]
    assert [(r["paper_loss"], r["paper_rank"], r["last_step"]) for r in table["runs"]] == [
        (2.903, 1, 30), (2.905, 2, 30), (2.929, 3, 20), (None, None, 30)]
    markdown = (tmp_path / "loss_table.md").read_text()
    assert capsys.readouterr().out == markdown
    assert "at step 20, 2,000 tokens," in markdown and "one seed" in markdown
    assert "| mqa | 4.200 | 1.700 | 4 | MQA | 2.929 | 3 | 20: 4.200 |" in markdown
    assert "| gta | 3.900 | 1.500 | 1 | - | - | - | 30: 3.300 |" in markdown


def test_a_run_with_no_evaluation_is_a_row_of_none(tmp_path):
    """A run stopped (or failed) before its first evaluation does not hide the others' table."""
    write_log(tmp_path / "mha", {10: (5.0, 2.0)})
    write_log(tmp_path / "mla", {}, train_steps=(1, 2))
    loss_table.main([str(tmp_path)])
    table = json.loads((tmp_path / "loss_table.json").read_text())
    rows = [(r["run"], r["val_loss"], r["rank"], r["last_step"], r["paper_rank"]) for r in table["runs"]]
    assert table["step"] == 10 and rows == [("mha", 5.0, 1, 10, 2), ("mla", None, None, None, 1)]
    assert "| mla | - | - | - | MLA | 2.901 | 1 | no evaluation |" in (tmp_path / "loss_table.md").read_text()


@pytest.mark.parametrize("logs, message", [
    ({}, "no */log.jsonl"),
    ({"mha": {}, "mla": {}}, "no */log.jsonl (train.py's) with an evaluation"),
    ({"mha": {10: (5.0, 2.0)}, "mla": {20: (4.0, 1.0)}},
     "no step that every run evaluated: their evaluations' steps differ"),
])
def test_no_common_step_is_one_line_and_writes_nothing(tmp_path, logs, message):
    for name, evals in logs.items():
        write_log(tmp_path / name, evals, train_steps=(1,))
    with pytest.raises(SystemExit) as stopped:
        loss_table.main([str(tmp_path)])
    line = str(stopped.value.code)
    assert line.startswith("tools.loss_table: error: ") and message in line and "\n" not in line
    assert not list(tmp_path.glob("loss_table.*"))
