"""
The data every script reads, built and read side by side: token shards (a 24-byte header, magic,
version and token count, then little-endian uint16 tokens) and meta.json, which prepare_data.py
writes; the batches train.py draws from them; the two tokenizers (GPT-2's BPE and bytes); and the
atomic writer that every file here goes through (a write lands whole or not at all).
"""

import base64
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import tiktoken
import torch
from tiktoken_ext.openai_public import r50k_pat_str

from lib.training.configurator import ConfigError, check_fields

MAGIC = b"LRKVTOK\0"
VERSION = 1
HEADER = struct.Struct("<8sQQ")  # magic, version, number of tokens
DATASETS = ("fineweb-edu", "pydocs", "pysource", "text")
TOKENIZERS = ("gpt2", "byte")

# -----------------------------------------------------------------------------
# shards and meta.json, and the batches drawn from them

def read_shard(path):
    """Memory-map a shard's tokens (read-only uint16) after checking its header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(HEADER.size)
    if len(header) < HEADER.size:
        raise ValueError(f"{path}: truncated shard ({size} bytes, shorter than its header)")
    magic, version, count = HEADER.unpack(header)
    if magic != MAGIC:
        raise ValueError(f"{path}: not a token shard (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"{path}: shard format version {version}, this code reads {VERSION}")
    if size != HEADER.size + 2 * count:
        raise ValueError(f"{path}: truncated shard ({size} bytes where its header promises "
                         f"{HEADER.size + 2 * count})")
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER.size, shape=(count,))

@contextmanager
def atomic_open(path):
    """A binary file that appears at path only once it is whole: written under a temporary
    name, synced and renamed, so a killed run never leaves a file that looks finished but is
    cut short, and never destroys the previous version. A write that fails (a full disk, a
    folder gone) removes the temporary file, which would only fill the disk further; a kill
    cannot, and leaves it for the next write to replace."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # the folder itself is what failed: the error that got here says so
            pass
        raise

def write_atomic(path, *parts):
    with atomic_open(path) as f:
        for part in parts:
            f.write(part)

def write_shard(path, tokens):
    write_atomic(path, HEADER.pack(MAGIC, VERSION, len(tokens)), tokens.astype("<u2", copy=False))

def prepare_command(data_dir):
    """The command that makes data_dir, for error messages."""
    data_dir = Path(data_dir)
    dataset, _, tokenizer = data_dir.name.rpartition("-")
    if dataset not in DATASETS or tokenizer not in TOKENIZERS:
        return f"python prepare_data.py --dataset=... --tokenizer=... --out_dir={data_dir}"
    command = f"python prepare_data.py --dataset={dataset} --tokenizer={tokenizer}"
    return command if data_dir == Path("data", data_dir.name) else f"{command} --out_dir={data_dir}"

# What meta.json and progress.json hold, as configurator.check_fields reads a spec: largest_token
# maps each shard's name to its largest token, which data made before it was recorded lacks
META_FIELDS = dict(tokenizer=str, vocab_size=int, eot_id=int, source=str, train_tokens=int, val_tokens=int,
                   train_bytes=int, val_bytes=int, shards=dict(train=[str], val=[str]), documents=int,
                   settings=dict, largest_token=dict)

def read_state(path):
    """meta.json or progress.json, checked field by field: a ValueError names the file and field."""
    try:
        state = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    check_fields(path, state, META_FIELDS, optional=("largest_token",))
    for split in ("train", "val"):
        for name in state["shards"][split]:
            if Path(name).name != name or not name.endswith(".bin"):  # never a path out of the folder
                raise ValueError(f"{path}: field 'shards.{split}' names {name!r}, not a shard file")
    return state

def load_meta(data_dir):
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: make the data with `{prepare_command(data_dir)}`")
    return read_state(path)

def shard_paths(data_dir, split):
    return [Path(data_dir) / name for name in sorted(load_meta(data_dir)["shards"][split])]

def read_shards(data_dir, split):
    """The split's shards (read_shard), each checked to hold only tokens in meta.json's vocabulary
    (check_tokens), by its largest_token where meta.json records it and a train shard, else by
    reading it, once: val is a small share of the data, and every token of it is evaluated."""
    meta = load_meta(data_dir)
    shards = []
    for path in shard_paths(data_dir, split):
        shards.append(read_shard(path))
        largest = meta.get("largest_token", {}).get(path.name) if split == "train" else None
        check_tokens(path, shards[-1], meta["vocab_size"], largest=largest)
    return shards

def check_tokens(path, tokens, vocab_size, start=0, largest=None):
    """A ConfigError naming the shard at path and the offset of the first of tokens (which start at
    offset start in it) outside vocab_size, if one is; largest, where meta.json records it, spares
    reading the tokens, and otherwise is computed here, once."""
    if len(tokens) == 0 or (largest if largest is not None else int(tokens.max())) < vocab_size:
        return
    bad = np.flatnonzero(np.asarray(tokens) >= vocab_size)
    where = (f"token {int(tokens[bad[0]])} at offset {start + int(bad[0])}" if len(bad)
             else f"largest token {largest} (meta.json's largest_token)")
    raise ConfigError(f"{path}: {where} is outside the vocabulary of {vocab_size} tokens: "
                      f"make the data again with `{prepare_command(Path(path).parent)}`")


