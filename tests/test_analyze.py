"""Tests of diversity.py and analyze.py: the effective rank at its two ends and in between, the
invariances of the head-similarity matrix, the trace form against the explicit d x d operators,
the bounds of the centred rank, the ranks train.py logs during training, and the command line,
end to end and on bad input."""

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch

import analyze
import model
from lib.training import checkpoint

from lib.attention import convert

from lib.attention import diversity

import prepare_data
from lib.training.data import TrainBatches, read_shard, shard_paths
import train
from lib.training import recipe
from model import GPT, GPTConfig
from test_train import flags as train_flags, flip_a_bit

H, D, D_QK = 4, 24, 6
TINY = GPTConfig(
    block_size=16, vocab_size=64, n_layer=3, n_head=4, n_embd=32, head_dim=8,
    n_kv_head=2, kv_lora_rank=8, rope_head_dim=4, lrkv_rank=2,
)


def random_heads(seed=0, heads=H):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, D, D_QK, generator=generator, dtype=torch.float64) for _ in range(2))


def random_orthogonal(seed):
    generator = torch.Generator().manual_seed(seed)
    Q, R = torch.linalg.qr(torch.randn(D_QK, D_QK, generator=generator, dtype=torch.float64))
    return Q * R.diagonal().sign()


def test_identical_heads_have_rank_one():
    Wq, Wk = random_heads(heads=1)
    G = diversity.head_similarity(Wq.expand(H, -1, -1), Wk.expand(H, -1, -1))
    np.testing.assert_allclose(G, np.ones((H, H)))
    assert diversity.effective_rank(G) == pytest.approx(1, abs=1e-9)
    assert diversity.effective_rank(G, centered=True) == 0  # no spread around the mean at all


def test_orthogonal_heads_have_rank_H():
    # head h's Wq lives in its own block of rows, and so does its A_h = Wq_h Wk_h^T
    Wq, Wk = random_heads()
    rows = torch.arange(D) // (D // H)
    Wq = Wq * (rows[None, :, None] == torch.arange(H)[:, None, None])
    G = diversity.head_similarity(Wq, Wk)
    np.testing.assert_allclose(G, np.eye(H), atol=1e-15)
    assert diversity.effective_rank(G) == pytest.approx(H)
    assert diversity.effective_rank(G, centered=True) == pytest.approx(H - 1)


def test_three_alike_heads_and_one_apart():
    """Heads 0-2 share one operator and head 3 has an orthogonal one: G is a 3 x 3 block of ones
    beside a lone 1, with eigenvalues 3 and 1, so the rank is exp of the entropy of (3/4, 1/4),
    1.75. Centred, the two operators spread along a single direction: rank 1."""
    Wq, Wk = random_heads(heads=2)
    rows = torch.arange(D) // (D // 2)
    Wq = Wq * (rows[None, :, None] == torch.arange(2)[:, None, None])
    heads = torch.tensor([0, 0, 0, 1])
    G = diversity.head_similarity(Wq[heads], Wk[heads])
    p = np.array([3, 1]) / 4
    assert diversity.effective_rank(G) == pytest.approx(np.exp(-(p * np.log(p)).sum()))
    assert diversity.effective_rank(G, centered=True) == pytest.approx(1)


def test_similarity_ignores_basis_and_scale_inside_a_head():
    Wq, Wk = random_heads()
    G = diversity.head_similarity(Wq, Wk)
    R = random_orthogonal(1)
    rotated_q, rotated_k = Wq.clone(), Wk.clone()
    rotated_q[1], rotated_k[1] = Wq[1] @ R, Wk[1] @ R
    rotated_q[2], rotated_k[2] = 3 * Wq[2], 0.2 * Wk[2]
    np.testing.assert_allclose(diversity.head_similarity(rotated_q, rotated_k), G, rtol=0, atol=1e-12)
    # rotating the query side alone does change the operator, so the test above has teeth
    rotated_q[1] = Wq[1] @ random_orthogonal(2)
    assert not np.allclose(diversity.head_similarity(rotated_q, Wk), G, atol=1e-3)


