"""
Train one attention variant of model.py's GPT on token shards written by prepare_data.py.

    python train.py --attn=mqa                                  # the paper's 128M recipe (section 2)
    python train.py config/demo.py --attn=lrkv --lrkv_rank=4    # a preset file, then flags
    torchrun --standalone --nproc_per_node=8 train.py --attn=lrkv
    # sharded (docs/scaling.md)
    torchrun --standalone --nproc_per_node=8 train.py config/6.3b.py --attn=lrkv --fsdp
    python train.py --attn=mqa --resume                         # continue out_dir/ckpt.pt
    python train.py config/demo.py config/convert.py --init_from=out/demo/mha/ckpt.pt --attn=lrkv

Every field of GPTConfig (model.py) and TrainConfig (below) is a --name=value flag. A positional
argument is a preset: a Python file assigning field names, applied before the flags.
The run prints its progress, writes the same records to out_dir/log.jsonl for plotting, and
saves out_dir/ckpt.pt after every evaluation.
"""

import dataclasses
import difflib
import functools
import gc
import json
import math
import os
import pickle
import sys
import time
import typing
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from model import GPT, GPTConfig
from prepare_data import TOKENIZERS, atomic_open, load_meta, read_shard, shard_paths, token_bytes


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = "data/fineweb-edu-gpt2"
    out_dir: str = ""  # where ckpt.pt and log.jsonl go; "": out/<attn>
    resume: bool = False  # continue out_dir/ckpt.pt; give the run's flags again (RESUME_FLAGS must match)
    init_from: str = ""  # a new run whose weights come from this checkpoint, attention converted to --attn
    # --init_from converts each layer's keys and values to be closest on the attention inputs that
    # the checkpoint's model sees in this many training tokens (attention_input_covariances); 0:
    # closest in the weights alone. 65,536 are 32 of the paper's 2048-token sequences, ~85 tokens
    # a dimension of the 128M model's 768-wide input (SVD-LLM calibrates Llama-7B's 4096 on
    # 256 x 2048, ~128), for one forward pass over two of its training steps' tokens.
    calibration_tokens: int = 65_536
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
    # system
    seed: int = 0
    device: str = "auto"  # auto: cuda, then mps, then cpu
    dtype: str = "auto"  # bfloat16 (autocast) or float32; auto: native_dtype's choice for the device
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
        for field in ("stop_after", "calibration_tokens", "warmup_steps", "seed", "muon_lr", "adamw_lr",
                      "embedding_lr", "unembedding_lr", "weight_decay", "grad_clip"):
            if not getattr(self, field) >= 0:  # `not >=` also refuses nan
                bad(field, "zero or more")
        for field, allowed in (("optimizer", ("muon", "adamw")), ("device", ("auto", "cuda", "mps", "cpu")),
                               ("dtype", ("auto", "bfloat16", "float32"))):
            if getattr(self, field) not in allowed:
                bad(field, "one of " + ", ".join(allowed))
        if not 0 <= self.distill <= 1:
            bad("distill", "between 0 and 1")
        if self.distill and not self.init_from:
            bad("distill", "0 without --init_from, whose model it distils")


class ConfigError(Exception):
    """A bad flag, preset, data folder or checkpoint: reported as one line before anything is written."""


# ---------------------------------------------------------------------------------------------
# The run

def main(argv=None):
    """Check everything, then train; the exit code: 0 done, 1 the loss diverged, 2 bad input."""
    # torchrun's environment; a plain `python train.py` is rank 0 of 1
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
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
        data = load_data(cfg, model_config)
        device = pick_device(cfg.device, local_rank)
        resumed = load_resume_checkpoint(cfg, model_config) if cfg.resume else None
        # --init_from seeds a run's first job; its --resume jobs go on from their own checkpoint
        initial = (load_init_checkpoint(cfg, model_config, data[1], device)
                   if cfg.init_from and not cfg.resume else None)
        # the model that --distill distils, in every job of the run
        teacher = load_checkpoint(cfg.init_from, device)[1].eval() if cfg.distill else None
    except ConfigError as e:
        if rank == 0:
            print(f"train.py: {e}", file=sys.stderr)
        return 2

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # a caller may hold the process group already (test_fsdp.py runs several jobs in one torchrun
    # launch): a group made anew under torchrun's store would meet the keys the last one left there
    if world_size == 1 or dist.is_initialized():
        return train(model_config, cfg, data, device, resumed, initial, micro_batch, rank, world_size,
                     teacher)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return train(model_config, cfg, data, device, resumed, initial, micro_batch, rank, world_size,
                     teacher)
    finally:
        # DDP sits in reference cycles, which only the garbage collector frees: free it now, while
        # the process group and the interpreter are whole (at exit, gloo's threads can abort the process)
        gc.collect()
        dist.destroy_process_group()


