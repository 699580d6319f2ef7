"""
Train one attention variant of model.py's GPT on token shards written by prepare_data.py.

    python train.py --attn=mqa                                  # the paper's 128M recipe (section 2)
    python train.py config/demo.py --attn=lrkv --lrkv_rank=4    # a preset file, then flags
    torchrun --standalone --nproc_per_node=8 train.py --attn=lrkv
    # sharded (docs/scaling.md)
    torchrun --standalone --nproc_per_node=8 train.py config/6.3b.py --attn=lrkv --fsdp
    python train.py --attn=mqa --resume                         # continue out_dir/ckpt.pt
    python train.py config/demo.py config/convert.py --init_from=out/demo/mha/ckpt.pt --attn=lrkv

Every field of ModelConfig (lib/variants.py: model.py's GPTConfig and the rivals' knobs) and of
TrainConfig (below) is a --name=value flag, and a positional argument is a preset, a Python file
assigning field names (configurator.py). The run
prints its progress, writes the same records to out_dir/log.jsonl for plotting (each evaluation's
with every layer's effective rank, diversity.py), and saves out_dir/ckpt.pt after every
evaluation (checkpoint.py, which also says what a resumed run must match). Read top-down: the
config, main (checks, then train), the loop, its pieces (optimisers, schedule, backward,
evaluation) and the data. The rest lives beside it: muon.py the optimiser, parallel.py DDP
and FSDP, convert.py --init_from, hardware.py the device and precision.
"""

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lib import configurator, downstream
from lib.checkpoint import (EVALS, WriteError, checkpoint_dict, claim_out_dir, load_checkpoint,
                            load_resume_checkpoint, log, log_eval, restore, save_checkpoint, start_log)
from lib.configurator import SEED_LIMIT, ConfigError
from lib.convert import CALIBRATION_TOKENS, distill_loss, load_init_checkpoint
from lib.diversity import weight_ranks
from lib.hardware import PRECISION_NAMES, check_device, forced_precision, peak_flops, pick_device, precision
from lib.muon import Muon
from lib.parallel import gathered, is_shard, no_sync, parallelize, process_group, world
from lib.variants import ModelConfig
from model import GPT
from prepare_data import TOKENIZERS, TrainBatches, get_tokenizer, load_meta, read_shards, token_bytes


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = "data/fineweb-edu-gpt2"
    out_dir: str = ""  # where ckpt.pt and log.jsonl go; "": out/<attn>
    resume: bool = False  # continue out_dir/ckpt.pt, given the run's flags again (but JOB_FLAGS)
    overwrite: bool = False  # a fresh run into an out_dir that holds a run: start over, replacing its files
    init_from: str = ""  # a new run whose weights come from this checkpoint, attention converted to --attn
    # --init_from converts each layer's keys and values to be closest on the attention inputs that
    # the checkpoint's model sees in this many training tokens; 0: closest in the weights alone
    calibration_tokens: int = CALIBRATION_TOKENS
    # --init_from: the loss is (1 - distill) CE + distill KL(p_source || p_model) per token, p_source
    # the next-token distribution of the checkpoint's model, frozen; 0: CE alone. Each step costs a
    # forward pass more (1.3x on the demo's CPU): at equal time 0.5 with 46 steps beat CE with 60
    # in docs/convert.md.
    distill: float = 0.0
    # batch and budget: the paper's 16 sequences of 2048 tokens, 32,768 tokens a step
    batch_size: int = 16  # sequences per optimizer step, over all devices together
    micro_batch_size: int = 16  # most sequences a device holds at once; gradient accumulation fills the step
    max_steps: int = 3_051_758  # the token budget: the paper's 100B tokens / 32,768 tokens a step
    # stop after this step, checkpointed, on max_steps' schedule, for --resume to go on; 0: don't
    stop_after: int = 0
    # optimisation
    # muon: Muon for the blocks' matrices, AdamW for wte and lm_head; adamw: AdamW for all
    optimizer: str = "muon"
    muon_lr: float = 0.02
    adamw_lr: float = 0.003  # the blocks' matrices under --optimizer=adamw; not tuned
    embedding_lr: float = 0.2  # AdamW, wte
    unembedding_lr: float = 0.004  # AdamW, lm_head
    weight_decay: float = 0.1  # decoupled, every parameter in both optimizers
    grad_clip: float = 1.0  # largest global gradient norm; 0: no clipping
    warmup_steps: int = 2000
    # evaluation and logging
    eval_interval: int = 5000  # steps between evaluations (and checkpoints); the last step always gets one
    # the fixed validation slice, in whole block_size windows from the start of the val split
    eval_tokens: int = 2**21
    log_interval: int = 100
    # downstream tasks scored at every evaluation into log.jsonl, as OLMo scores its in-loop ones: eval.py's
    # short names, comma-separated (lib/downstream.py), each on its first eval_tasks_limit documents (0: all)
    eval_tasks: str = ""
    eval_tasks_limit: int = 0
    # system
    seed: int = 0
    device: str = "auto"  # auto: cuda, then mps, then cpu
    dtype: str = "auto"  # bfloat16 (autocast) or float32; auto: hardware.precision's for training here
    ns_dtype: str = "auto"  # Muon's Newton-Schulz: bfloat16 or float32; auto: hardware.precision's
    compile: bool | None = None  # torch.compile; None: on CUDA only
    # under torchrun, shard weights, gradients and optimizer states over the processes (FSDP2)
    fsdp: bool = False
    # keep each block's input only and recompute the block in the backward
    checkpoint_activations: bool = False

    def __post_init__(self):
        def bad(field, allowed):
            raise ValueError(f"--{field}={getattr(self, field)!r}: must be {allowed}")

        for field in ("batch_size", "micro_batch_size", "max_steps", "eval_interval", "eval_tokens",
                      "log_interval"):
            if getattr(self, field) < 1:
                bad(field, "a positive integer")
        for field in ("stop_after", "eval_tasks_limit", "calibration_tokens", "warmup_steps", "muon_lr",
                      "adamw_lr", "embedding_lr", "unembedding_lr", "weight_decay", "grad_clip"):
            if not getattr(self, field) >= 0:  # `not >=` also refuses nan
                bad(field, "zero or more")
        if not 0 <= self.seed < SEED_LIMIT:
            bad("seed", "between 0 and 2**64 - 1")
        check_device(self.device)
        for field, allowed in (("optimizer", ("muon", "adamw")), ("dtype", ("auto", "bfloat16", "float32")),
                               ("ns_dtype", ("auto", "bfloat16", "float32"))):
            if getattr(self, field) not in allowed:
                bad(field, "one of " + ", ".join(allowed))
        if not 0 <= self.distill <= 1:
            bad("distill", "between 0 and 1")
        if self.distill and not self.init_from:
            bad("distill", "0 without --init_from, whose model it distils")


