"""
What a run leaves in its out_dir, each format built and read side by side: ckpt.pt
(checkpoint_dict and save_checkpoint write it; load_checkpoint and restore read it) and log.jsonl
(log writes it; read_log and start_log read it), and what a checkpoint must match to be resumed
(every flag but JOB_FLAGS). sample.py and analyze.py read both.

A run holds its out_dir for its whole life (claim_out_dir): one run a folder, and a fresh run
never replaces another's files unasked. Every write fails whole: a checkpoint is written to a
temporary file and renamed, a log record appended or nothing, and a failure (a full disk) is a
WriteError of one line that leaves the files as they were. A checkpoint carries a digest of its
contents, checked on load, so a damaged file is refused, never sampled from, and a file cut short
(a copy cut off) is refused as truncated; the log tolerates the torn last line that a crash in
mid-append leaves.
"""

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pickle
import stat
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from lib.training.configurator import ConfigError, check_fields
from lib.training.parallel import gathered, shard_like
from model import GPT, GPTConfig
from lib.training.data import atomic_open, write_atomic


class WriteError(Exception):
    """A write into out_dir failed (a full disk, a folder gone): one line, the file it names as
    it was before the write."""


def check_writable(path):
    """A ConfigError of one line unless a file can be written at path, with any missing folders on
    the way made there: analyze.py and bench.py check it before the work whose results would go
    there, and make the folders only when they write, so that bad input leaves nothing behind."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a folder")
        existing = next(folder for folder in path.parents if folder.exists())  # "." at least
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "its folder is a file" if existing == path.parent
                                     else f"{existing}, a folder on its way, is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{path}: cannot be written: {e.strerror}") from None


def write_error(path, error):
    """The WriteError for an OSError raised writing path."""
    return WriteError(f"{path}: {error.strerror or error}; it is left as it was before this write")


# ---------------------------------------------------------------------------------------------
# The folder: one run at a time, and a fresh run only where there is none, or where asked

LOCK = "lock"  # out_dir/lock: its holder's pid, flock'ed for the holder's life
RUN_FILES = ("ckpt.pt", "log.jsonl")


@contextmanager
def claim_out_dir(out_dir, resume=False, overwrite=False):
    """Hold out_dir, made if missing, for the with block: an exclusive advisory flock on
    out_dir/lock, which the OS releases when the process dies however it dies, so a second run
    into the folder is refused, naming the holder's pid. Taking it proves the folder writable
    before anything is built or loaded. A fresh run (neither resume nor overwrite) into a folder
    that holds a run is refused. A ConfigError in the block removes what the claim made (the
    lock file, the folders): bad input leaves nothing behind."""
    out_dir = Path(out_dir)
    made = next((p for p in reversed([out_dir, *out_dir.parents]) if not p.exists()), None)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out_dir={out_dir}: not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_file(out_dir / LOCK)
    except OSError as e:
        raise ConfigError(f"--out_dir={out_dir}: cannot write there: {e.strerror}") from None
    failed = False
    try:
        held = [name for name in RUN_FILES if (out_dir / name).exists()]
        if held and not (resume or overwrite):
            raise ConfigError(f"{out_dir} holds a run ({', '.join(held)}): --resume continues it, "
                              "--overwrite starts it over, or give this one another --out_dir")
        yield
    except ConfigError:
        failed = True
        raise
    finally:
        release(lock, out_dir / LOCK)
        for folder in [out_dir, *out_dir.parents] if failed and made else []:
            try:
                folder.rmdir()  # only while empty: what the claim made, nothing more
            except OSError:
                break
            if folder == made:
                break


def lock_file(path):
    """path opened and exclusively flock'ed, this process's pid written in it, or a ConfigError
    naming the pid that holds it."""
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            f.close()
            raise ConfigError(f"{path.parent}: in use by another run (pid {pid}): wait for it to end, "
                              "or give this one another --out_dir") from None
        # the holder before us unlinks the file before it lets go: a lock on that unlinked file
        # holds nothing, so take the one now at path instead
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    except OSError:  # a full disk: no lock file left behind
        release(f, path)
        raise
    return f


def release(lock, path):
    """Unlink the lock file, then let go of it: lock_file's check relies on that order."""
    try:
        path.unlink(missing_ok=True)
    except OSError:  # the folder is gone or read-only: the lock goes with the process all the same
        pass
    lock.close()


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
    """Write path atomically, with digest(checkpoint) in it: a process killed while saving leaves
    the previous checkpoint whole, and a failed write (a full disk) is a WriteError that leaves
    no temporary file behind (atomic_open)."""
    try:
        with atomic_open(path) as f:
            torch.save({**checkpoint, "digest": digest(checkpoint)}, f)
    except (OSError, RuntimeError) as e:
        # torch.save reports a failed write as a RuntimeError of its own (`enforce fail at
        # inline_container.cc`), raised while handling the OSError that says why
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        raise write_error(path, cause) from None