def train(model_config, cfg, data, device, resumed, initial, micro_batch, rank, world_size, teacher=None):
    """Train up to step min(max_steps, stop_after) from load_checkpoint's (ckpt, model) to resume,
    or from the weights of load_init_checkpoint, or (both None) from the start, distilling teacher
    (--distill) if given; the exit code."""
    meta, batches, val_tokens, bytes_per_token = data
    is_main = rank == 0
    dtype, why = run_dtype(cfg, device), native_dtype(device)[1]
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
        out_dir.mkdir(parents=True, exist_ok=True)
        start_log(out_dir, step if resumed is not None else None)
        muon = cfg.optimizer == "muon"
        ns = f", Newton-Schulz in {PRECISION_NAMES[optimizers[0].ns_dtype]}" if muon else ""
        print(f"precision: {'bf16 autocast' if dtype == 'bfloat16' else 'fp32'}{ns}: {why}", flush=True)
        n_params = raw_model.get_num_params()
        parallel = "FSDP" if cfg.fsdp else "DDP" if isinstance(train_model, DDP) else "one process"
        recompute = ", activation checkpointing" if cfg.checkpoint_activations else ""
        print(f"{model_config.attn}: {n_params / 1e6:.1f}M parameters, "
              f"{raw_model.kv_cache_elements_per_token()} KV cache elements per token per layer | "
              f"{world_size} x {device.type} ({parallel}{recompute}), {dtype}, compile {compile} | "
              f"{cfg.batch_size} x {T} = {tokens_per_step:,} tokens a step in {accum_steps} micro step(s) of "
              f"{micro_batch} per process | steps {step} -> {last_step} of {cfg.max_steps}", flush=True)
        if device.type == "cpu" and n_params > 100e6:
            print(f"warning: a {n_params / 1e6:.0f}M-parameter model on a CPU takes minutes a step; "
                  "config/demo.py is the preset for CPUs", file=sys.stderr)

    if initial is not None:  # the converted model's loss is the first point of the run's curve
        val_loss, val_bpb = evaluate(model, val_tokens, bytes_per_token, T, micro_batch, autocast, rank,
                                     world_size)
        if is_main:
            log_eval(out_dir, 0, val_loss, val_bpb)

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
            tokens_per_s = tokens_per_step / seconds
            mfu = flops_per_step / seconds / (peak * world_size) if peak else None
            lr = optimizers[0].param_groups[0]["lr"]
            record = dict(step=step, loss=loss, lr=lr, ms_per_step=1000 * seconds, tokens_per_s=tokens_per_s,
                          mfu=mfu)
            log(out_dir, record,
                f"step {step}/{cfg.max_steps} | loss {loss:.4f} | lr {lr:.2e} | {1000 * seconds:.1f} "
                f"ms/step | {tokens_per_s:,.0f} tok/s" + ("" if mfu is None else f" | MFU {100 * mfu:.1f}%"))
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
            if is_main:
                log_eval(out_dir, step, val_loss, val_bpb)
                save_checkpoint(ckpt_path, saved)
            t0, timed_steps = time.perf_counter(), 0
    return 0


def build(model_config, cfg, device, world_size, dtype, compile, initial=None):
    """What a run trains, before a checkpoint is restored into it: (raw_model, model, train_model,
    optimizers), raw_model the GPT (its weights from initial, a state_dict, if given), model what
    evaluates (raw_model compiled or not), train_model what trains (model, in DDP under torchrun
    without --fsdp)."""
    # every rank draws the whole model, so that a sharded run starts where one process would
    raw_model = GPT(model_config).to(device)
    if initial is not None:
        raw_model.load_state_dict(initial)
    if cfg.checkpoint_activations:
        checkpoint_blocks(raw_model)
    if cfg.fsdp:
        shard(raw_model, device, world_size, dtype, compile)
    optimizers = configure_optimizers(raw_model, cfg)
    model = torch.compile(raw_model) if compile and not cfg.fsdp else raw_model
    ddp = world_size > 1 and not cfg.fsdp
    train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if ddp else model
    return raw_model, model, train_model, optimizers


