"""
Turn text into the token shards that train.py reads.

    python prepare_data.py --dataset=pydocs --tokenizer=byte           # offline, seconds
    python prepare_data.py --dataset=fineweb-edu --max_tokens=1e9      # the paper's data
    python prepare_data.py --dataset=fineweb-edu --input=DIR           # local parquet files
    python prepare_data.py --dataset=text --input notes/ book.txt

Writes data/<dataset>-<tokenizer>/ (or --out_dir): train_NNNNNN.bin and val_NNNNNN.bin
shards plus meta.json. A shard is a 24-byte header (magic, version, token count) followed
by little-endian uint16 tokens. Every document starts with the end-of-text token, and each
whole document goes to either train or val. meta.json is written last: a folder without it
is unfinished, and rerunning the same command resumes after the last finished shard. meta.json
(and progress.json, its unfinished form) records each shard's largest token, so that train.py
checks the tokens against the vocabulary without reading them; both are checked field by field
(META_FIELDS) wherever they are read.
"""
import ast
import base64
import hashlib
import importlib
import json
import os
import platform
import struct
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import tiktoken
import torch
from tiktoken_ext.openai_public import r50k_pat_str
from tqdm import tqdm

from lib.configurator import ArgumentParser, ConfigError, check_fields

MAGIC = b"LRKVTOK\0"
VERSION = 1
HEADER = struct.Struct("<8sQQ")  # magic, version, number of tokens
DATASETS = ("fineweb-edu", "pydocs", "text")
TOKENIZERS = ("gpt2", "byte")
BATCH_DOCS = 2048  # documents per tokenizer call: enough work to keep every thread busy

# -----------------------------------------------------------------------------
# shards and meta.json, and the batches drawn from them: the part train.py shares

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
GPT2_RANKS = Path(__file__).resolve().parent / "gpt2.tiktoken"
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

def token_bytes(tokenizer_name):
    """Each token's length in UTF-8 bytes (0 for end-of-text), so bits per byte is exact."""
    return get_tokenizer(tokenizer_name).token_bytes()

# -----------------------------------------------------------------------------
# sources: each yields (list of texts, fraction of the source read) from document `skip` on

def list_batches(docs):
    def batches(skip):
        for i in range(skip, len(docs), BATCH_DOCS):
            yield docs[i:i + BATCH_DOCS], min(i + BATCH_DOCS, len(docs)) / len(docs)
    return batches

def statements(node):
    # definitions are statements, so skipping expressions finds every docstring in a quarter
    # of the time ast.walk takes
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            yield from statements(child)

def docstrings(file):
    definitions = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in statements(ast.parse(file.read_bytes()))
            if isinstance(node, definitions) and (doc := ast.get_docstring(node))]

def pydocs_documents():
    """The English documentation inside this Python: the pydoc topics, then every module,
    class and function docstring of the standard library, in sorted file order. Modules are
    parsed, never imported: importing runs their code."""
    from pydoc_data.topics import topics  # plain data: a dict of strings
    docs = [topics[key] for key in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__"}
    files = []
    for folder, subfolders, names in os.walk(stdlib):
        subfolders[:] = [d for d in subfolders if d not in skip and not d.startswith("config-")]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    with ProcessPoolExecutor() as pool:  # parsing is most of the time; map keeps the order
        for found in pool.map(docstrings, sorted(files), chunksize=16):
            docs += found
    return docs

def find_files(inputs, suffix):
    if not inputs:
        raise ValueError(f"--input is required: the {suffix} files or folders to read")
    files = []
    for path in map(Path, inputs):
        if path.is_dir():
            files += sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"--input {path} does not exist")
    if not files:
        raise FileNotFoundError(f"no {suffix} files in {' '.join(inputs)}")
    return files

def require(module):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError("--dataset=fineweb-edu needs huggingface_hub and pyarrow: "
                          "pip install huggingface_hub pyarrow") from e

