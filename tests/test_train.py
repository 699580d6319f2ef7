"""train.py on a tiny model and a tiny byte-level dataset, on the CPU: it learns, resumes exactly,
splits over two gloo processes without changing the losses, survives a kill while saving, and
turns bad input into one line and exit code 2 with nothing written. What real machines do ends in
one line with nothing lost: a full disk, a second run in the folder, a torn log, tokens outside
the vocabulary, a damaged checkpoint."""

import gc
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydoc_data.topics import topics

from lib.training import checkpoint, configurator

from lib.attention import convert

from lib.training import hardware

from lib.training import muon

import prepare_data
from lib.training.data import TrainBatches, read_shard, shard_paths, write_shard
import train
from lib.training import recipe
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]  # the repository, above tests/
STEPS, STOP = 12, 5
TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, head_dim=16, n_embd=32, attn="lrkv",
            lrkv_rank=4, batch_size=4, micro_batch_size=2, max_steps=STEPS, warmup_steps=2,
            eval_interval=STOP, eval_tokens=512, log_interval=1, device="cpu", calibration_tokens=256)


def flags(**overrides):
    return [f"--{k}={v}" for k, v in {**TINY, **overrides}.items()]


def records(out_dir, key):
    """{step: value} of one logged quantity."""
    lines = (json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines())
    return {r["step"]: r[key] for r in lines if key in r}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Forty pydoc topics as text files, through prepare_data.py into byte shards with a val split."""
    root = tmp_path_factory.mktemp("data")
    for i, key in enumerate(sorted(topics)[:40]):
        (root / f"{i:02d}.txt").write_text(topics[key])
    prepare_data.main(["--dataset=text", "--tokenizer=byte", "--input", str(root), "--val_fraction=0.1",
                       f"--out_dir={root / 'bytes'}"])
    return root / "bytes"


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
    """One uninterrupted run, which the resumed and the two-process runs must reproduce."""
    out = tmp_path_factory.mktemp("full")
    assert train.main(flags(data_dir=data_dir, out_dir=out)) == 0
    return out


def test_loss_falls_and_checkpoint_holds_the_run(full_run):
    loss = records(full_run, "loss")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss[STEPS] < loss[1] - 0.5
    val = records(full_run, "val_loss")
    assert sorted(val) == [STOP, 2 * STOP, STEPS] and val[STEPS] < val[STOP]

    ckpt = torch.load(full_run / "ckpt.pt", weights_only=True)
    assert set(ckpt) == {"model", "model_args", "optimizers", "step", "val_loss", "val_bpb", "best_val_loss",
                         "best_val_bpb", "config", "tokenizer", "rng", "digest"}
    assert ckpt["step"] == STEPS and len(ckpt["optimizers"]) == 2
    assert ckpt["val_loss"] == val[STEPS] and ckpt["best_val_loss"] == min(val.values())
    assert ckpt["val_bpb"] == records(full_run, "val_bpb")[STEPS]
    assert ckpt["config"]["max_steps"] == STEPS and ckpt["tokenizer"]["tokenizer"] == "byte"
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])  # strict: no compile or DDP prefixes
    assert not (full_run / "ckpt.pt.tmp").exists()


def test_resume_reproduces_the_uninterrupted_run(data_dir, full_run, tmp_path):
    # the same budget (max_steps, hence the same schedule), stopped after step STOP, then resumed
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path, stop_after=STOP)) == 0
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == STOP
    for changed in (dict(n_layer=1), dict(max_steps=2 * STEPS), dict(weight_decay=0.0), dict(seed=1)):
        assert train.main(flags(data_dir=data_dir, out_dir=tmp_path, **changed) + ["--resume"]) == 2, changed
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path) + ["--resume"]) == 0
    expected, resumed = records(full_run, "loss"), records(tmp_path, "loss")
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert abs(resumed[step] - expected[step]) < 1e-6, step
    assert abs(records(tmp_path, "val_loss")[STEPS] - records(full_run, "val_loss")[STEPS]) < 1e-6


def test_two_gloo_processes_match_one(data_dir, full_run, tmp_path):
    # one process accumulates two micro batches of 2 a step; two processes take one each and DDP averages
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "train.py", *flags(data_dir=data_dir, out_dir=tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    expected, split = records(full_run, "loss"), records(tmp_path, "loss")
    assert sorted(split) == sorted(expected)
    for step in expected:
        assert abs(split[step] - expected[step]) < 1e-4, step
    for key in ("val_loss", "val_bpb"):
        assert abs(records(tmp_path, key)[STEPS] - records(full_run, key)[STEPS]) < 1e-4, key


def test_batches_depend_only_on_seed_step_and_rank(data_dir):
    shards = [read_shard(p) for p in shard_paths(data_dir, "train")]
    batches = TrainBatches(shards, 32)
    x, y = batches.get(seed=3, step=7, batch_size=8, rank=0, world_size=1)
    assert torch.equal(x, TrainBatches(shards, 32).get(3, 7, 8, 0, 1)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    halves = [batches.get(3, 7, 8, rank, 2)[0] for rank in (0, 1)]
    assert torch.equal(torch.cat(halves), x)
    assert not torch.equal(batches.get(3, 8, 8, 0, 1)[0], x)


def test_loss_and_bits_per_byte_are_exact():
    """evaluate() against the definitions, written out token by token: the loss is the mean
    cross-entropy over every target, end-of-text (token 0, zero bytes) included; BPB is the nats
    of the byte-carrying targets over their bytes, / ln 2. Tokens of 1 to 4 bytes and a model
    whose logits depend on its input keep bytes, tokens and targets from standing in for each other."""
    torch.manual_seed(0)
    table = torch.randn(8, 8)  # logits for the next token, by the current token
    bytes_per_token = torch.tensor([0, 1, 2, 3, 4, 1, 2, 3])
    tokens = torch.tensor([0, 3, 1, 0, 7, 4, 2, 0, 5])  # two windows of 4 targets each
    loss, bpb = recipe.evaluate(lambda idx: (table[idx], None), tokens, bytes_per_token, 4, 1, nullcontext(),
                               0, 1)
    nats = [-torch.log_softmax(table[a].double(), 0)[b].item() for a, b in zip(tokens[:-1], tokens[1:])]
    nbytes = [bytes_per_token[b].item() for b in tokens[1:]]
    assert loss == pytest.approx(sum(nats) / len(nats))
    assert bpb == pytest.approx(sum(n for n, k in zip(nats, nbytes) if k) / (math.log(2) * sum(nbytes)))


@pytest.mark.parametrize("overrides, warning", [
    (dict(warmup_steps=4), "max_steps = 2 is below warmup_steps = 4: the lr ends at 50% of its peak"),
    (dict(window_pattern="SL"),
     "--window_pattern=SL without --window changes nothing: every layer sees every position"),
    (dict(window=8, window_pattern="SLS"),
     "--window_pattern=SLS has more letters than n_layer = 2: those past it are unused"),
    (dict(window=8, window_pattern="SL"), None)], ids=["warmup", "no window", "long pattern", "none"])
def test_flags_that_run_but_do_less_than_they_say_are_warned_of(data_dir, tmp_path, capsys, overrides,
                                                                warning):
    """Each a warning line on stderr, the run done; flags that do what they say, none."""
    run = {"data_dir": data_dir, "out_dir": tmp_path / "out", "max_steps": 2, **overrides}
    assert train.main(flags(**run)) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == ([f"warning: {warning}"] if warning else []), warnings


@pytest.mark.parametrize("max_steps, warmup_steps", [(100, 10), (1000, 0), (50, 5)])
def test_the_schedule_warms_up_linearly_to_the_peak_then_decays_to_zero(max_steps, warmup_steps):
    """lr_multiplier's properties, whatever its shape after the warm-up (cosine, WSD, ...): every
    step's multiplier in (0, 1]; a linear rise of 1 / warmup_steps a step, the first step's included,
    to the peak, 1; then never rising, to 0 at max_steps, the step after the last."""
    cfg = recipe.TrainConfig(max_steps=max_steps, warmup_steps=warmup_steps)
    lr = np.array([train.lr_multiplier(step, cfg) for step in range(max_steps + 1)])
    assert (0 < lr[:-1]).all() and (lr <= 1).all()
    peak = max(warmup_steps, 1) - 1  # the step that first trains at the peak
    np.testing.assert_allclose(lr[:peak + 1], np.arange(1, peak + 2) / max(warmup_steps, 1))
    assert lr[peak] == 1 and (np.diff(lr[peak:]) <= 0).all() and lr[-1] == pytest.approx(0, abs=1e-12)


@pytest.mark.parametrize("grad_clip", [0.0, 0.01, 1e6])
def test_optimizer_step_clips_to_grad_clip_and_returns_the_norm_before(grad_clip):
    """The returned norm is sqrt(sum of every gradient entry squared), in float64; the step
    applies the gradients scaled by min(1, grad_clip / norm) (plain SGD of lr 1 shows them), or
    as they are with grad_clip 0."""
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, head_dim=8, n_embd=16)
    model = GPT(config).double()
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx)[1].backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    expected = math.sqrt(sum(g.pow(2).sum().item() for g in grads.values()))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    norm = recipe.optimizer_step(model, [sgd], recipe.TrainConfig(grad_clip=grad_clip))
    assert norm.item() == pytest.approx(expected, rel=1e-12)
    scale = min(1.0, grad_clip / (expected + 1e-6)) if grad_clip > 0 else 1.0  # torch's clip adds 1e-6
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), grads[name] * scale, rtol=1e-9, atol=1e-14)
        assert p.grad is None


def test_optimizers():
    cfg = recipe.TrainConfig(max_steps=100, warmup_steps=10)

    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, head_dim=16, n_embd=32,
                          attn="lrkv", lrkv_rank=4))
    newton_schulz, adamw = recipe.configure_optimizers(model, cfg)
    assert isinstance(newton_schulz, muon.Muon)
    blocks = {id(p) for p in model.blocks.parameters()}
    assert {id(p) for p in newton_schulz.param_groups[0]["params"]} == blocks
    groups = [[id(p) for p in g["params"]] for g in adamw.param_groups]
    assert groups == [[id(model.wte.weight)], [id(model.lm_head.weight)]]
    assert [g["lr"] for g in adamw.param_groups] == [0.2, 0.004]
    (only,) = recipe.configure_optimizers(model, recipe.TrainConfig(optimizer="adamw"))
    assert sum(len(g["params"]) for g in only.param_groups) == len(list(model.parameters()))
    # --ns_dtype pins Newton-Schulz's precision (config/demo.py: fp32 on every CPU); auto follows the device
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        assert recipe.configure_optimizers(model, recipe.TrainConfig(ns_dtype=name))[0].ns_dtype == dtype
    policy = hardware.precision("newton_schulz", "cpu")[0]
    assert recipe.configure_optimizers(model, cfg)[0].ns_dtype == policy
    assert recipe.parse_args(["config/demo.py", "config/demo_deep.py"])[1].ns_dtype == "float32"
    with pytest.raises(ValueError, match="ns_dtype"):
        recipe.TrainConfig(ns_dtype="float16")


def test_muon_in_bf16_matches_torch_muon():
    """Five steps on wide, tall and square matrices, two of each shape so that they are batched,
    with weight decay and Nesterov momentum. The momentum buffers are fp32 and must agree to fp32
    rounding. The weights may not: Newton-Schulz runs in bf16 (8 significant bits), and a product
    rounded differently (batched or not, fused multiply-add or not) moves entries of the
    orthogonalised update by about 1% of lr * sqrt(max(1, rows / cols)) (1.4% measured between
    this step and its inductor-compiled graph); allow 3% of it a step."""
    torch.manual_seed(0)
    shapes, steps, lr = [(32, 96), (32, 96), (96, 32), (96, 32), (48, 48), (48, 48)], 5, 0.02
    start = [torch.randn(shape) for shape in shapes]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    theirs = [torch.nn.Parameter(w.clone()) for w in start]
    opts = [muon.Muon(ours, lr=lr, weight_decay=0.1, momentum=0.9, nesterov=True, ns_dtype=torch.bfloat16),
            torch.optim.Muon(theirs, lr=lr, weight_decay=0.1, momentum=0.9, nesterov=True,
                             adjust_lr_fn="original")]
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        for opt in opts:
            opt.step()
    for p, q, w in zip(ours, theirs, start):
        torch.testing.assert_close(opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"])
        step_size = lr * max(1, p.size(0) / p.size(1)) ** 0.5
        assert (p - q).abs().max() < 0.03 * step_size * steps < (q - w).abs().max()


def reference_muon_step(W, G, B, lr, weight_decay, momentum):
    """One Muon step on one matrix, written from its definition (muon.Muon's docstring) in
    float64: B and W are updated in place."""
    B.mul_(momentum).add_(G, alpha=1 - momentum)
    X = (1 - momentum) * G + momentum * B
    tall = X.size(0) > X.size(1)
    X = X.T if tall else X
    X = X / max(torch.linalg.matrix_norm(X).item(), 1e-7)
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    X = X.T if tall else X
    W.mul_(1 - lr * weight_decay).sub_(lr * max(1, W.size(0) / W.size(1)) ** 0.5 * X)


def test_muon_in_fp32_matches_a_float64_reference():
    """The fp32 iteration (what a CPU without bf16 instructions runs) against the step written
    out in float64: five steps, batched shapes, weights to fp32 rounding of the update."""
    torch.manual_seed(0)
    shapes, steps, lr, wd, mu = [(32, 96), (32, 96), (96, 32), (48, 48), (48, 48)], 5, 0.02, 0.1, 0.9
    start = [torch.randn(shape) for shape in shapes]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    ref = [w.double() for w in start]
    bufs = [torch.zeros_like(w) for w in ref]
    opt = muon.Muon(ours, lr=lr, weight_decay=wd, momentum=mu, nesterov=True, ns_dtype=torch.float32)
    for _ in range(steps):
        for p, W, B in zip(ours, ref, bufs):
            p.grad = torch.randn(p.shape)
            reference_muon_step(W, p.grad.double(), B, lr, wd, mu)
        opt.step()
    for p, W, w in zip(ours, ref, start):
        step_size = lr * max(1, p.size(0) / p.size(1)) ** 0.5
        # the iteration amplifies fp32 rounding (its polynomial's slope reaches 3.4 near 0): 1e-4 of a
        # step per step, against the bf16 iteration's 3e-2
        assert (p.double() - W).abs().max() < 1e-4 * step_size * steps < (W - w).abs().max()


# a shape group of 1, of 3 and of 4 matrices: over two ranks, one rank idle, one padded, one even split
MUON_SHAPES = [(8, 4), (4, 8), (4, 8), (4, 8), (6, 6), (6, 6), (6, 6), (6, 6)]


def muon_steps():
    """Weights and optimizer state after three Muon steps on MUON_SHAPES, sharded if torch.distributed
    is up: every rank draws the same gradients, as DDP would hand them."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in MUON_SHAPES]
    opt = muon.Muon(params, lr=0.02)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    return [p.detach() for p in params], opt.state_dict()


def test_muon_sharded_over_two_gloo_processes_matches_one(tmp_path):
    (tmp_path / "shard.py").write_text(f"""
import sys, torch, torch.distributed as dist
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
import test_train
dist.init_process_group("gloo")
torch.save(test_train.muon_steps(), {str(tmp_path)!r} + f"/rank{{dist.get_rank()}}.pt")
dist.destroy_process_group()
""")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "shard.py"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (weights0, state0), (weights1, state1) = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
                                              for r in (0, 1)]
    weights, state = muon_steps()
    # the ranks share the very same new weights; against one process, Newton-Schulz ran on smaller
    # stacks, so allow test_muon_matches_torch_muon's bf16 bound (equal on the machines tried)
    bound = 3 * 0.03 * 0.02 * 2 ** 0.5  # 3 steps of 3% of the largest step size, the tall (8, 4)'s
    for p0, p1, p in zip(weights0, weights1, weights):
        assert torch.equal(p0, p1) and (p0 - p).abs().max() < bound
    for i in range(len(MUON_SHAPES)):  # every rank moves every momentum buffer, for rank 0's checkpoint
        for s in (state0, state1):
            assert torch.equal(s["state"][i]["momentum_buffer"], state["state"][i]["momentum_buffer"])


