"""
Train one attention variant of model.py's GPT on token shards written by prepare_data.py.

    python train.py --attn=mqa                                  # the paper's 128M recipe (section 2)
    python train.py config/demo.py --attn=lrkv --lrkv_rank=4    # a preset file, then flags
    torchrun --standalone --nproc_per_node=8 train.py --attn=lrkv
    # sharded (docs/scaling.md)
    torchrun --standalone --nproc_per_node=8 train.py config/6.3b.py --attn=lrkv --fsdp
    python train.py --attn=mqa --resume                         # continue out_dir/ckpt.pt
    python train.py config/demo.py config/convert.py --init_from=out/demo/mha/ckpt.pt --attn=lrkv

Every field of model.py's GPTConfig and of TrainConfig (lib/training/recipe.py, with the optimisers
and the step) is a --name=value flag, and a positional argument is a preset, a Python file
assigning field names (configurator.py). The run prints its progress, writes the same records to
out_dir/log.jsonl for plotting (each evaluation's with every layer's effective rank, diversity.py),
and saves out_dir/ckpt.pt after every evaluation (checkpoint.py, which also says what a resumed run
must match). Read top-down: main (checks, then train), the loop, the schedule, the evaluation and
the in-loop tasks. lib/training/ holds the rest: data.py the shards, muon.py the optimiser,
parallel.py DDP and FSDP, hardware.py the device and precision; lib/attention/convert.py --init_from.
"""

import copy
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from lib.attention.convert import load_init_checkpoint
from lib.attention.diversity import no_head_maps, weight_ranks
from lib.attention.layout import kv_cache_elements_per_token
from lib.evaluation import downstream
from lib.training.checkpoint import (EVALS, WriteError, checkpoint_dict, claim_out_dir, load_checkpoint,
                                     load_resume_checkpoint, log, log_eval, restore, save_checkpoint,
                                     start_log)
from lib.training.configurator import ConfigError, run_main
from lib.training.data import get_tokenizer, load_data
from lib.training.hardware import check_environment, decoding_dtype, peak_flops, pick_device
from lib.training.parallel import gathered, process_group, world
from lib.training.recipe import (backward, build, evaluate, flops_per_token, optimizer_step, parse_args,
                                 precision_line, run_dtype)


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
        check_environment()
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
    flops_per_step = flops_per_token(raw_model, T) * tokens_per_step
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
              f"caching {kv_cache_elements_per_token(raw_model)} elements per token | "
              f"{world_size} x {device.type} ({parallel}{recompute}), {dtype}, compile {compile} | "
              f"{cfg.batch_size} x {T} = {tokens_per_step:,} tokens a step in {accum_steps} micro step(s) of "
              f"{micro_batch} per process | steps {step} -> {last_step} of {cfg.max_steps}", flush=True)
        if device.type == "cpu" and n_params > 100e6:
            print(f"warning: a {n_params / 1e6:.0f}M-parameter model on a CPU takes minutes a step; "
                  "config/demo.py is the preset for CPUs", file=sys.stderr)
        if model_config.window is None and model_config.window_pattern != "SSSL":  # GPTConfig's default
            print(f"warning: --window_pattern={model_config.window_pattern} without --window changes "
                  "nothing: every layer sees every position", file=sys.stderr)
        if model_config.window is not None and len(model_config.window_pattern) > model_config.n_layer:
            print(f"warning: --window_pattern={model_config.window_pattern} has more letters than n_layer = "
                  f"{model_config.n_layer}: those past it are unused", file=sys.stderr)
        missing = no_head_maps(raw_model)  # a variant that no table of heads.py lists
        if missing:
            print(f"note: {missing}; its evaluations log none", file=sys.stderr)
        if cfg.max_steps < cfg.warmup_steps:
            print(f"warning: max_steps = {cfg.max_steps} is below warmup_steps = {cfg.warmup_steps}: the lr "
                  f"ends at {lr_multiplier(cfg.max_steps - 1, cfg):.0%} of its peak", file=sys.stderr)

    if initial is not None:  # the converted model's loss is the first point of the run's curve
        val_loss, val_bpb = evaluate(model, val_tokens, bytes_per_token, T, micro_batch, autocast, rank,
                                     world_size)
        weights = gathered(raw_model.state_dict())  # every rank: under FSDP, gathering is a collective
        if is_main:
            log_eval(out_dir, 0, val_loss, val_bpb, weight_ranks(weights, model_config),
                     score_tasks(raw_model, tasks, cfg, device, meta["eot_id"]))

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
                         score_tasks(raw_model, tasks, cfg, device, meta["eot_id"]))
                save_checkpoint(ckpt_path, saved)
            t0, timed_steps = time.perf_counter(), 0
    return 0


# ---------------------------------------------------------------------------------------------
# The loop's pieces

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


@torch.no_grad()
def score_tasks(model, tasks, cfg, device, pad_id):
    """{name: {"metric", "value", "chance"}} of the model on tasks (load_eval_tasks'), None for no
    tasks. Scored as eval.py scores the checkpoint saved at this evaluation: the weights in the
    run's decoding dtype (hardware.decoding_dtype), without autocast, so the two are one number."""
    if not tasks:
        return None
    dtype = decoding_dtype(cfg.dtype, device)[0]
    scorer = model if dtype == model.lm_head.weight.dtype else copy.deepcopy(model).to(dtype)
    results = {name: downstream.evaluate_task(scorer, task, tokenized, pad_id=pad_id)
               for name, (task, tokenized) in tasks.items()}
    return {name: {key: r[key] for key in ("metric", "value", "chance")} for name, r in results.items()}


if __name__ == "__main__":
    sys.exit(run_main(main))
