"""
Turn text into the token shards that train.py reads.

    python prepare_data.py --dataset=pydocs --tokenizer=byte           # offline, seconds
    python prepare_data.py --dataset=pysource                           # offline, minutes
    python prepare_data.py --dataset=pysource --input=DIR ...          # other folders' .py files
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

pysource is Python code: the .py files of this interpreter's standard library and installed
packages (or of --input folders), one file a document, each file once however many copies of it
there are, in the order of their contents' sha256, so that which files validation holds depends on
the files alone and --max_tokens takes a sample of them all. Each file keeps its own licence: build
the corpus on the machine that trains on it, and never ship it.
"""
import ast
import hashlib
import importlib
import io
import json
import os
import platform
import sys
import sysconfig
import time
import tokenize as python_tokens
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lib.training.configurator import ArgumentParser, run_main
from lib.training.data import (DATASETS, TOKENIZERS, get_tokenizer, read_shard, read_state, write_atomic,
                               write_shard)

BATCH_DOCS = 2048  # documents per tokenizer call: enough work to keep every thread busy

# -----------------------------------------------------------------------------
# sources: each yields (list of texts, fraction of the source read) from document `skip` on

def list_batches(docs, read=None):
    """Batches of docs, or of read(doc) for each, read only when its batch is reached."""
    def batches(skip):
        for i in range(skip, len(docs), BATCH_DOCS):
            part = docs[i:i + BATCH_DOCS]
            yield [read(doc) for doc in part] if read else part, min(i + BATCH_DOCS, len(docs)) / len(docs)
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

# sysconfig's folders of this interpreter's Python code: the standard library, then the installed
# packages, pure and compiled (one folder in most installs)
PYSOURCE_FOLDERS = ("stdlib", "purelib", "platlib")

def scan_python_file(path):
    """(sha256 of the bytes, their length, the encoding they decode in), the encoding as Python reads
    source (PEP 263: UTF-8 unless the file declares another), None where they do not decode in it."""
    data = path.read_bytes()
    try:
        encoding = python_tokens.detect_encoding(io.BytesIO(data).readline)[0]
        data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError):  # a bad declaration, or bytes that are not it
        encoding = None
    return hashlib.sha256(data).hexdigest(), len(data), encoding

def python_files(inputs):
    """(description, files) for pysource: the .py files under inputs, else under PYSOURCE_FOLDERS,
    each content once, in the order of its sha256, as (path, encoding). Empty files are no text, and
    a file that does not decode is skipped and said."""
    known = sysconfig.get_paths()
    folders = inputs or list(dict.fromkeys(known[key] for key in PYSOURCE_FOLDERS
                                           if Path(known[key]).is_dir()))
    found = sorted({path.resolve() for path in find_files(folders, ".py")})  # a folder inside another: once
    with ThreadPoolExecutor(8) as pool:  # reading and hashing wait on the disk and drop the GIL
        scanned = list(pool.map(scan_python_file, found, chunksize=64))
    unique, undecodable, empty = {}, [], 0
    for path, (digest, size, encoding) in zip(found, scanned):
        if size == 0:
            empty += 1
        elif encoding is None:
            undecodable.append(path)
        else:
            unique.setdefault(digest, (path, encoding, size))  # the first path, in sorted order
    if undecodable:
        more = " ..." if len(undecodable) > 3 else ""
        print(f"warning: {len(undecodable)} .py files do not decode in the encoding they declare and are "
              f"skipped: {', '.join(map(str, undecodable[:3]))}{more}", file=sys.stderr)
    if not unique:
        raise FileNotFoundError(f"no .py files with text in {' '.join(map(str, folders))}")
    duplicates = len(found) - empty - len(undecodable) - len(unique)
    where = " ".join(map(str, folders))
    where = where if inputs else f"Python {platform.python_version()}'s library and packages, {where}"
    description = (f"pysource: {len(unique):,} .py files, {sum(f[2] for f in unique.values()):,} bytes, "
                   f"of {where} ({len(found):,} found: {duplicates:,} duplicates, {empty:,} empty and "
                   f"{len(undecodable):,} undecodable dropped)")
    return description, [unique[digest][:2] for digest in sorted(unique)]

def read_python_file(file):
    path, encoding = file
    return path.read_bytes().decode(encoding)

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
    if args.dataset == "pysource":
        description, files = python_files(args.input)
        return description, list_batches(files, read_python_file)
    if args.dataset == "text":
        files = find_files(args.input, ".txt")
        # one stray non-UTF-8 byte should not stop a corpus, but it is said: it is read as U+FFFD
        docs = []
        for file in files:
            data = file.read_bytes()
            try:
                docs.append(data.decode("utf-8"))
            except UnicodeDecodeError as e:
                print(f"warning: {file}: byte {e.start} ({data[e.start]:#04x}) is not UTF-8; such bytes are "
                      "read as U+FFFD", file=sys.stderr)
                docs.append(data.decode("utf-8", errors="replace"))
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
    if state and args.dataset == "pysource" and state["source"] != source:  # documents by index: the same
        raise ValueError(f"{out_dir} was begun on {state['source']}, and the folders now hold "
                         f"{source}: choose another --out_dir")  # files only
    print(f"reading {source}")
    state = state or dict(tokenizer=tok.name, vocab_size=tok.vocab_size, eot_id=tok.eot_id,
                          source=source, train_tokens=0, val_tokens=0, train_bytes=0, val_bytes=0,
                          shards={"train": [], "val": []}, documents=0, settings=settings, largest_token={})
    before, start = state["train_tokens"] + state["val_tokens"], time.time()
    tokenize(args, tok, batches, state, out_dir)
    write_atomic(meta, json.dumps(state, indent=2).encode())
    progress.unlink()
    made = state["train_tokens"] + state["val_tokens"] - before
    size = state["train_bytes"] + state["val_bytes"]
    print(f"{out_dir}: {state['documents']:,} documents, {size:,} bytes: "
          f"{state['train_tokens']:,} train and {state['val_tokens']:,} val tokens "
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
    parser.add_argument("--input", nargs="+", help="text: .txt files or folders; pysource: .py files or "
                        "folders instead of this Python's own; fineweb-edu: local parquet files or folders "
                        "instead of downloading")
    parser.add_argument("--out_dir", help="default: data/<dataset>-<tokenizer>")
    parser.add_argument("--subset", default="sample-10BT", help="fineweb-edu subset to download")
    parser.add_argument("--max_tokens", type=count, help="stop after this many tokens")
    parser.add_argument("--val_fraction", type=fraction, default=0.01,
                        help="share of the tokens held out for validation, by whole documents")
    parser.add_argument("--shard_tokens", type=count, default=100_000_000,
                        help="a train shard ends at the first document boundary past this many tokens")
    args = parser.parse_args(argv)
    if args.input and args.dataset == "pydocs":
        parser.error("--input is for --dataset=text, pysource or fineweb-edu; pydocs is built in")
    try:
        prepare(args)
    except BrokenPipeError:  # stdout's reader has gone (| head): run_main's to end the script quietly
        raise
    except (OSError, ValueError, ImportError) as e:  # bad input or no network: one line
        sys.exit(f"prepare_data.py: error: {e}")

if __name__ == "__main__":
    sys.exit(run_main(main))