def test_a_kill_while_saving_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save_checkpoint(path, {"step": 1, "w": torch.ones(3)})
    # the child writes part of the new checkpoint, says so, and waits to be killed
    child = subprocess.Popen([sys.executable, "-c", f"""
import io, time, torch
from lib.training import checkpoint
from pathlib import Path
real_save = torch.save
def half_save(obj, f):
    buffer = io.BytesIO()
    real_save(obj, buffer)
    f.write(buffer.getvalue()[:200])
    f.flush()
    print("saving", flush=True)
    time.sleep(60)
torch.save = half_save
checkpoint.save_checkpoint(Path({str(path)!r}), {{"step": 2, "w": torch.zeros(1000)}})
"""], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "saving\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (tmp_path / "ckpt.pt.tmp").exists()
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["step"] == 1 and torch.equal(ckpt["w"], torch.ones(3))


def test_a_diverging_run_stops_and_keeps_its_last_checkpoint(data_dir, tmp_path, capsys):
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path, max_steps=2, eval_interval=2)) == 0
    kept = (tmp_path / "ckpt.pt").read_bytes()
    capsys.readouterr()
    diverging = flags(data_dir=data_dir, out_dir=tmp_path, max_steps=4, eval_interval=2, muon_lr="inf",
                      overwrite=True)
    assert train.main(diverging) == 1
    err = capsys.readouterr().err
    assert "the loss is nan; stopping" in err and "left as it was" in err
    assert (tmp_path / "ckpt.pt").read_bytes() == kept