def backward(train_model, x, y, micro_batch, autocast, device, teacher=None, distill=0.0):
    """Forward and backward over x, y (this rank's share of a step) in micro-batches, accumulating
    the gradients of their mean loss (distill_loss's with a teacher); that loss, detached."""
    accum_steps = len(x) // micro_batch
    loss = torch.zeros((), device=device)
    for i in range(accum_steps):
        micro = slice(i * micro_batch, (i + 1) * micro_batch)
        # DDP averages the gradients over processes in the backward of the last micro step only;
        # FSDP reduce-scatters them in every one, as holding whole gradients between would undo its saving
        last = i == accum_steps - 1
        with train_model.no_sync() if isinstance(train_model, DDP) and not last else nullcontext():
            with autocast:
                logits, micro_loss = train_model(x[micro].to(device), y[micro].to(device))
                if teacher is not None:
                    micro_loss = distill_loss(micro_loss, logits, teacher, x[micro].to(device), distill)
                del logits  # freed before the backward, which does not need them
            (micro_loss / accum_steps).backward()
        loss += micro_loss.detach() / accum_steps
    return loss


def distill_loss(cross_entropy, logits, teacher, idx, weight):
    """(1 - weight) CE + weight KL(p_teacher || p_model), the KL a mean over the tokens, at
    temperature 1: besides the next token, the teacher's whole distribution over it as a target.
    The logged training loss is this."""
    with torch.no_grad():
        target = F.log_softmax(teacher(idx)[0], dim=-1).flatten(0, 1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1).flatten(0, 1), target, log_target=True, reduction="batchmean")
    return (1 - weight) * cross_entropy + weight * kl


def run_dtype(cfg, device):
    """The run's --dtype, "bfloat16" (autocast) or "float32"; auto: native_dtype's for the device."""
    return cfg.dtype if cfg.dtype != "auto" else str(native_dtype(device)[0]).removeprefix("torch.")


def pick_device(name, local_rank):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if (name == "cuda" and not torch.cuda.is_available()
            or name == "mps" and not torch.backends.mps.is_available()):
        raise ConfigError(f"--device={name}: not available on this machine")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


# ---------------------------------------------------------------------------------------------
# Beyond one GPU's memory: sharding (FSDP2) and recomputation

def shard(model, device, world_size, dtype, compile):
    """FSDP2 over all ranks: fully_shard each block, then the model (its embedding and unembedding),
    every parameter cut along dim 0. Weights, gradients and optimizer states stay fp32, a
    1 / world_size share of each on each rank; a block's weights are gathered whole, in the run's
    dtype, just before its forward and again before its backward, and freed after; gradients are
    reduce-scattered in fp32. Autocast stays on as under DDP, and inputs are not cast to the
    weights' dtype, so that the residual stream stays fp32 and a step computes what a DDP step
    does. Compiled, each block is compiled on its own, the hooks that gather and free weights
    outside its graph (torchtitan's order: compile, then shard)."""
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bfloat16" else None,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        if compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def checkpoint_blocks(model):
    """Keep only each block's input from the forward and recompute the block in the backward
    (torch.utils.checkpoint, non-reentrant): one block's activations alive at a time instead of
    every block's, for one more forward (about 8 FLOPs per weight and token instead of 6)."""
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


# ---------------------------------------------------------------------------------------------
# Precision: one policy for training, Muon, decoding and the benchmarks

PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def native_dtype(device):
    """(dtype, why): bfloat16 where the device multiplies bf16 in hardware, float32 elsewhere.
    The dtype that training autocasts to, Muon's Newton-Schulz runs in and decoding holds its
    weights and KV cache in, unless a flag says otherwise. Where bf16 is emulated it is no saving:
    on an AVX2 CPU one 128M layer's training step takes 53x as long in bf16 as in fp32
    (docs/benchmarks.md#precision)."""
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, f"{torch.cuda.get_device_name(torch_device)} computes bf16"
        return torch.float32, f"{torch.cuda.get_device_name(torch_device)} has no bf16 tensor cores"
    if torch_device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        if cpu_has_bf16():
            return torch.bfloat16, f"this CPU ({capability}) has bf16 instructions"
        return torch.float32, f"this CPU ({capability}) has no bf16 matmul"
    return torch.float32, f"bf16 on {torch_device.type} is not known to be native"