def test_trace_form_equals_explicit_operators():
    Wq, Wk = random_heads()
    A = (Wq @ Wk.transpose(1, 2)).flatten(1)  # the d x d operators, flattened
    A = A / A.norm(dim=1, keepdim=True)
    np.testing.assert_allclose(diversity.head_similarity(Wq, Wk), A @ A.t(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("heads", [1, 2, 3, 6, 12])
def test_centred_rank_stays_finite_and_below_H_minus_1(heads):
    Wq, Wk = random_heads(seed=heads, heads=heads)
    layers = {
        "random": (Wq, Wk),
        "identical": (Wq[:1].expand(heads, -1, -1), Wk[:1].expand(heads, -1, -1)),
        "two groups": (Wq[torch.arange(heads) % 2], Wk[torch.arange(heads) % 2]),
        "nearly identical": (Wq[:1] + 1e-9 * Wq, Wk[:1].expand(heads, -1, -1)),
        "shared key": (Wq, Wk[:1].expand(heads, -1, -1)),
    }
    for name, (q, k) in layers.items():
        G = diversity.head_similarity(q, k)
        centred, uncentred = diversity.effective_rank(G, centered=True), diversity.effective_rank(G)
        assert 0 <= centred <= max(heads - 1, 0) + 1e-9, name
        assert 1 - 1e-9 <= uncentred <= heads + 1e-9, name


def save_checkpoint(path, val_loss=None, val_bpb=None, seed=0, log=None, **overrides):
    """A checkpoint as train.py writes it; with log (train.py's records), its log.jsonl beside it."""
    torch.manual_seed(seed)
    config = replace(TINY, **overrides)
    path.parent.mkdir(parents=True)
    ckpt = {"model": GPT(config).state_dict(), "model_args": asdict(config), "val_loss": val_loss,
            "val_bpb": val_bpb}
    if log is not None:
        ckpt["config"] = {"batch_size": 3}
        (path.parent / "log.jsonl").write_text("".join(json.dumps(record) + "\n" for record in log))
    torch.save(ckpt, path)


def test_end_to_end(tmp_path, capsys):
    # folder names sort differently from the legend, and one run has no validation numbers
    runs = {
        "a_gqa": dict(attn="gqa", val_loss=3.1, val_bpb=0.95),
        "b_lrkv4": dict(attn="lrkv", lrkv_rank=4, val_loss=3.0, val_bpb=0.91),
        "c_mha": dict(attn="mha", val_loss=3.05, val_bpb=0.93, log=[
            dict(step=10, loss=4.0, lr=0.02), dict(step=20, loss=3.5, lr=0.01),
            dict(step=20, val_loss=3.05, val_bpb=0.93)]),
        "d_mla": dict(attn="mla"),
        "e_lrkv2": dict(attn="lrkv", lrkv_rank=2, val_loss=3.08, val_bpb=0.94),
        "f_mqa": dict(attn="mqa", val_loss=3.2, val_bpb=0.97),
    }
    for seed, (name, kwargs) in enumerate(runs.items()):
        save_checkpoint(tmp_path / "out" / name / "ckpt.pt", seed=seed, **kwargs)
    out_dir = tmp_path / "figures"
    analyze.main([str(tmp_path / "out"), "--out_dir", str(out_dir)])

    # MHA's log is one from before train.py logged effective ranks: no rank_during_training.png
    written = sorted(p.name for p in out_dir.iterdir())
    assert written == ["analysis.json", "effective_rank.png", "head_correlation.png", "kv_cache.png",
                       "kv_tradeoff.png", "loss_curves.png", "rank_energy.png"]
    results = json.loads((out_dir / "analysis.json").read_text())["runs"]
    order = ["Standard MHA", "LRKV (r=2)", "LRKV (r=4)", "MQA", "MLA", "GQA (2 KV heads)"]
    assert [run["label"] for run in results] == order
    for run in results:
        assert run["n_layer"] == 3 and run["n_head"] == 4
        assert len(run["effective_rank"]) == len(run["effective_rank_centered"]) == 3
        similarity = np.array(run["similarity"])
        assert similarity.shape == (3, 4, 4)
        np.testing.assert_allclose(similarity.diagonal(axis1=1, axis2=2), np.ones((3, 4)))
    mla = results[order.index("MLA")]
    assert mla["val_loss"] is None and mla["val_bpb"] is None
    # LRKV: 2 d_h + 2 H r, MLA: d_c + d_R, each plus the H key RMSs that its decoder caches
    fractions = [1, (16 + 16 + 4) / 64, (16 + 32 + 4) / 64, 16 / 64, (8 + 4 + 4) / 64, 32 / 64]
    assert [run["kv_cache_fraction"] for run in results] == fractions
    # kv_cache.png's entries, all 3 layers: LRKV r = 2 caches d_h = 8 shared and H r = 8 residual
    # numbers for keys and for values, and H = 4 key RMSs
    lrkv = results[order.index("LRKV (r=2)")]
    assert lrkv["kv_cache_entries"] == dict(k_shared=24, r_k=24, rho=12, v_shared=24, r_v=24)
    assert sum(lrkv["kv_cache_entries"].values()) == lrkv["kv_cache_elements_per_token"]
    table = capsys.readouterr().out
    assert all(sum(line.startswith(label + " ") for line in table.splitlines()) == 1 for label in order)

    # the figures main saved, rebuilt from analysis.json to count their lines and panels
    effective_rank = analyze.plot_effective_rank(results, centered=False).axes[0]
    assert [line.get_label() for line in effective_rank.lines] == order + ["Fully redundant"]
    assert effective_rank.get_ylim()[0] < 1 and effective_rank.get_ylim()[1] > 4
    size = analyze.model_size(results[0]["n_params"])
    assert effective_rank.get_title() == f"Head Diversity via Effective Rank ({size})"
    panels = [ax for ax in analyze.plot_head_correlation(results, None).axes if ax.images]
    assert [ax.get_title() for ax in panels] == order
    loss, bpb = analyze.plot_kv_tradeoff(results).axes
    assert len(loss.collections) == len(bpb.collections) == 5
    # loss curves against tokens: step * batch_size * block_size, and only MHA logged anything
    mha = results[0]
    tokens_per_step = 3 * TINY.block_size
    assert mha["curves"] == {"train": [[10 * tokens_per_step, 4.0], [20 * tokens_per_step, 3.5]],
                             "val": [[20 * tokens_per_step, 3.05]]}
    assert all(run["curves"] is None for run in results[1:])
    val, train = analyze.plot_loss_curves(results).axes
    assert [line.get_label() for line in val.lines] == ["Standard MHA"]
    assert [line.get_label() for line in train.lines] == ["Standard MHA"]
    millions = [10 * tokens_per_step / 1e6, 20 * tokens_per_step / 1e6]
    np.testing.assert_allclose(train.lines[0].get_xdata(), millions)


def test_heatmap_defaults_to_the_layer_where_the_runs_differ_most():
    identity = np.eye(2)[None].repeat(3, 0).tolist()
    runs = [dict(label=name, n_layer=3, kv_sources=[0, 1, 2], key_layers=[0, 1, 2], n_head=2,
                 effective_rank=ranks, similarity=identity)
            for name, ranks in (("a", [1.9, 2.0, 1.5]), ("b", [1.2, 1.95, 1.4]), ("c", [1.8, 2.0, 1.3]))]
    assert analyze.most_different_layer(runs) == 0  # spreads 0.7, 0.05, 0.2
    title = analyze.plot_head_correlation(runs, None)._suptitle.get_text()
    assert title.startswith("Attention Head Correlation (layer 0,")
    title = analyze.plot_head_correlation(runs, 2)._suptitle.get_text()
    assert title == "Attention Head Correlation (layer 2)"
    # a CLA run (--cla=3) has the ranks of layer 0 alone, whose keys its layers 1 and 2 attend with
    cla = dict(runs[0], label="d", kv_sources=[0, 0, 0], key_layers=[0], effective_rank=[1.0],
               similarity=identity[:1])
    assert analyze.most_different_layer([*runs, cla]) == 0
    title = analyze.plot_head_correlation([runs[0], cla], 2)._suptitle.get_text()
    assert title == "Attention Head Correlation (layer 0, 2)"  # layer 2's keys in each
    runs[1].update(n_layer=4, kv_sources=[0, 1, 2, 3])  # runs of different depth: each run's middle layer
    assert analyze.most_different_layer(runs) is None


def test_model_size_labels():
    sizes = [analyze.model_size(n) for n in (480_000, 9_940_000, 162_000_000, 1_240_000_000)]
    assert sizes == ["0.5M", "9.9M", "162M", "1.2B"]


def run_cli(*args):
    command = [sys.executable, "analyze.py", *map(str, args)]
    return subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


BAD_INPUT = ["missing", "empty", "garbage", "truncated", "a list", "no model_args", "runs code",
             "a folder without checkpoints", "/dev/zero", "--layer=99"]


@pytest.mark.parametrize("problem", BAD_INPUT)
def test_bad_input_is_one_line_and_an_error_and_leaves_nothing_behind(tmp_path, problem):
    """Every way a checkpoint can be wrong ends analyze.py in one line naming it, before --out_dir,
    not there yet, is made: nothing is left behind, and no code in the file runs."""
    path, marker, out_dir = tmp_path / "ckpt.pt", tmp_path / "code_ran", tmp_path / "figures" / "here"
    flags = []
    if problem in ("truncated", "--layer=99"):
        save_checkpoint(tmp_path / "whole" / "ckpt.pt")
        whole = (tmp_path / "whole" / "ckpt.pt").read_bytes()
        path.write_bytes(whole[:len(whole) // 2] if problem == "truncated" else whole)
        flags = ["--layer=99"] if problem == "--layer=99" else []
    elif problem == "empty":
        path.write_bytes(b"")
    elif problem == "garbage":
        path.write_text("hello")
    elif problem == "a list":
        torch.save([1, 2, 3], path)
    elif problem == "no model_args":
        torch.save({"model": GPT(TINY).state_dict()}, path)
    elif problem == "runs code":
        torch.save({"model_args": asdict(TINY), "model": RunsCode(marker)}, path)
    elif problem == "a folder without checkpoints":
        path = tmp_path / "empty_folder"
        path.mkdir()
    elif problem == "/dev/zero":
        path = Path("/dev/zero")
    with pytest.raises(SystemExit) as exit:
        analyze.main([str(path), f"--out_dir={out_dir}", *flags])
    message = exit.value.code
    assert isinstance(message, str) and "\n" not in message and message.startswith(f"{path}: "), message
    assert not (tmp_path / "figures").exists() and not marker.exists()
    if problem == "runs code":  # which it does, loaded without weights_only
        torch.load(path, weights_only=False)
        assert marker.exists()


def test_bad_input_from_the_command_line_is_one_line_on_stderr(tmp_path):
    result = run_cli(tmp_path / "missing.pt")
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"{tmp_path / 'missing.pt'}: ")


def test_rank_energy_is_the_share_of_the_heads_deviation_each_rank_keeps():
    torch.manual_seed(0)
    model = GPT(replace(TINY, attn="mha")).double()  # as analyze() reads the attention weights
    energy = analyze.rank_energy(model)
    H, d_h = TINY.n_head, TINY.head_dim
    for layer, block in enumerate(model.blocks):
        for name, W in (("keys", block.attn.W_k), ("values", block.attn.W_v)):
            heads = W.weight.double().view(H, d_h, -1)
            deviation = heads - heads.mean(0)
            total = sum(torch.linalg.matrix_norm(deviation[h]) ** 2 for h in range(H))
            for r in range(1, d_h + 1):
                kept = sum((torch.linalg.svdvals(deviation[h])[:r] ** 2).sum() for h in range(H)) / total
                assert energy[name][layer][r - 1] == pytest.approx(kept.item(), rel=1e-9)
            assert energy[name][layer][-1] == pytest.approx(1)
    assert analyze.rank_energy(GPT(replace(TINY, attn="mqa"))) is None  # one head: no spread
    assert analyze.rank_energy(GPT(replace(TINY, attn="mla"))) is None  # no per-head projections


def test_rank_energy_through_the_inputs_is_the_share_of_X_D_h_each_rank_keeps():
    """With each layer's input covariance C = X^T X / n, the singular values that count are
    those of X (W_h - mean)^T, the deviation on the inputs themselves."""
    torch.manual_seed(0)
    model = GPT(replace(TINY, attn="mha")).double()
    H, d_h, d = TINY.n_head, TINY.head_dim, TINY.n_embd
    inputs = [torch.randn(200, d, dtype=torch.float64) * torch.logspace(0, -2, d, dtype=torch.float64)
              for _ in range(TINY.n_layer)]
    energy = analyze.rank_energy(model, [X.T @ X / len(X) for X in inputs])
    for layer, (block, X) in enumerate(zip(model.blocks, inputs)):
        for name, W in (("keys", block.attn.W_k), ("values", block.attn.W_v)):
            heads = W.weight.view(H, d_h, -1)
            seen = [torch.linalg.svdvals(X @ (heads[h] - heads.mean(0)).T) ** 2 for h in range(H)]
            total = sum(s.sum() for s in seen)
            for r in range(1, d_h + 1):
                kept = sum(s[:r].sum() for s in seen) / total
                assert energy[name][layer][r - 1] == pytest.approx(kept.item(), rel=1e-9)
    assert energy != analyze.rank_energy(model)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Byte shards of twenty pydoc topics, through prepare_data.py."""
    from pydoc_data.topics import topics
    root = tmp_path_factory.mktemp("data")
    for i, key in enumerate(sorted(topics)[:20]):
        (root / f"{i:02d}.txt").write_text(topics[key])
    prepare_data.main(["--dataset=text", "--tokenizer=byte", "--input", str(root),
                       f"--out_dir={root / 'bytes'}"])
    return root / "bytes"


def test_rank_energy_png_sees_the_heads_through_the_checkpoints_training_data(tmp_path, data_dir, capsys):
    """With its data_dir there, an MHA checkpoint's rank_energy.png gains a row for the heads as
    the inputs see them, calibrated as a conversion from it is by default (TrainConfig's
    calibration_tokens of its seed's windows); without it, one row and the reason."""
    found, gone = tmp_path / "found" / "mha" / "ckpt.pt", tmp_path / "gone" / "mha" / "ckpt.pt"
    for path, data in ((found, data_dir), (gone, tmp_path / "nowhere")):
        save_checkpoint(path, attn="mha", vocab_size=256, log=[])
        ckpt = torch.load(path, weights_only=True)
        ckpt["config"].update(data_dir=str(data), seed=2)
        torch.save(ckpt, path)
    analyze.main([str(found)])
    run = json.loads((found.parent / "analysis.json").read_text())["runs"][0]
    model = checkpoint.load_checkpoint(found, "cpu")[1]
    shards = [read_shard(p) for p in shard_paths(data_dir, "train")]
    batches = TrainBatches(shards, TINY.block_size)
    tokens = recipe.TrainConfig.calibration_tokens
    covariances = convert.attention_input_covariances(model, batches, tokens, 2, 8, "cpu")
    assert run["rank_energy_seen"] == analyze.rank_energy(model.double(), covariances)
    assert [ax.get_title() for ax in analyze.plot_rank_energy(run, TINY.head_dim).axes] == [
        "Keys, the weights alone", "Values, the weights alone",
        "Keys, as the attention's inputs see them", "Values, as the attention's inputs see them"]
    capsys.readouterr()
    analyze.main([str(gone)])
    out = capsys.readouterr().out
    assert "rank_energy.png from the weights alone, with no inputs to see them through: " in out
    run = json.loads((gone.parent / "analysis.json").read_text())["runs"][0]
    assert run["rank_energy_seen"] is None and len(analyze.plot_rank_energy(run, TINY.head_dim).axes) == 2


def test_a_converted_run_shows_where_it_started(tmp_path, capsys):
    """A run with init_from gets its own label and its step-0 loss beside its last."""
    source = tmp_path / "out" / "mha" / "ckpt.pt"
    save_checkpoint(source, attn="mha", val_loss=3.0, val_bpb=0.9)
    # lrkv was converted before --calibration_tokens existed, white with it, again's copy needs none
    for name, attn, init_from, tokens in (("lrkv", "lrkv", source, None), ("white", "lrkv", source, 256),
                                          ("taught", "lrkv", source, 256), ("again", "mha", source, 256),
                                          ("gone", "gqa", tmp_path / "gone.pt", 256)):
        path = tmp_path / "converted" / name / "ckpt.pt"
        save_checkpoint(path, val_loss=2.9, val_bpb=0.88, attn=attn,
                        log=[dict(step=0, val_loss=3.5, val_bpb=1.1), dict(step=5, loss=3.0, lr=0.01)])
        ckpt = torch.load(path, weights_only=True)
        ckpt["config"]["init_from"] = str(init_from)
        if tokens is not None:
            ckpt["config"]["calibration_tokens"] = tokens
        if name == "taught":
            ckpt["config"]["distill"] = 0.5
        torch.save(ckpt, path)
    analyze.main([str(tmp_path / "converted"), str(source)])
    runs = json.loads((tmp_path / "converted" / "analysis.json").read_text())["runs"]
    assert [run["label"] for run in runs] == ["Standard MHA", "Standard MHA, uptrained",
                                              "LRKV (r=2), converted",
                                              "LRKV (r=2), converted, whitened, distilled",
                                              "LRKV (r=2), converted, whitened",
                                              "GQA (2 KV heads), from a checkpoint"]
    assert [run["whitened"] for run in runs] == [False, False, False, True, True, False]
    assert [run["start"] for run in runs] == [None] + [dict(val_loss=3.5, val_bpb=1.1)] * 5
    table = capsys.readouterr().out.splitlines()
    assert "val loss at step 0" in table[0] and table[3].split()[-7:-5] == ["3.500", "2.900"]
    # markers tell the whitened run (a square) and the distilled one (a triangle) from the other
    # converted runs (diamonds)
    loss, _ = analyze.plot_kv_tradeoff(runs).axes
    marker = {points.get_label(): points.get_paths()[0].vertices.tolist() for points in loss.collections}
    assert marker["LRKV (r=2), converted"] == marker["Standard MHA, uptrained"]
    shapes = [marker[f"LRKV (r=2), converted{how}"] for how in ("", ", whitened", ", whitened, distilled")]
    assert all(a != b for i, a in enumerate(shapes) for b in shapes[i + 1:])


def test_a_torn_log_loses_its_last_line_alone(tmp_path, capsys):
    path = tmp_path / "mha" / "ckpt.pt"
    save_checkpoint(path, attn="mha", log=[dict(step=1, loss=5.0), dict(step=2, loss=4.0)])
    with open(path.parent / "log.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a crash in mid-append
    analyze.main([str(path)])
    err = capsys.readouterr().err
    assert err == (f"note: {path.parent / 'log.jsonl'}: dropped its last line, cut short by a crash while it "
                   """was written: '{"step": 3, "lo'\n""")
    run = json.loads((path.parent / "analysis.json").read_text())["runs"][0]
    tokens = 3 * TINY.block_size  # save_checkpoint's batch_size of 3
    assert run["curves"]["train"] == [[tokens, 5.0], [2 * tokens, 4.0]]


def test_a_damaged_checkpoint_or_log_and_bad_flags_are_one_line(tmp_path, capsys):
    """A flipped bit in a checkpoint with a digest (as train.py writes them), a log line that is no
    record, flags argparse refuses and a folder that cannot be written: one line, no analysis."""
    path = tmp_path / "mha" / "ckpt.pt"
    save_checkpoint(path, attn="mha", log=[dict(step=1, loss=5.0), dict(loss=4.0)])
    with pytest.raises(SystemExit) as exit:
        analyze.main([str(path)])
    assert exit.value.code == f"{path.parent / 'log.jsonl'}, line 2: field 'step' is missing"
    checkpoint.save_checkpoint(path, torch.load(path, weights_only=True))
    flip_a_bit(path)
    with pytest.raises(SystemExit) as exit:
        analyze.main([str(path)])
    assert exit.value.code == (f"{path}: damaged: its contents do not match the digest saved with them; "
                               "restore it from a copy or train it again")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit:
        analyze.main([str(path), f"--out_dir={tmp_path / 'file'}"])
    written = tmp_path / "file" / "analysis.json"
    assert exit.value.code == f"{written}: cannot be written: its folder is a file"
    for args, says in ((["--layer=first"], "argument --layer: invalid index_or_mean value: 'first'"),
                       (["--bogus"], "unrecognized arguments: --bogus"), ([], "the following arguments are "
                                                                            "required: ckpts")):
        with pytest.raises(SystemExit) as exit:
            analyze.main(args + ([str(path)] if args else []))
        assert exit.value.code == 2 and capsys.readouterr().err == f"analyze.py: error: {says}\n"
    assert not (path.parent / "analysis.json").exists()


def test_the_ranks_train_py_logs_are_analyzes_of_the_checkpoint_at_that_step(tmp_path, data_dir, capsys):
    """Every evaluation logs each layer's effective rank, uncentred and centred: at a step where
    the run stopped (its checkpoint then that step's) and at its end, after --resume, they are
    what analyze.py computes from the checkpoint. rank_during_training.png draws them, beside a run
    whose log predates them, which still analyses."""
    out = tmp_path / "runs" / "lrkv"
    flags = [f"--{k}={v}" for k, v in dict(
        vocab_size=256, block_size=32, n_layer=3, n_head=3, head_dim=16, n_embd=48, attn="lrkv", lrkv_rank=2,
        batch_size=4, micro_batch_size=4, max_steps=6, warmup_steps=1, eval_interval=2, eval_tokens=256,
        log_interval=1, device="cpu", dtype="float32", data_dir=data_dir, out_dir=out).items()]
    for more in (["--stop_after=4"], ["--resume"]):
        assert train.main(flags + more) == 0
        analyze.main([str(out / "ckpt.pt")])
        run = json.loads((out / "analysis.json").read_text())["runs"][0]
        step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
        logged = {r["step"]: r for r in checkpoint.read_log(out) if "val_loss" in r}
        for key in ("effective_rank", "effective_rank_centered"):
            assert len(logged[step][key]) == 3
            np.testing.assert_allclose(logged[step][key], run[key], rtol=1e-12)
    during = run["ranks_during_training"]
    assert during["step"] == [2, 4, 6]
    assert during["effective_rank"] == [logged[step]["effective_rank"] for step in (2, 4, 6)]
    assert "effective rank, mean over layers" in capsys.readouterr().out

    save_checkpoint(tmp_path / "runs" / "old" / "ckpt.pt", attn="mqa", vocab_size=256,
                    log=[dict(step=5, val_loss=3.0, val_bpb=1.0)])
    analyze.main([str(tmp_path / "runs")])
    runs = json.loads((tmp_path / "runs" / "analysis.json").read_text())["runs"]
    assert [run["ranks_during_training"] is None for run in runs] == [False, True]
    for centered in (False, True):
        figure = analyze.plot_rank_during_training(runs, centered)
        titles = ["Mean over layers", "First layer (0)", "Last layer (2)"]
        assert [ax.get_title() for ax in figure.axes] == titles
        for ax, layer in zip(figure.axes, (None, 0, -1)):
            (line,) = [line for line in ax.lines if line.get_label() == runs[0]["label"]]
            ranks = np.array(during["effective_rank_centered" if centered else "effective_rank"])
            np.testing.assert_allclose(line.get_ydata(), ranks.mean(1) if layer is None else ranks[:, layer])
            assert list(line.get_xdata()) == [2, 4, 6]
    assert (tmp_path / "runs" / "rank_during_training.png").exists()
    assert analyze.plot_rank_during_training(runs[1:], False) is None


class TiedKeyValueAttention(model.Attention):
    """One head of width d_h a token, read by every query head as MQA's, whose key is its value
    normalised and rotated. No table of lib/attention/heads.py lists it, so its heads give no maps
    of x: it has no effective rank, and the rest of a run must go on without one."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.W_kv = torch.nn.Linear(config.n_embd, config.head_dim, bias=False)

    def keys_values(self, x, rope):
        B, T, _ = x.shape
        v = self.W_kv(x).view(B, T, 1, self.head_dim)
        return model.apply_rope(model.norm(v), rope), v  # (B, T, 1, d_h) each

    def cache_shapes(self):
        return {"k": (1, self.head_dim), "v": (1, self.head_dim)}


def test_a_variant_without_head_maps_trains_resumes_and_is_analysed_saying_it_has_no_rank(
        data_dir, tmp_path, monkeypatch, capsys):
    """A variant that no heads.py table lists trains, evaluates (its records' ranks None) and resumes,
    scoring a task; analyze.py draws its loss curves, cache, trade-off and task as any run's, and
    says on stderr, in analysis.json and in the rank figures' legends that its heads give no maps of x."""
    monkeypatch.setitem(model.VARIANTS, "tied_kv", TiedKeyValueAttention)
    out = tmp_path / "runs" / "tied_kv"
    run_flags = train_flags(data_dir=data_dir, out_dir=out, attn="tied_kv", max_steps=4, eval_interval=2,
                            eval_tokens=128)
    assert train.main(run_flags + ["--stop_after=2"]) == 0
    says = ("TiedKeyValueAttention's heads give no maps of x (no entry in lib/attention/heads.py), so they "
            "have no effective rank")
    assert says in capsys.readouterr().err
    assert train.main(run_flags + ["--resume", "--eval_tasks=humaneval", "--eval_tasks_limit=1"]) == 0
    printed = capsys.readouterr()
    assert says in printed.err and "effective rank none" in printed.out
    evaluations = [r for r in checkpoint.read_log(out) if "val_loss" in r]
    assert [(r["step"], r["effective_rank"], r["effective_rank_centered"]) for r in evaluations] == [
        (2, None, None), (4, None, None)]
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 4

    # alone: no rank figure at all, said so
    analyze.main([str(out / "ckpt.pt"), f"--out_dir={tmp_path / 'alone'}"])
    printed = capsys.readouterr()
    assert f"{out / 'ckpt.pt'}: {says}" in printed.err
    assert "so no effective_rank.png" in printed.out and "so no head_correlation.png" in printed.out
    assert not (tmp_path / "alone" / "effective_rank.png").exists()
    for name in ("loss_curves.png", "kv_cache.png", "kv_tradeoff.png", "tasks_during_training.png"):
        assert (tmp_path / "alone" / name).stat().st_size > 0, name

    # beside an MHA run, whose ranks are drawn, and the legends say what the variant's cannot be
    logged_ranks = dict(effective_rank=[3.5, 3.0, 2.5], effective_rank_centered=[2.5, 2.0, 1.5])
    save_checkpoint(tmp_path / "runs" / "mha" / "ckpt.pt", attn="mha", vocab_size=256,
                    log=[dict(step=2, val_loss=3.0, val_bpb=1.0, **logged_ranks)])
    analyze.main([str(tmp_path / "runs"), f"--out_dir={tmp_path / 'figures'}"])
    assert says in capsys.readouterr().err
    order = json.loads((tmp_path / "figures" / "analysis.json").read_text())["runs"]
    tied, mha = (next(run for run in order if run["attn"] == attn) for attn in ("tied_kv", "mha"))
    assert tied["no_head_maps"] == says and mha["no_head_maps"] is None
    assert tied["effective_rank"] is None and tied["similarity"] is None
    assert tied["ranks_during_training"] is None
    assert len(mha["effective_rank"]) == 3
    assert [tokens for tokens, _ in tied["curves"]["val"]] == [2 * 4 * 32, 4 * 4 * 32]  # steps x batch x T
    assert tied["kv_cache_entries"] == {"k": 2 * 16, "v": 2 * 16}  # one d_h = 16 head each, 2 layers
    assert tied["val_loss"] == evaluations[-1]["val_loss"]
    assert tied["tasks_during_training"]["humaneval"]["step"] == [4]
    for name in ("effective_rank.png", "head_correlation.png", "loss_curves.png", "kv_cache.png",
                 "kv_tradeoff.png", "tasks_during_training.png"):
        assert (tmp_path / "figures" / name).stat().st_size > 0, name
    note = f"{tied['label']}: no maps of x, no rank"
    for figure in (analyze.plot_effective_rank(order, False), analyze.plot_rank_during_training(order, True)):
        assert note in [text.get_text() for text in figure.legends[0].get_texts()]
    panel = analyze.plot_head_correlation(order, None).axes[order.index(tied)]
    assert [text.get_text() for text in panel.texts] == ["no maps of x"]