def parse_args(argv):
    """(ModelConfig, TrainConfig) from the defaults, then preset files in order, then --name=value flags."""
    model_config, cfg = configurator.parse(argv, ModelConfig, TrainConfig)
    cfg.out_dir = cfg.out_dir or f"out/{model_config.attn}"
    return model_config, cfg


# ---------------------------------------------------------------------------------------------
# The run

def main(argv=None):
    """Check everything, then train, out_dir held by rank 0, which alone writes (claim_out_dir); the
    exit code: 0 done, 1 the loss diverged or a write failed (WriteError), 2 bad input."""
    rank, local_rank, world_size = world()
    try:
        model_config, cfg = parse_args(sys.argv[1:] if argv is None else argv)
        if cfg.batch_size % world_size:
            raise ConfigError(f"--batch_size={cfg.batch_size} does not split over {world_size} processes")
        micro_batch = min(cfg.micro_batch_size, cfg.batch_size // world_size)
        if cfg.batch_size // world_size % micro_batch:
            per_process = cfg.batch_size // world_size
            raise ConfigError(f"--micro_batch_size={micro_batch} does not divide the {per_process} sequences "
                              f"each of {world_size} processes takes a step")
        if cfg.fsdp and world_size == 1:
            raise ConfigError("--fsdp shards the model over torchrun's processes: run it under torchrun")
        # every FSDP forward all-gathers weights, which all ranks must join: each evaluates as many windows
        windows = cfg.eval_tokens // model_config.block_size
        if cfg.fsdp and windows % world_size:
            raise ConfigError(f"--fsdp: the {windows} validation windows of --eval_tokens={cfg.eval_tokens} "
                              f"do not split evenly over {world_size} processes")
        forced_precision()
        with claim_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite) if rank == 0 else nullcontext():
            data = load_data(cfg, model_config)
            tasks = load_eval_tasks(cfg, data[0]) if rank == 0 else {}
            device = pick_device(cfg.device, local_rank)
            resumed = load_resume_checkpoint(cfg, model_config) if cfg.resume else None
            # --init_from seeds a run's first job; its --resume jobs go on from their own checkpoint
            initial = (load_init_checkpoint(cfg, model_config, data[1], device)
                       if cfg.init_from and not cfg.resume else None)
            # the model that --distill distils, in every job of the run
            teacher = load_checkpoint(cfg.init_from, device)[1].eval() if cfg.distill else None
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with process_group(device, world_size):
                return train(model_config, cfg, data, device, resumed, initial, micro_batch, rank, world_size,
                             teacher, tasks)
    except ConfigError as e:  # bad input, found before training or (a token outside the vocabulary) in it
        if rank == 0:
            print(f"train.py: {e}", file=sys.stderr)
        return 2
    except WriteError as e:  # rank 0's alone; the other ranks stop with it, as torchrun stops them
        print(f"train.py: {e}", file=sys.stderr)
        return 1