def cpu_has_bf16():
    """Whether this CPU multiplies bf16 in hardware: x86's AVX512-BF16 or AMX-BF16 or Arm's BF16
    extension, as Linux lists them, and oneDNN, PyTorch's CPU matmul library, allowed to use them
    (ONEDNN_MAX_CPU_ISA=AVX2 makes such a CPU compute as an AVX2 one does)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: no reliable way to tell, and fp32 is never emulated
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# ---------------------------------------------------------------------------------------------
# Flags and presets

def settings():
    """Every settable field, by name: the model's and the training run's."""
    return {f.name: f for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)}


def base_type(field):
    """The type a field's values have: bool for `bool | None`, whose None means "decided by device"."""
    return next((t for t in typing.get_args(field.type) if t is not type(None)), field.type)


def lookup(name, fields):
    if name in fields:
        return fields[name]
    close = difflib.get_close_matches(name, fields, n=5, cutoff=0.6)
    listed = ", ".join("--" + n for n in (close or fields))
    raise ConfigError(f"unknown setting {name!r}; "
                      + (f"did you mean {listed}?" if close else f"valid: {listed}"))


def parse_flag(name, text, kind):
    if kind is bool and text.lower() in ("true", "1", "false", "0"):
        return text.lower() in ("true", "1")
    if kind is not bool:
        try:
            return kind(text)
        except ValueError:
            pass
    raise ConfigError(f"--{name}={text}: expected {kind.__name__}")


def check_preset_value(path, name, value, field):
    """A preset's value, checked against its field's type: an int passes for a float, None only
    where the field allows it."""
    kind = base_type(field)
    if value is None and kind is not field.type:
        return value
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise ConfigError(f"{path}: {name} = {value!r}: expected {kind.__name__}")
    return value


def parse_args(argv):
    """(GPTConfig, TrainConfig) from the defaults, then preset files in order, then --name=value flags."""
    fields, values = settings(), {}
    for arg in argv:
        if arg.startswith("--"):
            name, has_value, text = arg[2:].partition("=")
            kind = base_type(lookup(name, fields))
            if not has_value and kind is not bool:
                raise ConfigError(f"--{name} needs a value: --{name}=...")
            values[name] = parse_flag(name, text, kind) if has_value else True
        else:
            try:
                preset = {}
                exec(Path(arg).read_text(), {}, preset)
            except FileNotFoundError:
                raise ConfigError(f"no preset file {arg}") from None
            except Exception as e:  # a preset is the user's own code: report its error in one line
                raise ConfigError(f"{arg}: {type(e).__name__}: {e}") from None
            for name, value in preset.items():
                try:
                    field = lookup(name, fields)
                except ConfigError as e:
                    raise ConfigError(f"{arg}: {e}") from None
                values[name] = check_preset_value(arg, name, value, field)
    model_fields = {f.name for f in dataclasses.fields(GPTConfig)}
    try:
        model_config = GPTConfig(**{k: v for k, v in values.items() if k in model_fields})
        cfg = TrainConfig(**{k: v for k, v in values.items() if k not in model_fields})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg.out_dir = cfg.out_dir or f"out/{model_config.attn}"
    return model_config, cfg


# ---------------------------------------------------------------------------------------------
# Data

class TrainBatches:
    """Step s's global batch is batch_size windows of block_size + 1 tokens, at window starts that a
    generator seeded with (seed, s) draws among all windows inside the train shards. A batch depends
    on nothing but (seed, step), so a resumed run sees the batches of the uninterrupted one, and
    rank r takes the r-th contiguous share of it, so N processes see what one process would."""

    def __init__(self, shards, block_size):
        self.shards, self.block_size = shards, block_size
        self.ends = np.cumsum([max(len(shard) - block_size, 0) for shard in shards])

    def get(self, seed, step, batch_size, rank, world_size):
        """This rank's inputs and targets, (batch_size // world_size, block_size) int64 each."""
        starts = np.random.default_rng([seed, step]).integers(self.ends[-1], size=batch_size)
        share = batch_size // world_size
        rows = []
        for start in starts[rank * share:(rank + 1) * share]:
            i = np.searchsorted(self.ends, start, side="right")
            offset = start - (self.ends[i - 1] if i else 0)
            rows.append(self.shards[i][offset:offset + self.block_size + 1])
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def load_data(cfg, model_config):
    """meta.json, the train batches, the validation slice and each token's UTF-8 length, or a
    ConfigError that says what to run."""
    try:
        meta = load_meta(cfg.data_dir)
        train = [read_shard(path) for path in shard_paths(cfg.data_dir, "train")]
        val = [read_shard(path) for path in shard_paths(cfg.data_dir, "val")]
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
    batches = TrainBatches(train, T)
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


# ---------------------------------------------------------------------------------------------
# Optimisation