def parquet_batches(files, fetch):
    """Read the `text` column of FineWeb-Edu parquet files; fetch(file) gives a local path."""
    pq = require("pyarrow.parquet")

    def batches(skip):
        for k, file in enumerate(files):
            parquet = pq.ParquetFile(fetch(file))
            if "text" not in parquet.schema_arrow.names:
                raise ValueError(f"{file} has no 'text' column, so it is not FineWeb-Edu data")
            rows, read = parquet.metadata.num_rows, 0
            for group in range(parquet.num_row_groups):
                # whole row groups are skipped on metadata alone, so resuming costs no reading
                group_rows = parquet.metadata.row_group(group).num_rows
                if skip >= group_rows:
                    skip, read = skip - group_rows, read + group_rows
                    continue
                for batch in parquet.iter_batches(BATCH_DOCS, row_groups=[group], columns=["text"]):
                    texts = batch.column("text").to_pylist()[skip:]
                    skip, read = max(0, skip - batch.num_rows), read + batch.num_rows
                    if texts:
                        yield texts, (k + read / rows) / len(files)
    return batches

def hub_files(subset):
    hub = require("huggingface_hub")
    hub.logging.set_verbosity_error()  # its retry warnings would bury our one line
    repo = "HuggingFaceFW/fineweb-edu"
    folder = subset.replace("-", "/", 1) if subset.startswith("sample-") else f"data/{subset}"
    try:
        files = hub.HfApi().list_repo_files(repo, repo_type="dataset")
    except Exception as e:  # offline shows up as whatever the HTTP stack raises
        raise ConnectionError(f"cannot reach the Hugging Face hub ({type(e).__name__}); "
                              "fineweb-edu needs the network, or --input DIR with parquet files") from e
    files = sorted(f for f in files if f.startswith(folder + "/") and f.endswith(".parquet"))
    if not files:
        raise ValueError(f"{repo} has no parquet files for --subset={subset}")

    def fetch(file):  # downloaded only when reached, so --max_tokens downloads only what it needs
        try:
            return hub.hf_hub_download(repo, file, repo_type="dataset")
        except Exception as e:
            raise ConnectionError(f"downloading {file} failed ({type(e).__name__}); "
                                  "rerun the same command to resume") from e
    return files, fetch

def open_source(args):
    """(description, batches) for args.dataset, failing now on missing input or network."""
    if args.dataset == "pydocs":
        docs = pydocs_documents()
        return f"pydocs: Python {platform.python_version()} docstrings and pydoc topics", list_batches(docs)
    if args.dataset == "text":
        files = find_files(args.input, ".txt")
        # one stray non-UTF-8 byte should not stop a corpus
        docs = [file.read_text(encoding="utf-8", errors="replace") for file in files]
        return f"text: {' '.join(args.input)} ({len(files)} files)", list_batches(docs)
    if args.input:
        files = find_files(args.input, ".parquet")
        return f"fineweb-edu: {' '.join(args.input)} ({len(files)} files)", parquet_batches(files, str)
    files, fetch = hub_files(args.subset)
    return f"fineweb-edu: HuggingFaceFW/fineweb-edu {args.subset}", parquet_batches(files, fetch)

# -----------------------------------------------------------------------------
# tokenize into shards

def tokenize(args, tok, batches, state, out_dir):
    """Tokenize documents from state["documents"] on into shards, updating state. Each
    document goes to val while val holds less than its share of the tokens so far, else to
    train. Shards end at document boundaries, and after each one progress.json records how
    far the source was read, so a rerun continues from there."""
    lengths, eot = tok.token_bytes(), np.array([tok.eot_id], dtype=np.uint16)
    pending = {"train": [], "val": []}
    documents, train_pending = state["documents"], 0

    def flush(split):
        if pending[split]:
            tokens = np.concatenate(pending[split])
            pending[split] = []
            name = f"{split}_{len(state['shards'][split]):06d}.bin"
            out_dir.mkdir(parents=True, exist_ok=True)
            write_shard(out_dir / name, tokens)
            state["shards"][split].append(name)
            state["largest_token"][name] = int(tokens.max())
            state[f"{split}_bytes"] += int(np.bincount(tokens, minlength=len(lengths)) @ lengths)

    def checkpoint():
        flush("train")
        flush("val")
        state["documents"] = documents
        write_atomic(out_dir / "progress.json", json.dumps(state, indent=2).encode())

    def encoded():  # one token array per document; the bar's total estimated from how far we are
        for texts, done in batches(state["documents"]):
            ids = tok.encode_batch(texts)
            if not args.max_tokens:
                bar.total = round((bar.n + sum(len(x) + 1 for x in ids)) / done)
            yield from ids

    total = state["train_tokens"] + state["val_tokens"]
    with tqdm(total=args.max_tokens, initial=total, unit="tok", unit_scale=True) as bar:
        for ids in encoded():
            if total == args.max_tokens:  # a rerun resumed from the checkpoint taken at the limit
                break
            documents += 1
            if len(ids) == 0:
                continue
            tokens = np.concatenate([eot, ids])
            if args.max_tokens:
                tokens = tokens[:args.max_tokens - total]
            split = "val" if state["val_tokens"] < args.val_fraction * total else "train"
            pending[split].append(tokens)
            state[f"{split}_tokens"] += len(tokens)
            total += len(tokens)
            bar.update(len(tokens))
            if split == "train":
                train_pending += len(tokens)
            if train_pending >= args.shard_tokens:
                checkpoint()
                train_pending = 0
            if total == args.max_tokens:
                break
    if not state["train_tokens"] or not state["val_tokens"]:
        raise ValueError(f"too little text to fill both train and val ({documents} documents, "
                         f"{total} tokens): each document goes wholly to one of them")
    checkpoint()