def train(model_config, cfg, data, device, resumed, initial, micro_batch, rank, world_size, teacher=None,
          tasks=None):
    """Train up to step min(max_steps, stop_after) from load_checkpoint's (ckpt, model) to resume,
    or from the weights of load_init_checkpoint, or (both None) from the start, distilling teacher
    (--distill) if given, scoring tasks (load_eval_tasks') at every evaluation; the exit code."""
    meta, batches, val_tokens, bytes_per_token = data
    is_main = rank == 0
    dtype = run_dtype(cfg, device)
    compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the matmuls autocast leaves in fp32
    torch.manual_seed(cfg.seed)
    raw_model, model, train_model, optimizers = build(model_config, cfg, device, world_size, dtype, compile,
                                                      initial)
    step, evals = 0, dict.fromkeys(EVALS)
    if resumed is not None:
        step, evals = restore(resumed, raw_model, optimizers, device)
    bytes_per_token = bytes_per_token.to(device)

    T = model_config.block_size
    accum_steps = cfg.batch_size // world_size // micro_batch
    tokens_per_step = cfg.batch_size * T
    last_step = min(cfg.max_steps, cfg.stop_after or cfg.max_steps)
    flops_per_step = raw_model.flops_per_token(T) * tokens_per_step
    peak = peak_flops(device)
    out_dir, ckpt_path = Path(cfg.out_dir), Path(cfg.out_dir) / "ckpt.pt"
    if is_main:
        start_log(out_dir, step if resumed is not None else None)
        muon = cfg.optimizer == "muon"
        print(f"precision: {precision_line(cfg, device, dtype, optimizers[0].ns_dtype if muon else None)}",
              flush=True)
        n_params = raw_model.get_num_params()
        parallel = "FSDP" if cfg.fsdp else "DDP" if world_size > 1 else "one process"
        recompute = ", activation checkpointing" if cfg.checkpoint_activations else ""
        print(f"{model_config.attn}: {n_params / 1e6:.1f}M parameters, {model_config.n_layer} layers "
              f"caching {raw_model.kv_cache_elements_per_token()} elements per token | "
              f"{world_size} x {device.type} ({parallel}{recompute}), {dtype}, compile {compile} | "
              f"{cfg.batch_size} x {T} = {tokens_per_step:,} tokens a step in {accum_steps} micro step(s) of "
              f"{micro_batch} per process | steps {step} -> {last_step} of {cfg.max_steps}", flush=True)
        if device.type == "cpu" and n_params > 100e6:
            print(f"warning: a {n_params / 1e6:.0f}M-parameter model on a CPU takes minutes a step; "
                  "config/demo.py is the preset for CPUs", file=sys.stderr)
        if cfg.max_steps < cfg.warmup_steps:
            print(f"warning: max_steps = {cfg.max_steps} is below warmup_steps = {cfg.warmup_steps}: the lr "
                  f"ends at {lr_multiplier(cfg.max_steps - 1, cfg):.0%} of its peak", file=sys.stderr)

    if initial is not None:  # the converted model's loss is the first point of the run's curve
        val_loss, val_bpb = evaluate(model, val_tokens, bytes_per_token, T, micro_batch, autocast, rank,
                                     world_size)
        weights = gathered(raw_model.state_dict())  # every rank: under FSDP, gathering is a collective
        if is_main:
            log_eval(out_dir, 0, val_loss, val_bpb, weight_ranks(weights, model_config),
                     score_tasks(raw_model, tasks, autocast, meta["eot_id"]))

    # timings average over each log interval; on CUDA the first one includes torch.compile's compiling
    t0, timed_steps = time.perf_counter(), 0
    while step < last_step:
        lr_mult = lr_multiplier(step, cfg)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_mult
        x, y = batches.get(cfg.seed, step, cfg.batch_size, rank, world_size)
        loss = backward(train_model, x, y, micro_batch, autocast, device, teacher, cfg.distill)
        if world_size > 1:
            dist.all_reduce(loss)
            loss /= world_size
        loss = loss.item()  # the same on every rank, so all of them stop together
        if not math.isfinite(loss):
            if is_main:
                print(f"train.py: step {step + 1}: the loss is {loss}; stopping, {ckpt_path} left as it was",
                      file=sys.stderr)
            return 1
        optimizer_step(raw_model, optimizers, cfg)
        step += 1
        timed_steps += 1

        if is_main and (step % cfg.log_interval == 0 or step == last_step):
            seconds = (time.perf_counter() - t0) / timed_steps
            mfu = flops_per_step / seconds / (peak * world_size) if peak else None
            record = dict(step=step, loss=loss, lr=optimizers[0].param_groups[0]["lr"],
                          ms_per_step=1000 * seconds, tokens_per_s=tokens_per_step / seconds, mfu=mfu)
            log(out_dir, record, progress_line(record, cfg.max_steps))
            t0, timed_steps = time.perf_counter(), 0

        if step % cfg.eval_interval == 0 or step == last_step:
            val_loss, val_bpb = evaluate(model, val_tokens, bytes_per_token, T, micro_batch, autocast,
                                         rank, world_size)
            if not math.isfinite(val_loss):
                if is_main:
                    print(f"train.py: step {step}: the validation loss is {val_loss}; stopping, "
                          f"{ckpt_path} left as it was", file=sys.stderr)
                return 1
            best = [math.inf if evals[k] is None else evals[k] for k in ("best_val_loss", "best_val_bpb")]
            evals = dict(val_loss=val_loss, val_bpb=val_bpb,
                         best_val_loss=min(val_loss, best[0]), best_val_bpb=min(val_bpb, best[1]))
            # every rank: under FSDP, gathering the shards to rank 0 is a collective
            saved = checkpoint_dict(raw_model, model_config, cfg, optimizers, step, evals, meta, device)
            if is_main:  # the heads' diversity from the weights just gathered: no collective of its own
                log_eval(out_dir, step, val_loss, val_bpb, weight_ranks(saved["model"], model_config),
                         score_tasks(raw_model, tasks, autocast, meta["eot_id"]))
                save_checkpoint(ckpt_path, saved)
            t0, timed_steps = time.perf_counter(), 0
    return 0