@pytest.mark.parametrize("bad, message", [
    (["--n_layr=3"], "did you mean --n_layer"),
    (["--n_layer=two"], "--n_layer=two: expected int"),
    (["--attn=mhq"], "must be one of mha"),
    (["--optimizer=sgd"], "--optimizer='sgd': must be one of muon, adamw"),
    (["--data_dir=nowhere"], "python prepare_data.py"),
    (["--vocab_size=50304"], "--vocab_size=256"),
    (["--eval_tokens=100000"], "lower --eval_tokens"),
    (["--resume"], "to resume from"),
    (["--device=tpu"], "--device=tpu: not a device; valid: auto, cuda, mps, cpu"),
    (["--device=cpu:banana"], "--device=cpu:banana: not a device; valid: auto, cuda, mps, cpu"),
    ([f"--device={'mps' if torch.cuda.is_available() else 'cuda'}"], "not available on this machine; valid"),
    ([f"--seed={2**64}"], f"--seed={2**64}: must be between 0 and 2**64 - 1"),
])
def test_bad_input_is_one_line_and_writes_nothing(bad, message, data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main(flags(data_dir=data_dir, out_dir=out) + bad) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not out.exists()


def test_bad_preset_is_reported_from_the_command_line(data_dir, tmp_path):
    preset = tmp_path / "preset.py"
    preset.write_text("n_layer = 2\nlrkv_rank = 'four'\n")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "train.py", str(preset), *flags(data_dir=data_dir, out_dir=out)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"train.py: {preset}: lrkv_rank = 'four': expected int\n"
    assert not out.exists()


def test_presets_parse_and_the_gpu_preset_trains_at_reduced_size(data_dir, tmp_path):
    model, cfg = recipe.parse_args(["config/demo.py"])
    assert (model.n_head, model.n_embd, model.n_embd // model.head_dim) == (6, 96, 6)
    # the paper's ratios at the demo's head dim: LRKV r/d_h = 46/128, MLA d_c/d = 128/768
    assert model.lrkv_rank == round(46 / 128 * model.head_dim) and model.kv_lora_rank * 6 == model.n_embd
    model, cfg = recipe.parse_args(["config/gpu.py"])
    assert model == GPTConfig() and (cfg.batch_size, cfg.max_steps, cfg.out_dir) == (16, 8000, "out/mha")
    small = flags(data_dir=data_dir, out_dir=tmp_path, max_steps=2, eval_interval=2)
    assert train.main(["config/gpu.py", *small]) == 0
    assert sorted(records(tmp_path, "loss")) == [1, 2] and sorted(records(tmp_path, "val_loss")) == [2]


def test_init_from_starts_a_new_run_at_the_checkpoints_loss(data_dir, full_run, tmp_path):
    """An identity conversion (the same variant and shapes, weights copied whole) evaluates at
    step 0 to exactly the checkpoint's loss; a full-rank LRKV from MHA to it within the rounding of
    the run's dtype, from the weights alone or calibrated.
    The run then trains from there on a fresh schedule of its own."""
    source = tmp_path / "mha"
    assert train.main(flags(data_dir=data_dir, out_dir=source, attn="mha", max_steps=4, eval_interval=4)) == 0
    expected = torch.load(source / "ckpt.pt", weights_only=True)["val_loss"]
    for name, attn in (("same", dict(attn="mha")),
                       ("lrkv", dict(attn="lrkv", lrkv_rank=16, calibration_tokens=0)),
                       ("whitened", dict(attn="lrkv", lrkv_rank=16))):
        out = tmp_path / name
        assert train.main(flags(data_dir=data_dir, out_dir=out, max_steps=3, eval_interval=3,
                                init_from=source / "ckpt.pt", **attn)) == 0
        val = records(out, "val_loss")
        assert sorted(val) == [0, 3] and sorted(records(out, "loss")) == [1, 2, 3]
        # the full-rank conversion computes the same keys through other matmuls: equal up to rounding
        # in the eval's dtype, the policy's for training here (test_precision.py forces each)
        tol = 1e-5 if recipe.run_dtype(recipe.TrainConfig(), torch.device("cpu")) == "float32" else 5e-2
        close = val[0] == expected if name == "same" else abs(val[0] - expected) < tol
        assert close, (name, val[0], expected)
        ckpt = torch.load(out / "ckpt.pt", weights_only=True)
        assert ckpt["step"] == 3 and ckpt["config"]["init_from"] == str(source / "ckpt.pt")
    # its --resume jobs go on from their own checkpoint, given the same --init_from
    out = tmp_path / "split"
    split = flags(data_dir=data_dir, out_dir=out, max_steps=3, eval_interval=3, init_from=source / "ckpt.pt",
                  attn="mqa")
    assert train.main(split + ["--stop_after=2"]) == 0
    plain = flags(data_dir=data_dir, out_dir=out, max_steps=3, eval_interval=3, attn="mqa")
    assert train.main(plain + ["--resume"]) == 2
    assert train.main(split + ["--resume"]) == 0
    assert sorted(records(out, "loss")) == [1, 2, 3] and sorted(records(out, "val_loss")) == [0, 2, 3]


def test_calibration_records_the_normalised_inputs_each_attention_sees(data_dir):
    """attention_input_covariances against the hidden states written out block by block: layer
    l's C is X^T X / N of norm(x) entering block l, over 100 tokens rounded up to 4 windows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: v for k, v in TINY.items() if k in GPTConfig.__dataclass_fields__}))
    with torch.no_grad():
        # the init's zero output projections would make every layer's input alike
        for p in model.parameters():
            p.normal_(0, 0.3)
    shards = [read_shard(p) for p in shard_paths(data_dir, "train")]
    batches = TrainBatches(shards, 32)
    covariances = convert.attention_input_covariances(model, batches, 100, 3, 3, "cpu")
    windows = batches.get(3, 0, 4, 0, 1)[0]
    with torch.no_grad():
        # GPT normalises the embedding, then each block its input to the attention
        x, expected = F.rms_norm(model.double().wte(windows), (TINY["n_embd"],)), []
        for block in model.blocks:
            X = F.rms_norm(x, (TINY["n_embd"],)).flatten(0, 1)  # (4 * 32, d)
            expected.append(X.T @ X / len(X))
            x = block(x, model.rope.double())
    assert len(covariances) == len(expected) == TINY["n_layer"]
    for C, C_expected in zip(covariances, expected):
        assert C.dtype == torch.float64
        torch.testing.assert_close(C, C_expected, rtol=1e-5, atol=1e-6)


def test_calibration_changes_a_low_rank_conversion_and_zero_tokens_is_the_weights_alone(data_dir, full_run):
    cfg = recipe.TrainConfig(init_from=str(full_run / "ckpt.pt"), out_dir="unused", seed=1)
    source_args = torch.load(full_run / "ckpt.pt", weights_only=True)["model_args"]
    model_config = GPTConfig(**{**source_args, "lrkv_rank": 2})
    shards = [read_shard(p) for p in shard_paths(data_dir, "train")]
    batches = TrainBatches(shards, 32)
    source = checkpoint.load_checkpoint(full_run / "ckpt.pt", "cpu")[1]
    for tokens in (0, 256):
        cfg.calibration_tokens = tokens
        state = convert.load_init_checkpoint(cfg, model_config, batches, torch.device("cpu"))
        expected = GPT(model_config)
        covariances = None
        if tokens:
            covariances = convert.attention_input_covariances(source, batches, 256, 1, 16, "cpu")
        convert.convert(expected, source, covariances)
        assert all(torch.equal(state[k], v) for k, v in expected.state_dict().items()), tokens
        if not tokens:
            plain = state
    assert not torch.equal(state["blocks.0.attn.U_k.weight"], plain["blocks.0.attn.U_k.weight"])


def test_distill_loss_mixes_cross_entropy_with_the_kl_to_the_teachers_distribution():
    torch.manual_seed(0)
    config = GPTConfig(**{k: v for k, v in TINY.items() if k in GPTConfig.__dataclass_fields__})
    teacher, student = GPT(config), GPT(config)
    with torch.no_grad():
        # the init's zero W_o and near-zero lm_head would leave the distributions nearly uniform
        for p in [*teacher.parameters(), *student.parameters()]:
            p.normal_(0, 0.3)
    idx, targets = torch.randint(0, 256, (2, 2, 32))
    logits, cross_entropy = student(idx, targets)
    loss = convert.distill_loss(cross_entropy, logits, teacher, idx, 0.25)
    with torch.no_grad():
        p_teacher = torch.softmax(teacher(idx)[0].double(), dim=-1)
    kl = (p_teacher * (p_teacher.log() - torch.log_softmax(logits.double(), dim=-1))).sum(-1).mean()
    assert loss.item() == pytest.approx((0.75 * cross_entropy.double() + 0.25 * kl).item(), rel=1e-6)
    assert kl > 0.1  # the check above is not CE alone


def test_distilling_a_copy_of_the_teacher_costs_nothing_at_first(data_dir, tmp_path, capsys):
    """--distill=1 from an identical copy: the first step's loss, KL(p || p), is 0; a resumed job
    must keep --distill, and no --init_from means nothing to distil."""
    source = tmp_path / "mha"
    assert train.main(flags(data_dir=data_dir, out_dir=source, attn="mha", max_steps=4, eval_interval=4)) == 0
    distilled = flags(data_dir=data_dir, out_dir=tmp_path / "copy", attn="mha", max_steps=3, eval_interval=3,
                      init_from=source / "ckpt.pt", distill=1.0)
    assert train.main(distilled + ["--stop_after=2"]) == 0
    loss = records(tmp_path / "copy", "loss")
    assert loss[1] == pytest.approx(0, abs=1e-6) and loss[2] > 0  # a teacher of its own, which stays put
    assert train.main(distilled + ["--resume", "--distill=0.5"]) == 2
    assert train.main(distilled + ["--resume"]) == 0
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path / "none", distill=0.5)) == 2
    assert "--distill=0.5: must be 0 without --init_from" in capsys.readouterr().err


@pytest.mark.parametrize("problem, message", [
    ("missing", "No such file or directory"),
    ("junk", "not a PyTorch checkpoint"),
    ("wider", "n_embd = 32, this model 64"),
    ("mla", "MLA is not converted to"),
    ("its own", "is this run's own checkpoint"),
])
def test_a_bad_init_from_is_one_line_and_writes_nothing(problem, message, data_dir, full_run, tmp_path,
                                                        capsys):
    out = tmp_path / "out"
    init, extra = full_run / "ckpt.pt", {}
    if problem == "missing":
        init = tmp_path / "nowhere.pt"
    elif problem == "junk":
        init = tmp_path / "junk.pt"
        init.write_text("not a checkpoint")
    elif problem == "wider":
        extra = dict(n_embd=64, head_dim=32)
    elif problem == "mla":
        extra = dict(attn="mla", kv_lora_rank=8, rope_head_dim=8)
    elif problem == "its own":  # --overwrite: without it, the run that full_run holds refuses it first
        out, extra = full_run, dict(overwrite=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None
    assert train.main(flags(data_dir=data_dir, out_dir=out, init_from=init, **extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert ({p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None) == before


def test_resume_reads_a_checkpoint_written_before_init_from_existed(data_dir, tmp_path):
    """A checkpoint whose config lacks a later flag resumes as its run did before the flag (checkpoint.BEFORE:
    no --init_from); one from before digests (which this edit would not match) has none."""
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path, stop_after=STOP)) == 0
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    del ckpt["config"]["init_from"], ckpt["digest"]
    torch.save(ckpt, tmp_path / "ckpt.pt")
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path) + ["--resume"]) == 0
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == STEPS


def test_resume_refuses_a_checkpoint_lacking_a_flag_of_unknown_earlier_meaning(data_dir, tmp_path, capsys):
    """A checkpoint from before a flag existed (here one whose config lacks seed, or a model field) is not
    resumed as if it had the flag's default of today, which may mean something else than what that run
    did: one line names the field; a flag recorded in checkpoint.BEFORE resumes as that (init_from, above),
    a model field of checkpoint.MODEL_BEFORE as that (window: None, so --window=8 differs)."""
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path, stop_after=STOP)) == 0
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    del saved["digest"]
    for section, name, flag, says in (("config", "seed", [], "has no 'seed', a flag added since it was"),
                                      ("model_args", "window", ["--window=8"], "trained with window=None"),
                                      ("model_args", "rope_theta", [], "has no model field 'rope_theta'")):
        ckpt = {**saved, section: {k: v for k, v in saved[section].items() if k != name}}
        torch.save(ckpt, tmp_path / "ckpt.pt")
        capsys.readouterr()
        assert train.main(flags(data_dir=data_dir, out_dir=tmp_path) + flag + ["--resume"]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
        assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == STOP  # nothing written


# ---------------------------------------------------------------------------------------------
# What real machines do: full disks, two runs in one folder, torn logs, bad tokens, damaged files

@contextmanager
def small_disk(path, size, *options):
    """A tmpfs of size mounted at path, to fill; the test skips where it cannot mount one (not root)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs",
                            str(path)], capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        gc.collect()  # models in reference cycles may still map a checkpoint on it
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(disk):
    """Write disk full."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass


def flip_a_bit(path):
    """Flip one bit of the checkpoint at path, inside its token embedding, as a failing disk might."""
    weights = torch.load(path, weights_only=True)["model"]["wte.weight"].flatten()[:8].numpy().tobytes()
    data = bytearray(path.read_bytes())
    data[data.index(weights) + 3] ^= 0x10
    path.write_bytes(data)


def test_a_full_disk_stops_the_run_in_one_line_and_keeps_its_files_whole(data_dir, tmp_path, capsys):
    """A 640 kB disk holds the 411 kB checkpoint of step 5, not the second copy that saving step
    10's needs: the run stops there, the checkpoint of step 5 whole and no temporary file left.
    --resume there stops the same way; with the disk filled, it is refused before it begins."""
    with small_disk(tmp_path / "disk", "640k") as disk:
        out = disk / "run"
        ckpt = out / "ckpt.pt"
        for resume in ([], ["--resume"]):
            assert train.main(flags(data_dir=data_dir, out_dir=out) + resume) == 1
            assert capsys.readouterr().err == (f"train.py: {ckpt}: No space left on device; "
                                               "it is left as it was before this write\n")
            assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "log.jsonl"]
            assert checkpoint.load_checkpoint(ckpt)[0]["step"] == STOP
        fill(disk)
        log, saved = (out / "log.jsonl").read_bytes(), ckpt.read_bytes()
        assert train.main(flags(data_dir=data_dir, out_dir=out) + ["--resume"]) == 2
        assert capsys.readouterr().err == (f"train.py: --out_dir={out}: cannot write there: "
                                           "No space left on device\n")
        assert (out / "log.jsonl").read_bytes() == log and ckpt.read_bytes() == saved
        assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "log.jsonl"]


def test_a_full_disk_while_logging_leaves_the_log_whole(tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        checkpoint.log(disk, dict(step=1, loss=2.0), "step 1")
        fill(disk)
        whole = (disk / "log.jsonl").read_bytes()
        # more than the page that the last record left room in
        with pytest.raises(checkpoint.WriteError, match="log.jsonl: No space left on device; it is left as"):
            checkpoint.log(disk, dict(step=2, loss=1.0, note="x" * 10_000), "step 2")
        assert (disk / "log.jsonl").read_bytes() == whole
        with pytest.raises(checkpoint.WriteError, match="log.jsonl: No space left on device"):
            checkpoint.start_log(disk, 1)
        assert (disk / "log.jsonl").read_bytes() == whole and not (disk / "log.jsonl.tmp").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_while_saving_ends_the_run_in_one_line_and_keeps_the_checkpoint(signum, data_dir, tmp_path,
                                                                                 capsys, monkeypatch):
    """Ctrl-C, SIGTERM and SIGHUP (a closed terminal) in the middle of the second checkpoint's write, as
    run_main runs train.py: one line, exit code 128 + the signal's number (130 for Ctrl-C, not 0), the
    first checkpoint whole and no temporary file; handlers put back after. Where the run has none for
    SIGTERM or SIGHUP, the save says so instead of sending it (it would end the tests)."""
    real_save, saves = torch.save, []

    def half_save(obj, f):
        saves.append(obj["step"])
        if len(saves) == 1:
            return real_save(obj, f)
        assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN), "no handler: a kill"
        f.write(b"PK\x03\x04 half a checkpoint")
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises before this ends

    monkeypatch.setattr(torch, "save", half_save)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    try:
        code = configurator.run_main(lambda: train.main(flags(data_dir=data_dir, out_dir=tmp_path)))
    except KeyboardInterrupt:  # not run_main's: failed here, not as pytest's own Ctrl-C (the session's end)
        pytest.fail("Ctrl-C went through run_main as a KeyboardInterrupt")
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signum.name}"
    assert (code, saves, capsys.readouterr().err.splitlines()[-1]) == (128 + signum, [STOP, 2 * STOP],
                                                                       f"train.py: {said}")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == STOP
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "log.jsonl"]
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGHUP) == signal.SIG_DFL


def test_run_main_leaves_an_ignored_sighup_ignored():
    """nohup's SIGHUP stays ignored while a script runs: a closed terminal does not end it."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert configurator.run_main(lambda: signal.getsignal(signal.SIGHUP)) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_second_run_into_a_folder_in_use_is_refused(data_dir, tmp_path, capsys):
    """While one run trains into a folder, another, fresh or resumed, is refused with the holder's
    pid, and touches nothing; once the first is killed, the OS has let go of its lock."""
    out = tmp_path / "run"
    endless = flags(data_dir=data_dir, out_dir=out, max_steps=10**6, eval_interval=10**6)
    child = subprocess.Popen([sys.executable, "train.py", *endless], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        while not (line := child.stdout.readline()).startswith("step 1/"):
            assert line, "the first run ended before its first step"
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert train.main(flags(data_dir=data_dir, out_dir=out) + extra) == 2
            assert capsys.readouterr().err == (f"train.py: {out}: in use by another run (pid {child.pid}): "
                                               "wait for it to end, or give this one another --out_dir\n")
    finally:
        child.kill()
        child.wait()
    steps = [r["step"] for r in checkpoint.read_log(out)]
    assert steps == list(range(1, len(steps) + 1))  # the first run's log alone
    again = flags(data_dir=data_dir, out_dir=out, max_steps=2, eval_interval=2)
    assert train.main(again + ["--overwrite"]) == 0


def test_a_fresh_run_into_a_folder_holding_a_run_is_refused(data_dir, full_run, capsys):
    before = {p.name: p.read_bytes() for p in full_run.iterdir()}
    assert train.main(flags(data_dir=data_dir, out_dir=full_run)) == 2
    assert capsys.readouterr().err == (f"train.py: {full_run} holds a run (ckpt.pt, log.jsonl): --resume "
                                       "continues it, --overwrite starts it over, or give this one another "
                                       "--out_dir\n")
    assert {p.name: p.read_bytes() for p in full_run.iterdir()} == before


def test_an_out_dir_that_cannot_be_written_is_refused_first(data_dir, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("mine")
    assert train.main(flags(data_dir=data_dir, out_dir=file)) == 2
    assert capsys.readouterr().err == f"train.py: --out_dir={file}: not a folder\n"
    assert file.read_text() == "mine"
    with small_disk(tmp_path / "disk", "64k", "ro") as disk:
        assert train.main(flags(data_dir=data_dir, out_dir=disk / "run")) == 2
        assert capsys.readouterr().err == (f"train.py: --out_dir={disk / 'run'}: cannot write there: "
                                           "Read-only file system\n")


def test_resume_drops_a_torn_last_log_line_and_refuses_a_damaged_one(data_dir, full_run, tmp_path, capsys):
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path, stop_after=STOP)) == 0
    log = tmp_path / "log.jsonl"
    whole = log.read_text()
    log.write_text(whole.replace("\n", "\nnot json\n", 1))
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path) + ["--resume"]) == 2
    assert capsys.readouterr().err == f"train.py: {log}: line 2 is not JSON: 'not json'\n"
    log.write_text(whole + '{"step": 6, "loss": 5.1')  # a crash in mid-append
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path) + ["--resume"]) == 0
    assert capsys.readouterr().err == (f"note: {log}: dropped its last line, cut short by a crash while it "
                                       """was written: '{"step": 6, "loss": 5.1'\n""")
    expected, resumed = records(full_run, "loss"), records(tmp_path, "loss")
    assert sorted(resumed) == sorted(expected)
    assert all(abs(resumed[step] - expected[step]) < 1e-6 for step in expected)