def digest(checkpoint):
    """sha256 over everything a checkpoint holds (but a digest), field by field in sorted order:
    each tensor's dtype, shape and bytes, every other value's repr. The tensors are hashed one
    to a thread (hashlib lets go of the GIL), so it runs on every core; docs/benchmarks.md
    gives its cost at 128M."""
    tensors, rest = [], []

    def walk(key, value):
        if torch.is_tensor(value):
            tensors.append((key, value))
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{key}/{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{key}/{i}", item)
        else:
            rest.append(f"{key}={value!r}")

    walk("", {k: v for k, v in checkpoint.items() if k != "digest"})

    def tensor_hash(item):
        key, t = item
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return f"{key}:{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()}"

    with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool:
        lines = [*pool.map(tensor_hash, tensors), *rest]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# Each field of checkpoint_dict, as configurator.check_fields reads a spec; load_checkpoint checks
# the ones a checkpoint has, and that it has the ones its caller needs (a checkpoint from before a
# field existed may lack it)
FIELDS = dict(model=dict, model_args=dict, optimizers=[dict(state=dict, param_groups=list)], step=int,
              **dict.fromkeys(EVALS, (float, type(None))), config=dict, tokenizer=dict(tokenizer=str),
              rng=dict(torch=torch.Tensor, cuda=(torch.Tensor, type(None))), digest=str)


# torch.save writes a zip archive: its first bytes a zip's, its last its central directory's end
ZIP_START = b"PK\x03\x04"


def unreadable(path, start, size):
    """What is wrong with a file of size bytes, starting with start, that torch.load cannot read: a
    checkpoint's start without its end (a save killed, a copy cut short), or no checkpoint at all."""
    if size == 0:
        return "empty (0 bytes), so not a checkpoint; restore it from a copy or train it again"
    if start == ZIP_START and not zipfile.is_zipfile(path):
        return (f"truncated after {size:,} bytes: a checkpoint's start without its end (a save or a copy cut "
                "short); restore it from a whole copy or train it again")
    return "not a PyTorch checkpoint"


# The files whose digest this process has checked, and found right: analyze.py reads a
# conversion's source checkpoint once for every run converted from it
VERIFIED = {}


def load_checkpoint(path, device="meta", needs=()):
    """(ckpt, model): a checkpoint_dict read back, and the GPT of its model_args holding its
    weights, or a ConfigError of one line that starts with the path. weights_only: reading a
    checkpoint can never run code. Its digest, where it has one (checkpoints from before digests
    load without), must match its contents, and every field in FIELDS that it has must have
    FIELDS' type; those in needs must be there. On the meta device (the default) the model is a
    shell around the memory-mapped weights, and its RoPE table cannot run; checking the digest
    reads them once. On any other device (a torch.device or a name: "cpu", "cuda") the model is
    built there, whole and runnable, in the checkpoint's fp32."""
    def bad(problem):
        return ConfigError(f"{path}: {problem}")

    try:
        info = os.stat(path)
        # a FIFO or a device would block the read or never end: only a regular file is a checkpoint
        if not stat.S_ISREG(info.st_mode):
            raise bad("not a regular file, so not a checkpoint")
        with open(path, "rb") as f:  # the file system's refusals (no permission), apart from the contents'
            start = f.read(len(ZIP_START))
    except OSError as e:
        raise bad(e.strerror) from None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise bad("refused: it holds Python objects that loading with weights_only=True does not "
                  "allow") from None
    except Exception:  # what else torch.load raises (a RuntimeError, an OSError) says the contents are wrong
        raise bad(unreadable(path, start, info.st_size)) from None
    identity = (os.path.realpath(path), info.st_ino, info.st_size, info.st_mtime_ns)
    if not isinstance(ckpt, dict):
        raise bad(f"not a train.py checkpoint: it holds a {type(ckpt).__name__}, not a dict")
    for key in ("model_args", "model", *needs):
        if key not in ckpt:
            raise bad(f"not a train.py checkpoint: it has no {key!r}")
    if "digest" in ckpt and VERIFIED.get(identity) != ckpt["digest"]:
        if ckpt["digest"] != digest(ckpt):
            raise bad("damaged: its contents do not match the digest saved with them; restore it from a "
                      "copy or train it again")
        VERIFIED[identity] = ckpt["digest"]
    try:
        check_fields(path, ckpt, FIELDS, optional=FIELDS)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        with torch.device(device):
            model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"], assign=model.wte.weight.is_meta)
    except (TypeError, ValueError, RuntimeError) as e:
        raise bad("model_args and weights do not make a GPT: " + " ".join(str(e).split())) from None
    return ckpt, model


# What restore and train.py's --resume read: every field but the digest, which old checkpoints lack
RESUMED = tuple(field for field in FIELDS if field != "digest")


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
# val_bpb, and each layer's effective_rank and effective_rank_centered, None for a variant whose heads
# give no maps of x, and with --eval_tasks the tasks' scores; a log from before those were logged has
# none).
def log(out_dir, record, line):
    """Print line and append record, whole or not at all: a failed append (a full disk) is cut
    back to the log as it was and raised as a WriteError."""
    print(line, flush=True)
    path, data = Path(out_dir) / "log.jsonl", (json.dumps(record) + "\n").encode()
    try:
        with open(path, "ab", buffering=0) as f:  # unbuffered: what failed is known, and cut off
            end = f.tell()
            try:
                written = 0
                while written < len(data):  # a write that fills the disk writes part, then fails
                    written += f.write(data[written:])
            except OSError:
                f.truncate(end)
                raise
    except OSError as e:
        raise write_error(path, e) from None


def log_eval(out_dir, step, val_loss, val_bpb, ranks, tasks=None):
    """An evaluation's record: its losses and ranks, diversity.layer_ranks of the weights evaluated (None
    where the heads give no maps of x),
    and with train.py --eval_tasks the tasks' scores, {name: {"metric", "value", "chance"}}."""
    if ranks["effective_rank"] is None:  # diversity.no_head_maps, which train.py said when it started
        rank = "effective rank none (no maps of x)"
    else:
        means = [sum(ranks[key]) / len(ranks[key]) for key in ("effective_rank", "effective_rank_centered")]
        rank = f"effective rank, mean over layers, {means[0]:.2f} (centred {means[1]:.2f})"
    scores = "".join(f" | {name} {r['metric']} {r['value']:.4f}" for name, r in (tasks or {}).items())
    record = dict(step=step, val_loss=val_loss, val_bpb=val_bpb, **ranks)
    if tasks:
        record["tasks"] = tasks
    log(out_dir, record, f"step {step} | val loss {val_loss:.4f} | val bpb {val_bpb:.4f} | {rank}{scores}")


def read_log(out_dir):
    """The records log wrote to out_dir/log.jsonl, in order; [] if there is none. A last line
    that a crash cut short (no newline, not JSON) is dropped with a note on stderr; any other
    line that is not a record with a step is a ConfigError naming the file and the line."""
    path = Path(out_dir) / "log.jsonl"
    if not path.exists():
        return []
    try:
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read: {getattr(e, 'strerror', None) or e}") from None
    records = []
    for n, line in enumerate(lines, 1):
        if line == "" and n == len(lines):
            break
        try:
            records.append(check_fields(f"{path}, line {n}", json.loads(line), dict(step=int)))
        except json.JSONDecodeError:
            if n < len(lines):
                raise ConfigError(f"{path}: line {n} is not JSON: {line[:60]!r}") from None
            print(f"note: {path}: dropped its last line, cut short by a crash while it was written: "
                  f"{line[:40]!r}", file=sys.stderr)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return records


def start_log(out_dir, resume_step):
    """A fresh run starts an empty log; a resumed one keeps the records up to its checkpoint's step
    (the stopped run may have logged past it), so the log reads as one uninterrupted run. Written
    to a temporary file and renamed: a crash or a full disk meanwhile leaves the whole old log."""
    kept = [r for r in read_log(out_dir) if r["step"] <= resume_step] if resume_step is not None else []
    path = Path(out_dir) / "log.jsonl"
    try:
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    except OSError as e:
        raise write_error(path, e) from None


# The flags that may change from one job of a run to the next: where it reads and writes, how long
# this job runs, the device, precision, compilation and parallelism, micro-batching, the evaluation
# and log cadence and the downstream tasks each evaluation scores (eval_tasks), and what only a
# first job reads (calibration_tokens). Every other flag decides
# what the run computes: a resumed run must be given the ones it was trained with (a flag added to
# TrainConfig is checked so by default), or it would go on as another run than the one it
# continues, and the checkpoints it writes would describe that one.
JOB_FLAGS = ("data_dir", "out_dir", "resume", "overwrite", "stop_after", "device", "dtype", "ns_dtype",
             "compile", "fsdp", "checkpoint_activations", "micro_batch_size", "eval_interval", "log_interval",
             "calibration_tokens", "eval_tasks", "eval_tasks_limit")


# What a run did in place of each flag added to TrainConfig after checkpoints began to hold their config,
# so that a checkpoint from before the flag, which lacks it, resumes as the run it was: not the flag's
# default, which may mean something else (a new schedule's). A flag added to TrainConfig goes here with
# the behaviour it replaces, or such a checkpoint is refused, naming it.
BEFORE = dict(init_from="", distill=0.0)
# The same for GPTConfig's fields added after checkpoints began to hold model_args: before them a model
# shared no keys and had no window. The others added since came with what reads them (window_pattern with
# window, each rival's knobs with the rival), so a checkpoint that lacks one never read it: GPTConfig's
# default stands in. A field added to GPTConfig goes in one of the two, or such a checkpoint is refused.
MODEL_BEFORE = dict(cla=1, yoco=False, window=None)
UNREAD_BEFORE = ("window_pattern", "gta_kv_heads", "gla_latent_dim", "gla_latent_heads", "mlra_latent_dim",
                 "mlra_latent_heads", "tpa_q_rank", "tpa_kv_rank")


def load_resume_checkpoint(cfg, model_config):
    """load_checkpoint(out_dir/ckpt.pt), checked to hold the model the flags describe, trained with
    the flags given, but JOB_FLAGS; a field it lacks is BEFORE's (a model's: MODEL_BEFORE's, or
    GPTConfig's default where UNREAD_BEFORE names it), and one not there refused."""
    path = Path(cfg.out_dir) / "ckpt.pt"
    if not path.exists():
        raise ConfigError(f"--resume: there is no {path} to resume from")
    ckpt, model = load_checkpoint(path, needs=RESUMED)
    run_flags = [f.name for f in dataclasses.fields(cfg) if f.name not in JOB_FLAGS]
    unknown = [name for name in run_flags if name not in ckpt["config"] and name not in BEFORE]
    if unknown:
        raise ConfigError(f"--resume: {path} has no {unknown[0]!r}, a flag added since it was written, and "
                          "what its run did in its place is not recorded (checkpoint.BEFORE): it cannot be "
                          "resumed as the run it was")
    fields = dataclasses.asdict(GPTConfig())
    unknown = [name for name in fields if name not in ckpt["model_args"]
               and name not in MODEL_BEFORE and name not in UNREAD_BEFORE]
    if unknown:
        raise ConfigError(f"--resume: {path} has no model field {unknown[0]!r}, one added since it was "
                          "written, and what its model did in its place is not recorded "
                          "(checkpoint.MODEL_BEFORE): it cannot be resumed as the run it was")
    saved = {**fields, **MODEL_BEFORE, **ckpt["model_args"],
             **{name: ckpt["config"].get(name, BEFORE.get(name)) for name in run_flags}}
    wanted = {**dataclasses.asdict(model_config), **{name: getattr(cfg, name) for name in run_flags}}
    changed = ", ".join(f"{k}={saved[k]!r} (flags: {wanted.get(k)!r})" for k in saved
                        if saved[k] != wanted.get(k))
    if changed:
        raise ConfigError(f"--resume: {path} was trained with {changed}; give the flags of the run it "
                          "continues")
    return ckpt, model