# ---------------------------------------------------------------------------------------------
# The loop's pieces

def build(model_config, cfg, device, world_size, dtype, compile, initial=None):
    """What a run trains, before a checkpoint is restored into it: (raw_model, model, train_model,
    optimizers), raw_model the GPT (its weights from initial, a state_dict, if given), model what
    evaluates and train_model what trains (parallel.parallelize)."""
    # every rank draws the whole model, so that a sharded run starts where one process would
    raw_model = GPT(model_config).to(device)
    if initial is not None:
        raw_model.load_state_dict(initial)
    model, train_model = parallelize(raw_model, device, world_size, dtype, compile, cfg.fsdp,
                                     cfg.checkpoint_activations)
    return raw_model, model, train_model, configure_optimizers(raw_model, cfg)


def configure_optimizers(model, cfg, ns_dtype=None):
    """The paper's optimisers: Muon for every matrix inside the blocks, AdamW with their own lrs for
    the token embedding and the unembedding; --optimizer=adamw moves the blocks' matrices to AdamW at
    adamw_lr. The paper's AdamW lrs are kept as they are: nanochat's (n_embd / 768) ** -0.5 scaling
    of them is 1 at the 128M width, and the paper does not say it applies it elsewhere.
    Each param group's initial_lr is the peak that the schedule scales; Muon's Newton-Schulz runs in
    ns_dtype (a torch.dtype) if given, else in cfg.ns_dtype."""
    matrices = list(model.blocks.parameters())
    if len(matrices) + 2 != len(list(model.parameters())):
        raise ValueError("GPT has parameters outside wte, lm_head and the blocks: configure_optimizers "
                         "misses them")
    adamw_groups = [dict(params=[model.wte.weight], lr=cfg.embedding_lr),
                    dict(params=[model.lm_head.weight], lr=cfg.unembedding_lr)]
    adamw = dict(betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=model.wte.weight.is_cuda)
    if cfg.optimizer == "adamw":
        optimizers = [torch.optim.AdamW([dict(params=matrices, lr=cfg.adamw_lr), *adamw_groups], **adamw)]
    else:
        # Muon scales the orthogonalised update by sqrt(max(1, rows / cols)), Keller Jordan's
        # adjustment (torch.optim.Muon's adjust_lr_fn="original"), so lr 0.02 moves a square matrix
        # by 0.02 times an orthogonal matrix, the convention of modded-nanogpt and nanochat that
        # the paper's 0.02 comes from. Weight decay multiplies each matrix by 1 - lr * weight_decay
        # a step, with the unadjusted lr.
        if ns_dtype is None and cfg.ns_dtype != "auto":
            ns_dtype = getattr(torch, cfg.ns_dtype)
        muon = Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)
        optimizers = [muon, torch.optim.AdamW(adamw_groups, **adamw)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def lr_multiplier(step, cfg):
    """Linear warm-up to 1 over warmup_steps, then a cosine down to 0 at max_steps (step counts from 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * progress))


# How each field of the step's record reads in its printed line (log.jsonl holds the record whole);
# a field not named here prints as "name value"
LINE_FORMATS = dict(loss="loss {:.4f}", lr="lr {:.2e}", ms_per_step="{:.1f} ms/step",
                    tokens_per_s="{:,.0f} tok/s", mfu="MFU {:.1%}")


def progress_line(record, max_steps):
    """The printed line of a step's record: "step s/max_steps | loss ... | ...", a field at a time."""
    fields = [LINE_FORMATS.get(name, name + " {:.4g}").format(value) for name, value in record.items()
              if name != "step" and value is not None]
    return " | ".join([f"step {record['step']}/{max_steps}", *fields])


def optimizer_step(model, optimizers, cfg):
    """Clip the global gradient norm to grad_clip (0: no clip), step every optimizer and clear the
    gradients. Returns the norm before the clip, a 0-dim tensor, the same on every rank."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if is_shard(norm):  # FSDP: each rank's norm is of its shards; their sum, once, for every rank
        norm = norm.full_tensor()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norm


def backward(train_model, x, y, micro_batch, autocast, device, teacher=None, distill=0.0):
    """Forward and backward over x, y (this rank's share of a step) in micro-batches, accumulating
    the gradients of their mean loss (distill_loss's with a teacher); that loss, detached."""
    accum_steps = len(x) // micro_batch
    loss = torch.zeros((), device=device)
    for i in range(accum_steps):
        micro = slice(i * micro_batch, (i + 1) * micro_batch)
        with no_sync(train_model, last=i == accum_steps - 1):
            with autocast:
                logits, micro_loss = train_model(x[micro].to(device), y[micro].to(device))
                if teacher is not None:
                    micro_loss = distill_loss(micro_loss, logits, teacher, x[micro].to(device), distill)
                del logits  # freed before the backward, which does not need them
            (micro_loss / accum_steps).backward()
        loss += micro_loss.detach() / accum_steps
    return loss


def run_dtype(cfg, device):
    """The run's --dtype, "bfloat16" (autocast) or "float32"; auto: the precision policy's for training."""
    return cfg.dtype if cfg.dtype != "auto" else str(precision("train", device)[0]).removeprefix("torch.")


def precision_line(cfg, device, dtype, ns_dtype):
    """What the run computes in and why: for each use, the policy's reason, or the flag that set it."""
    uses = [("bf16 autocast" if dtype == "bfloat16" else "fp32", "train", cfg.dtype, "--dtype")]
    if ns_dtype is not None:
        ns = f"Newton-Schulz in {PRECISION_NAMES[ns_dtype]}"
        uses.append((ns, "newton_schulz", cfg.ns_dtype, "--ns_dtype"))
    return ", ".join(f"{what} ({precision(use, device)[1] if value == 'auto' else flag})"
                     for what, use, value, flag in uses)


@torch.no_grad()
def evaluate(model, val_tokens, bytes_per_token, block_size, batch_size, autocast, rank, world_size):
    """(mean cross-entropy in nats per token, bits per byte) on the fixed validation slice: its
    consecutive block_size windows, shared out among the ranks. BPB is the summed nats over the
    summed UTF-8 bytes of the target tokens, times 1 / ln 2, with the zero-byte end-of-text token
    left out of both sums, so that it compares across tokenizers."""
    device = bytes_per_token.device
    windows = val_tokens.unfold(0, block_size + 1, block_size)
    totals = torch.zeros(3, dtype=torch.float64)  # nats, nats of byte-carrying targets, bytes
    mine = windows[rank::world_size]
    for i in range(0, len(mine), batch_size):
        batch = mine[i:i + batch_size].to(device)
        with autocast:
            logits, _ = model(batch[:, :-1])
        targets = batch[:, 1:].flatten()
        nats = F.cross_entropy(logits.flatten(0, 1), targets, reduction="none")
        nbytes = bytes_per_token[targets]
        totals += torch.stack([nats.sum(), (nats * (nbytes > 0)).sum(), nbytes.sum()]).cpu().double()
    if world_size > 1:
        totals = totals.to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
    nats, byte_nats, nbytes = totals.tolist()
    return nats / (len(windows) * block_size), byte_nats / (math.log(2) * nbytes)


def load_eval_tasks(cfg, meta):
    """--eval_tasks' tasks in the data's tokens: {name: (Task, Tokenized)}, {} for none; a ConfigError
    (an unknown task, the package missing) before anything trains."""
    names = [name.strip() for name in cfg.eval_tasks.split(",") if name.strip()]
    if names and cfg.fsdp:
        raise ConfigError("--eval_tasks: rank 0 scores the tasks alone, which a model sharded by --fsdp "
                          "cannot")
    if not names:
        return {}
    root, tokenizer = downstream.package_dir(), get_tokenizer(meta["tokenizer"])
    tasks = {name: downstream.load_task(name, cfg.eval_tasks_limit, root) for name in dict.fromkeys(names)}
    return {name: (task, downstream.tokenize(task, tokenizer)) for name, task in tasks.items()}


def score_tasks(model, tasks, autocast, pad_id):
    """{name: {"metric", "value", "chance"}} of the model on tasks (load_eval_tasks'), in the run's precision;
    None for no tasks."""
    if not tasks:
        return None
    with autocast:
        results = {name: downstream.evaluate_task(model, task, tokenized, pad_id=pad_id)
                   for name, (task, tokenized) in tasks.items()}
    return {name: {key: r[key] for key in ("metric", "value", "chance")} for name, r in results.items()}


# ---------------------------------------------------------------------------------------------
# The data

def load_data(cfg, model_config):
    """meta.json, the train batches, the validation slice and each token's UTF-8 length, or a
    ConfigError that says what to run."""
    try:
        meta = load_meta(cfg.data_dir)
        train, val = read_shards(cfg.data_dir, "train"), read_shards(cfg.data_dir, "val")
        bytes_per_token = torch.from_numpy(token_bytes(meta["tokenizer"])).float()
    except (OSError, ValueError) as e:  # no data, or a damaged gpt2.tiktoken
        raise ConfigError(str(e)) from None
    # the model's vocabulary may pad the data's to a multiple of 128 (GPT-2: 50257 -> 50304), no more
    data_vocab, model_vocab = meta["vocab_size"], model_config.vocab_size
    padded = -(-data_vocab // 128) * 128
    if not data_vocab <= model_vocab <= padded:
        raise ConfigError(
            f"{cfg.data_dir} holds {meta['tokenizer']} tokens (vocabulary {data_vocab}), "
            f"the model has --vocab_size={model_vocab}: "
            f"pass --vocab_size={padded} for this data, or make data in the model's vocabulary with "
            f"`python prepare_data.py --tokenizer=...` (one of {', '.join(TOKENIZERS)}) and point --data_dir "
            "at it")
    T = model_config.block_size
    batches = TrainBatches(train, T, data_vocab)
    if not len(train) or batches.ends[-1] == 0:
        raise ConfigError(f"{cfg.data_dir}: no train shard holds block_size + 1 = {T + 1} tokens")
    if cfg.eval_tokens < T:
        raise ConfigError(f"--eval_tokens={cfg.eval_tokens}: must be at least block_size = {T}")
    needed = cfg.eval_tokens // T * T + 1
    parts, have = [], 0
    for shard in val:
        parts.append(shard[:needed - have])
        have += len(parts[-1])
    if have < needed:
        raise ConfigError(f"{cfg.data_dir}: the val split holds {have} tokens, "
                          f"--eval_tokens={cfg.eval_tokens} needs {needed}: lower --eval_tokens")
    val_tokens = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    return meta, batches, val_tokens, bytes_per_token


if __name__ == "__main__":
    sys.exit(main())