def data_with_tokens_outside(data_dir, tmp_path, split, recorded):
    """A copy of data_dir whose split's shard holds token 1000 (the vocabulary is 256) from offset
    100 on. recorded: meta.json's largest_token says 255 for it, as a hand-edit might; else it
    records none, as data from before it was recorded."""
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    name = f"{split}_000000.bin"
    tokens = np.array(read_shard(bad / name))
    tokens[100:] = 1000
    write_shard(bad / name, tokens)
    meta = json.loads((bad / "meta.json").read_text())
    meta["largest_token"] = {name: 255} if recorded else {}
    (bad / "meta.json").write_text(json.dumps(meta))
    return bad, bad / name


@pytest.mark.parametrize("split, recorded", [("train", False), ("train", True), ("val", True)])
def test_tokens_outside_the_vocabulary_are_refused_naming_shard_and_offset(split, recorded, data_dir,
                                                                          tmp_path, capsys):
    """Refused on loading, from largest_token or by reading the shard (val: always read, every
    token of it is evaluated); a train shard whose record lies, by the batch that holds one, as
    --resume meets it at step 6, its checkpoint and log left whole."""
    out = tmp_path / "run"
    assert train.main(flags(data_dir=data_dir, out_dir=out, stop_after=STOP)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad, shard = data_with_tokens_outside(data_dir, tmp_path, split, recorded)
    capsys.readouterr()
    assert train.main(flags(data_dir=bad, out_dir=out) + ["--resume"]) == 2
    out_text, err = capsys.readouterr()
    offset = r"\d+" if split == "train" and recorded else "100"
    assert re.fullmatch(rf"train.py: {shard}: token 1000 at offset {offset} is outside the vocabulary of 256 "
                        rf"tokens: make the data again with `python prepare_data.py .*`\n", err), err
    if split == "train" and recorded:
        assert "step 6/" not in out_text and f"steps {STOP} -> {STEPS}" in out_text  # caught in the loop
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_damaged_checkpoint_is_refused_by_resume(data_dir, tmp_path, capsys):
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path, stop_after=STOP)) == 0
    ckpt = tmp_path / "ckpt.pt"
    flip_a_bit(ckpt)
    damaged = ckpt.read_bytes()
    capsys.readouterr()
    assert train.main(flags(data_dir=data_dir, out_dir=tmp_path) + ["--resume"]) == 2
    assert capsys.readouterr().err == (f"train.py: {ckpt}: damaged: its contents do not match the digest "
                                       "saved with them; restore it from a copy or train it again\n")
    assert ckpt.read_bytes() == damaged
