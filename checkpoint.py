"""
What a run leaves in its out_dir, each format built and read side by side: ckpt.pt
(checkpoint_dict and save_checkpoint write it; load_checkpoint and restore read it) and log.jsonl
(log writes it; read_log and start_log read it), and what a checkpoint must match to be resumed
(RESUME_FLAGS). sample.py and analyze.py read both.
"""

import dataclasses
import json
import pickle
from pathlib import Path

import torch

from configurator import ConfigError
from model import GPT, GPTConfig
from parallel import gathered, shard_like
from prepare_data import atomic_open


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


# The log's format: log appends one record a line to out_dir/log.jsonl, read_log reads them back.
# Training records hold step and loss (and lr, timings), evaluation records step and val_loss (and
# val_bpb, and each layer's effective_rank and effective_rank_centered; a log from before those
# were logged has none).
def log(out_dir, record, line):
    print(line, flush=True)
    with open(Path(out_dir) / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def log_eval(out_dir, step, val_loss, val_bpb, ranks):
    """An evaluation's record: its losses and ranks, diversity.layer_ranks of the weights evaluated."""
    means = [sum(ranks[key]) / len(ranks[key]) for key in ("effective_rank", "effective_rank_centered")]
    log(out_dir, dict(step=step, val_loss=val_loss, val_bpb=val_bpb, **ranks),
        f"step {step} | val loss {val_loss:.4f} | val bpb {val_bpb:.4f} | effective rank, mean over "
        f"layers, {means[0]:.2f} (centred {means[1]:.2f})")


def read_log(out_dir):
    """The records log wrote to out_dir/log.jsonl, in order; [] if there is none."""
    path = Path(out_dir) / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start_log(out_dir, resume_step):
    """A fresh run starts an empty log; a resumed one keeps the records up to its checkpoint's step
    (the stopped run may have logged past it), so the log reads as one uninterrupted run."""
    kept = [r for r in read_log(out_dir) if r["step"] <= resume_step] if resume_step is not None else []
    (Path(out_dir) / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


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
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    saved = {**ckpt["model_args"], **{k: ckpt["config"].get(k, defaults[k]) for k in RESUME_FLAGS}}
    wanted = {**dataclasses.asdict(model_config), **{k: getattr(cfg, k) for k in RESUME_FLAGS}}
    changed = ", ".join(f"{k}={saved[k]!r} (flags: {wanted.get(k)!r})" for k in saved
                        if saved[k] != wanted.get(k))
    if changed:
        raise ConfigError(f"--resume: {path} was trained with {changed}; give the flags of the run it "
                          "continues")
    return ckpt, model