def prepare(args):
    out_dir = Path(args.out_dir or f"data/{args.dataset}-{args.tokenizer}")
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    settings["input"] = args.input and [str(Path(p).resolve()) for p in args.input]
    meta, progress = out_dir / "meta.json", out_dir / "progress.json"
    found = [path for path in (meta, progress) if path.exists()]
    state = read_state(found[0]) if found else None
    if state and state["settings"] != settings:
        raise ValueError(f"{out_dir} holds data made with other settings "
                         f"({state['settings']}); choose another --out_dir")
    if meta.exists():
        print(f"{out_dir} is already complete; nothing to do")
        return
    if state:
        for split in ("train", "val"):
            for name in state["shards"][split]:
                read_shard(out_dir / name)
        print(f"resuming {out_dir} after {state['documents']:,} documents")
        state.setdefault("largest_token", {})  # begun before shards recorded it: from here on

    tok = get_tokenizer(args.tokenizer)
    source, batches = open_source(args)
    print(f"reading {source}")
    state = state or dict(tokenizer=tok.name, vocab_size=tok.vocab_size, eot_id=tok.eot_id,
                          source=source, train_tokens=0, val_tokens=0, train_bytes=0, val_bytes=0,
                          shards={"train": [], "val": []}, documents=0, settings=settings, largest_token={})
    before, start = state["train_tokens"] + state["val_tokens"], time.time()
    tokenize(args, tok, batches, state, out_dir)
    write_atomic(meta, json.dumps(state, indent=2).encode())
    progress.unlink()
    made = state["train_tokens"] + state["val_tokens"] - before
    print(f"{out_dir}: {state['train_tokens']:,} train and {state['val_tokens']:,} val tokens "
          f"({made / (time.time() - start):,.0f} tokens/s)")

def count(text):  # int(float()) so that 1e9 works
    try:
        n = int(float(text))
    except OverflowError:  # inf: argparse turns a ValueError into its one-line error
        raise ValueError from None
    if n < 1:
        raise ValueError
    return n

def fraction(text):
    x = float(text)
    if not 0 < x < 1:
        raise ValueError
    return x

def main(argv=None):
    parser = ArgumentParser(prog="prepare_data.py",
                            description="Turn text into the token shards that train.py reads.")
    parser.add_argument("--dataset", default="pydocs", choices=DATASETS)
    parser.add_argument("--tokenizer", default="gpt2", choices=TOKENIZERS)
    parser.add_argument("--input", nargs="+", help="text: .txt files or folders; fineweb-edu: "
                        "local parquet files or folders instead of downloading")
    parser.add_argument("--out_dir", help="default: data/<dataset>-<tokenizer>")
    parser.add_argument("--subset", default="sample-10BT", help="fineweb-edu subset to download")
    parser.add_argument("--max_tokens", type=count, help="stop after this many tokens")
    parser.add_argument("--val_fraction", type=fraction, default=0.01,
                        help="share of the tokens held out for validation, by whole documents")
    parser.add_argument("--shard_tokens", type=count, default=100_000_000,
                        help="a train shard ends at the first document boundary past this many tokens")
    args = parser.parse_args(argv)
    if args.input and args.dataset == "pydocs":
        parser.error("--input is for --dataset=text or fineweb-edu; pydocs is built in")
    try:
        prepare(args)
    except (OSError, ValueError, ImportError) as e:  # bad input or no network: one line
        sys.exit(f"prepare_data.py: error: {e}")

if __name__ == "__main__":
    main()