class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update with adjust_lr_fn="original", batched: the matrices of one shape
    are stacked and orthogonalised together, one step for a whole shape group, compiled on CUDA.
    For each matrix W with gradient G, momentum buffer B (zero at first), lr, weight decay wd and
    momentum mu:

        B <- mu B + (1 - mu) G
        U <- (1 - mu) G + mu B     (nesterov; else U <- B)
        O <- NS5(U)                the quintic Newton-Schulz iteration below, in ns_dtype
        W <- (1 - lr wd) W - lr sqrt(max(1, rows / cols)) O

    Under torch.distributed each rank orthogonalises a contiguous share of each shape group, so
    that the Newton-Schulz work divides among the ranks, and each matrix is orthogonalised whole:
    - DDP: every rank holds the same whole gradients (DDP averaged them) and moves every momentum
      buffer (elementwise, cheap next to Newton-Schulz); all_gather hands every rank the new
      weights of the others' shares.
    - FSDP: every rank holds a shard (rows, dim 0) of each matrix, its gradient and its momentum
      buffer, all DTensors, and moves its rows of every buffer. An all-to-all gathers each matrix's
      U whole on the rank that orthogonalises it, and a second hands every rank its rows of each
      O (sharded_step).
    Either way the whole state is every matrix's momentum_buffer, torch.optim.Muon's state, whole
    in rank 0's state_dict under DDP and once checkpoint_dict gathers its shards under FSDP, so that
    one checkpoint resumes under one process, DDP or FSDP alike (and torch.optim.Muon's here).

    ns_dtype: what Newton-Schulz runs in; None: native_dtype's choice for the parameters' device.
    torch.optim.Muon runs it in bf16 everywhere; the iteration only needs the update's direction
    to a few bits, so fp32 changes no result that matters and spares a CPU without bf16
    instructions its emulated bf16 matmuls, tens of times slower than fp32 ones."""

    def __init__(self, params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_dtype=None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov))
        params = [p for group in self.param_groups for p in group["params"]]
        if any(p.ndim != 2 for p in params):
            raise ValueError("Muon: every parameter must be a matrix")
        self.ns_dtype = ns_dtype or native_dtype(params[0].device)[0]
        distributed = dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        # eager on a CPU, where compiling (a C++ compiler, tens of seconds) costs more than it saves
        compiled = params[0].is_cuda
        self.update = torch.compile(muon_update) if compiled else muon_update
        self.orthogonalise = torch.compile(orthogonalise) if compiled else orthogonalise

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            shapes = {}
            for p in group["params"]:
                if p.grad is not None:
                    shapes.setdefault(p.shape, []).append(p)
            for shape, params in shapes.items():
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs = [self.state[p]["momentum_buffer"] for p in params]
                # matrices a rank orthogonalises; the last may have fewer
                n = -(-len(params) // self.world_size)
                # lr as a 0-d tensor: a float that the schedule moves every step would recompile the graph
                lr = torch.tensor(group["lr"], dtype=torch.float64)
                hyper = (lr, group["weight_decay"], group["momentum"], group["nesterov"])
                if isinstance(params[0], DTensor):
                    self.sharded_step(params, bufs, n, *hyper)
                else:
                    self.replicated_step(params, bufs, n, *hyper)

    def replicated_step(self, params, bufs, n, lr, weight_decay, momentum, nesterov):
        """One shape group's step from whole gradients, the same on every rank (one process, DDP)."""
        shape, grads = params[0].shape, [p.grad for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        mine = slice(self.rank * n, (self.rank + 1) * n)
        new = (self.update(params[mine], grads[mine], bufs[mine], lr, weight_decay, momentum, nesterov,
                           self.ns_dtype) if params[mine] else params[0].new_empty(0, *shape))
        if self.world_size > 1:
            padded = torch.cat([new, new.new_zeros(n - len(new), *shape)])
            new = new.new_empty(self.world_size * n, *shape)
            dist.all_gather_into_tensor(new, padded)
        torch._foreach_copy_(params, list(new[:len(params)]))

    def sharded_step(self, params, bufs, n, lr, weight_decay, momentum, nesterov):
        """One shape group's step from FSDP's shards. fully_shard cuts dim 0 as torch.chunk does:
        rank i holds rows [i c, (i + 1) c) of each (rows, cols) matrix, c = ceil(rows / ranks),
        fewer (or none) on the last ranks."""
        (rows, cols), ranks = params[0].shape, self.world_size
        c = -(-rows // ranks)
        W, G, B = ([t.to_local() for t in ts] for ts in (params, [p.grad for p in params], bufs))
        torch._foreach_lerp_(B, G, 1 - momentum)
        U = torch._foreach_lerp(G, B, momentum) if nesterov else B  # this rank's rows of every U
        # send[i, k]: this rank's rows of the k-th matrix that rank i orthogonalises, zero-padded to c
        send = U[0].new_zeros(ranks, n, c, cols)
        for j, u in enumerate(U):
            send[j // n, j % n, :len(u)] = u
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send)
        # received[i, k]: rank i's rows of this rank's k-th matrix; stacked, the matrices whole
        mine = len(params[self.rank * n:(self.rank + 1) * n])
        whole = received.transpose(0, 1).reshape(n, ranks * c, cols)[:mine, :rows]
        O = received.new_zeros(n, ranks * c, cols)
        if mine:
            O[:mine, :rows] = self.orthogonalise(whole, self.ns_dtype)
        dist.all_to_all_single(received, O.view(n, ranks, c, cols).transpose(0, 1).contiguous())
        # received[i, k]: this rank's rows of the O of rank i's k-th matrix, matrix i n + k
        O = [received[j // n, j % n, :len(w)] for j, w in enumerate(W)]
        new = descend(torch.stack(W), torch.stack(O), lr, weight_decay, (rows, cols))
        torch._foreach_copy_(W, list(new))


def orthogonalise(X, ns_dtype):
    """NS5(X) of a stack of matrices X (n, rows, cols), in ns_dtype. The iteration is
    torch.optim.Muon's: its coefficients, eps and 5 steps (in bf16 there), on the transpose of a
    tall matrix, the same fused multiply-adds (addmm there, baddbmm here)."""
    X = X.to(ns_dtype)
    rows, cols = X.shape[-2:]
    if rows > cols:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)  # spectral norm at most 1
    for _ in range(5):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=-4.7750, alpha=2.0315), X, beta=3.4445)
    return X.mT if rows > cols else X


def descend(W, O, lr, weight_decay, shape):
    """W <- (1 - lr wd) W - lr sqrt(max(1, rows / cols)) O, in place, for W and O stacks of
    (rows of) matrices of shape (rows, cols)."""
    rows, cols = shape
    return W.mul_(1 - lr * weight_decay).sub_(O.to(W.dtype) * (lr * max(1, rows / cols) ** 0.5))


def muon_update(params, grads, bufs, lr, weight_decay, momentum, nesterov, ns_dtype):
    """Muon's new values for whole matrices of one shape, stacked, from their moved momentum buffers."""
    G, B, W = torch.stack(grads), torch.stack(bufs), torch.stack(params)
    U = G.lerp(B, momentum) if nesterov else B
    return descend(W, orthogonalise(U, ns_dtype), lr, weight_decay, W.shape[-2:])


def configure_optimizers(model, cfg, ns_dtype=None):
    """The paper's optimisers: Muon for every matrix inside the blocks, AdamW with their own lrs for
    the token embedding and the unembedding; --optimizer=adamw moves the blocks' matrices to AdamW at
    adamw_lr. The paper's AdamW lrs are kept as they are: nanochat's (n_embd / 768) ** -0.5 scaling
    of them is 1 at the 128M width, and the paper does not say it applies it elsewhere.
    Each param group's initial_lr is the peak that the schedule scales; ns_dtype goes to Muon."""
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


def optimizer_step(model, optimizers, cfg):
    """Clip the global gradient norm, step every optimizer and clear the gradients."""
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


# Dense bf16 peak FLOP/s of one GPU, matched in this order against torch.cuda.get_device_name
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def peak_flops(device):
    """One device's dense bf16 peak, or None where MFU means nothing (a CPU, MPS, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


# ---------------------------------------------------------------------------------------------
# Evaluation and checkpoints

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


# The checkpoint's format: checkpoint_dict builds it, load_checkpoint and restore read it back.
EVALS = ("val_loss", "val_bpb", "best_val_loss", "best_val_bpb")


def checkpoint_dict(model, model_config, cfg, optimizers, step, evals, meta, device):
    """What ckpt.pt holds: the weights and the GPTConfig they make a model of (model_args), the
    optimizers' states, the step, the evaluations so far (EVALS), the run's TrainConfig, its data's
    meta.json and the RNG states, so that --resume goes on exactly where the run stopped. Every
    tensor is whole, however the run was split: under FSDP every rank must call this, and only
    rank 0's dict holds the tensors (gathered)."""
    return dict(
        model=gathered(model.state_dict()),
        model_args=dataclasses.asdict(model_config),
        optimizers=[gathered(opt.state_dict()) for opt in optimizers],
        step=step,
        **evals,
        config=dataclasses.asdict(cfg),
        tokenizer=meta,
        rng=dict(torch=torch.get_rng_state(),
                 cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None),
    )


def gathered(state):
    """A state_dict with each DTensor (an FSDP shard) replaced by the whole tensor, in CPU memory on
    rank 0 and None on the other ranks, one tensor at a time: every rank must call it."""
    if isinstance(state, DTensor):
        whole = state.full_tensor()
        return whole.cpu() if dist.get_rank() == 0 else None
    if isinstance(state, dict):
        return {k: gathered(v) for k, v in state.items()}
    if isinstance(state, list):
        return [gathered(v) for v in state]
    return state


def shard_like(tensor, param):
    """A whole tensor from a checkpoint cut to this rank's shard where param, whose shape it has,
    is sharded (a DTensor); as it is otherwise. Every rank holds the whole checkpoint (mapped)."""
    if isinstance(param, DTensor) and tensor.shape == param.shape:
        return distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return tensor


def save_checkpoint(path, checkpoint):
    """Write path atomically: a process killed while saving leaves the previous checkpoint whole."""
    with atomic_open(path) as f:
        torch.save(checkpoint, f)


def load_checkpoint(path, device="meta"):
    """(ckpt, model): a checkpoint_dict read back, and the GPT of its model_args holding its
    weights, or a ConfigError of one line that starts with the path. weights_only: reading a
    checkpoint can never run code. On the meta device (the default) the model is a shell around
    the memory-mapped weights: nothing is read or initialised but what the caller touches, which
    keeps analyze.py on six 128M checkpoints to seconds, and its RoPE table cannot run. On any
    other device (a torch.device or a name: "cpu", "cuda") the model is built there, whole and
    runnable, in the checkpoint's fp32."""
    def bad(problem):
        return ConfigError(f"{path}: {problem}")

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except OSError as e:
        raise bad(e.strerror) from None
    except pickle.UnpicklingError:
        raise bad("refused: it holds Python objects that loading with weights_only=True does not "
                  "allow") from None
    except Exception:  # what else torch.load raises (mostly RuntimeError) says the file is no checkpoint
        raise bad("not a PyTorch checkpoint") from None
    if not isinstance(ckpt, dict):
        raise bad(f"not a train.py checkpoint: it holds a {type(ckpt).__name__}, not a dict")
    for key in ("model_args", "model"):
        if key not in ckpt:
            raise bad(f"not a train.py checkpoint: it has no {key!r}")
    try:
        with torch.device(device):
            model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"], assign=model.wte.weight.is_meta)
    except (TypeError, ValueError, RuntimeError) as e:
        raise bad("model_args and weights do not make a GPT: " + " ".join(str(e).split())) from None
    return ckpt, model


def restore(checkpoint, model, optimizers, device):
    """Put load_checkpoint's (ckpt, model) back into a run: the weights into model, the states
    into optimizers (each cut to this rank's shards where the run is sharded) and the RNGs.
    Returns the step and the evaluations, {EVALS key: value}."""
    ckpt, saved = checkpoint
    ours = model.state_dict()
    model.load_state_dict({k: shard_like(v, ours[k]) for k, v in saved.state_dict().items()})
    for opt, state in zip(optimizers, ckpt["optimizers"]):
        params = [p for group in opt.param_groups for p in group["params"]]  # state_dict's numbering
        per_param = {i: {k: shard_like(v, params[i]) if torch.is_tensor(v) else v for k, v in kept.items()}
                     for i, kept in state["state"].items()}
        opt.load_state_dict({**state, "state": per_param})
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device.type == "cuda" and ckpt["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    return ckpt["step"], {k: ckpt[k] for k in EVALS}


# The flags that decide what a run computes besides the model's: a resumed run must be given the
# ones it was trained with, or it would go on as another run than the one it continues (and the
# checkpoints it writes would describe that one). Data, device, dtype, compilation, micro-batching,
# the evaluation and log cadence and stop_after may change from one job of a run to the next.
RESUME_FLAGS = ("batch_size", "max_steps", "warmup_steps", "optimizer", "muon_lr", "adamw_lr", "embedding_lr",
                "unembedding_lr", "weight_decay", "grad_clip", "eval_tokens", "seed", "init_from", "distill")


def load_resume_checkpoint(cfg, model_config):
    """load_checkpoint(out_dir/ckpt.pt), checked to hold the model the flags describe, trained with
    the flags in RESUME_FLAGS."""
    path = Path(cfg.out_dir) / "ckpt.pt"
    if not path.exists():
        raise ConfigError(f"--resume: there is no {path} to resume from")
    ckpt, model = load_checkpoint(path)
    # a checkpoint from before a flag existed ran with its default
    saved = {**ckpt["model_args"], **{k: ckpt["config"].get(k, TrainConfig.__dataclass_fields__[k].default)
                                      for k in RESUME_FLAGS}}
    wanted = {**dataclasses.asdict(model_config), **{k: getattr(cfg, k) for k in RESUME_FLAGS}}
    changed = ", ".join(f"{k}={saved[k]!r} (flags: {wanted.get(k)!r})" for k in saved
                        if saved[k] != wanted.get(k))
    if changed:
        raise ConfigError(f"--resume: {path} was trained with {changed}; give the flags of the run it "
                          "continues")
    return ckpt, model


def load_init_checkpoint(cfg, model_config, batches, device):
    """The state_dict of the model the flags describe, made from the --init_from checkpoint's
    weights: copied where the variant and every shape agree, else through GPT.convert_from, each
    layer weighed by its attention inputs in --calibration_tokens tokens of batches (0: the
    weights alone), which the checkpoint's model reads on device."""
    path = Path(cfg.init_from)
    if path.exists() and path.resolve() == (Path(cfg.out_dir) / "ckpt.pt").resolve():
        raise ConfigError(f"--init_from={path} is this run's own checkpoint, which the run would overwrite: "
                          "give the run its own --out_dir")
    _, source = load_checkpoint(path, device if cfg.calibration_tokens else "meta")
    model = GPT(model_config)
    try:
        covariances = None
        if cfg.calibration_tokens:
            covariances = attention_input_covariances(source, batches, cfg.calibration_tokens, cfg.seed,
                                                      cfg.micro_batch_size, device)
        model.convert_from(source, covariances)
    except ValueError as e:
        raise ConfigError(f"--init_from={path}: {e}") from None
    return model.state_dict()


@torch.no_grad()
def attention_input_covariances(model, batches, n_tokens, seed, batch_size, device):
    """Per layer, C = X^T X / N (d, d) in float64 for the N inputs X (N, d) that model's attention
    sees there (norm(x), Block.forward) when it reads n_tokens training tokens: whole windows,
    drawn as step 0 of a run with seed draws its batch (TrainBatches), batch_size at a time on
    device. Uncentred, as the key and value projections have no bias: an error E of one costs
    E||E x||^2 = ||E C^(1/2)||_F^2 on these inputs, what the conversion minimises."""
    T = min(batches.block_size, model.config.block_size)  # the model may have been trained on shorter windows
    windows = batches.get(seed, 0, -(-n_tokens // T), 0, 1)[0][:, :T]
    sums = [torch.zeros(model.config.n_embd, model.config.n_embd, dtype=torch.float64) for _ in model.blocks]

    def record(layer):
        def hook(attn, args):
            x = args[0].flatten(0, 1).float()  # (B T, d)
            sums[layer] += (x.T @ x).cpu().double()
        return hook

    hooks = [block.attn.register_forward_pre_hook(record(i)) for i, block in enumerate(model.blocks)]
    try:
        for chunk in windows.split(batch_size):
            model(chunk.to(device))
    finally:
        for hook in hooks:
            hook.remove()
    return [total / windows.numel() for total in sums]


# The log's format: log appends one record a line to out_dir/log.jsonl, read_log reads them back.
# Training records hold step and loss (and lr, timings), evaluation records step and val_loss.
def log(out_dir, record, line):
    print(line, flush=True)
    with open(Path(out_dir) / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def log_eval(out_dir, step, val_loss, val_bpb):
    log(out_dir, dict(step=step, val_loss=val_loss, val_bpb=val_bpb),
        f"step {step} | val loss {val_loss:.4f} | val bpb {val_bpb:.4f}")


def read_log(out_dir):
    """The records log wrote to out_dir/log.jsonl, in order; [] if there is none."""
    path = Path(out_dir) / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start_log(out_dir, resume_step):
    """A fresh run starts an empty log; a resumed one keeps the records up to its checkpoint's step
    (the stopped run may have logged past it), so the log reads as one uninterrupted run."""
    kept = [r for r in read_log(out_dir) if r["step"] <= resume_step] if resume_step is not None else []
    (Path(out_dir) / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


if __name__ == "__main__":
    sys.exit(main())