class TrainBatches:
    """Step s's global batch is batch_size windows of block_size + 1 tokens, at window starts that a
    generator seeded with (seed, s) draws among all windows inside the train shards. A batch depends
    on nothing but (seed, step), so a resumed run sees the batches of the uninterrupted one, and
    rank r takes the r-th contiguous share of it, so N processes see what one process would.
    With vocab_size, every batch is checked to hold only tokens below it before it reaches an
    embedding, where one outside would index past the table (on a GPU, a device-side assert
    that names nothing): a max over the batch's tokens, microseconds a step."""

    def __init__(self, shards, block_size, vocab_size=None):
        self.shards, self.block_size, self.vocab_size = shards, block_size, vocab_size
        self.ends = np.cumsum([max(len(shard) - block_size, 0) for shard in shards])

    def get(self, seed, step, batch_size, rank, world_size):
        """This rank's inputs and targets, (batch_size // world_size, block_size) int64 each."""
        starts = np.random.default_rng([seed, step]).integers(self.ends[-1], size=batch_size)
        share = batch_size // world_size
        # the whole global batch is checked on every rank, so that all of them stop on a bad token
        # together and rank 0, which reports errors, reports it
        rows = []
        for start in starts if self.vocab_size else starts[rank * share:(rank + 1) * share]:
            i = np.searchsorted(self.ends, start, side="right")
            offset = start - (self.ends[i - 1] if i else 0)
            rows.append(self.shards[i][offset:offset + self.block_size + 1])
            if self.vocab_size and rows[-1].max() >= self.vocab_size:
                path = getattr(self.shards[i], "filename", f"train shard {i}")  # a memmap knows its file
                check_tokens(path, rows[-1], self.vocab_size, offset)
        if self.vocab_size:
            rows = rows[rank * share:(rank + 1) * share]
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

# -----------------------------------------------------------------------------
# tokenizers

# encode_batch(texts) gives each text's tokens as a uint16 array, the dtype of the shards;
# decode_bytes(ids) their UTF-8 bytes, none for end-of-text; a token can end mid-character,
# so a stream of them wants an incremental UTF-8 decoder

class ByteTokenizer:
    """UTF-8 bytes. NUL never occurs in text, so it is free to mark the end of a document."""
    name, vocab_size, eot_id = "byte", 256, 0

    def encode_batch(self, texts):
        return [self.encode_bytes(t.encode()) for t in texts]

    def encode_bytes(self, data):
        """Any bytes, text or not, less the NULs, which would read as ends of documents."""
        return np.frombuffer(data.replace(b"\0", b""), dtype=np.uint8).astype(np.uint16)

    def decode_bytes(self, ids):
        ids = np.asarray(ids, dtype=np.uint8)
        return ids[ids != self.eot_id].tobytes()

    def decode(self, ids):
        return self.decode_bytes(ids).decode(errors="replace")

    def token_bytes(self):
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.eot_id] = 0
        return lengths

# GPT-2's vocabulary, MIT-licensed by OpenAI, ships here so that nothing is downloaded: tiktoken's
# r50k_base.tiktoken, which must have the sha256 tiktoken publishes for it
GPT2_RANKS = Path(__file__).resolve().parents[2] / "gpt2.tiktoken"
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

def gpt2_ranks():
    # read here, not by tiktoken.load, which copies even a local file into its cache folder and
    # fails where that folder is read-only
    data = GPT2_RANKS.read_bytes()
    if hashlib.sha256(data).hexdigest() != GPT2_SHA256:
        raise ValueError(f"{GPT2_RANKS} is not GPT-2's vocabulary (wrong sha256): restore it from git")
    return {base64.b64decode(token): int(rank) for token, rank in map(bytes.split, data.splitlines())}

class GPT2Tokenizer:
    """GPT-2 BPE. r50k_base has the same ranks as tiktoken's "gpt2", stored in one file."""
    name = "gpt2"

    def __init__(self):
        self.enc = tiktoken.Encoding(name="r50k_base", pat_str=r50k_pat_str, mergeable_ranks=gpt2_ranks(),
                                     special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
        self.vocab_size, self.eot_id = self.enc.n_vocab, self.enc.eot_token

    def encode_batch(self, texts):
        # tiktoken drops the GIL while it encodes, so threads use every core; one slice per
        # thread, not one task per text, keeps the pool's overhead off short documents.
        # Straight to numpy, as building Python ints costs about as much as the BPE itself.
        # Text that spells a special token, like "<|endoftext|>", is encoded as plain text.
        def encode(part):
            return [self.enc.encode_to_numpy(t, disallowed_special=()).astype(np.uint16) for t in part]
        threads = os.cpu_count() or 1
        step = max(1, -(-len(texts) // threads))
        with ThreadPoolExecutor(threads) as pool:
            parts = pool.map(encode, [texts[i:i + step] for i in range(0, len(texts), step)])
        return [ids for part in parts for ids in part]

    def decode_bytes(self, ids):
        ids = np.asarray(ids)
        return self.enc.decode_bytes(ids[ids != self.eot_id].tolist())

    def decode(self, ids):
        return self.decode_bytes(ids).decode(errors="replace")

    def token_bytes(self):
        lengths = np.array([len(self.enc.decode_single_token_bytes(i))
                            for i in range(self.vocab_size)], dtype=np.int64)
        lengths[self.eot_id] = 0
        return lengths

def get_tokenizer(name):
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}: choose from {', '.join(TOKENIZERS)}")
    return GPT2Tokenizer() if name == "gpt2" else ByteTokenizer()

def load_tokenizer(path, ckpt):
    """The tokenizer of the data a checkpoint (at path) was trained on, or a ConfigError of one line."""
    if "tokenizer" not in ckpt:
        raise ConfigError(f"{path}: has no 'tokenizer' (its data's meta.json) to decode with: "
                          "not written by this train.py")
    try:
        return get_tokenizer(ckpt["tokenizer"]["tokenizer"])
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def token_bytes(tokenizer_name):
    """Each token's length in UTF-8 bytes (0 for end-of-text), so bits per byte is exact."""
    return get_tokenizer(tokenizer_name).token_bytes()


# -----------------------------------------------------------------------------
# What a training run reads

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
