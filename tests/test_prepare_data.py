"""Tests for prepare_data.py. Offline: the GPT-2 ranks ship in gpt2.tiktoken, and the
FineWeb-Edu path reads a parquet file written here with FineWeb-Edu's schema."""
import codecs
import hashlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import tiktoken.load
from tiktoken_ext import openai_public

import prepare_data as pd
from lib.training import data as shards
from lib.training.data import get_tokenizer, load_meta, read_shard, shard_paths, token_bytes, write_shard

REPO = Path(__file__).resolve().parents[1]  # the repository, above tests/

WORDS = ("the key and value cache of attention is low rank so we store a small projection "
         "instead of every head ünïcödé 数据 naïve café 🙂 tabs\tand\nnewlines").split(" ")

def make_texts(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 300))) for _ in range(n)]

def write_fineweb_parquet(path, texts):
    # the columns of HuggingFaceFW/fineweb-edu; only `text` is read
    n = len(texts)
    table = pa.table({
        "text": texts,
        "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{i}" for i in range(n)],
        "file_path": ["s3://commoncrawl/crawl-data/example.warc.gz"] * n,
        "language": ["en"] * n,
        "language_score": [0.95] * n,
        "token_count": [len(t) for t in texts],
        "score": [3.2] * n,
        "int_score": [3] * n,
    })
    pq.write_table(table, path, row_group_size=64)

def documents(data_dir, split):
    """The texts of a split's documents, read back from its shards."""
    meta = load_meta(data_dir)
    tok = get_tokenizer(meta["tokenizer"])
    tokens = np.concatenate([read_shard(p) for p in shard_paths(data_dir, split)])
    assert tokens[0] == tok.eot_id
    starts = np.flatnonzero(tokens == tok.eot_id)
    return [tok.decode(doc[1:]) for doc in np.split(tokens, starts[1:])]

def check_dataset(data_dir, texts):
    """The shards hold exactly the input documents, tokenized, each in one split, and the
    counts agree with meta.json."""
    meta = load_meta(data_dir)
    tok, lengths = get_tokenizer(meta["tokenizer"]), token_bytes(meta["tokenizer"])
    train, val = documents(data_dir, "train"), documents(data_dir, "val")
    assert train and val and not set(train) & set(val)
    assert sorted(train + val) == sorted(texts)
    for split, docs in (("train", train), ("val", val)):
        tokens = np.concatenate([read_shard(p) for p in shard_paths(data_dir, split)])
        expected = np.concatenate([[tok.eot_id, *ids] for ids in tok.encode_batch(docs)])
        assert np.array_equal(tokens, expected)
        assert meta[f"{split}_tokens"] == len(tokens)
        assert meta[f"{split}_bytes"] == sum(len(d.encode()) for d in docs) == lengths[tokens].sum()
    return meta

def run_cli(*args, **env):
    return subprocess.run([sys.executable, "prepare_data.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})

def contents(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}

def snapshot(folder):
    """Contents plus inode and mtime: a file rewritten with the same bytes still differs."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}

# -----------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    assert (tok.vocab_size, tok.eot_id) == (256, 0)
    texts = ["Hello world", "ünïcödé 数据 🙂\n", "nul\0bytes\0are dropped", ""]
    ids = tok.encode_batch(texts)
    assert ids[0].dtype == np.uint16 and ids[0].tolist() == list(b"Hello world")
    assert [tok.decode(x) for x in ids] == [t.replace("\0", "") for t in texts]
    assert all(tok.eot_id not in x for x in ids)

def test_gpt2_known_ids():
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    ids = tok.encode_batch(["Hello world", " world", "<|endoftext|>"])
    assert ids[0].dtype == np.uint16 and [x.tolist() for x in ids[:2]] == [[15496, 995], [995]]
    assert tok.eot_id not in ids[2]  # text that spells the marker is still text
    texts = make_texts(50)
    assert [tok.decode(x) for x in tok.encode_batch(texts)] == texts

def test_gpt2_is_tiktokens_r50k_base(monkeypatch):
    """The shipped file has the hash tiktoken publishes for r50k_base, and tiktoken's own
    r50k_base, its ranks read from that file by tiktoken's loader, encodes as ours does."""
    published = []
    def load(url, expected_hash):
        assert url.endswith("/r50k_base.tiktoken")
        published.append(expected_hash)
        return tiktoken.load.load_tiktoken_bpe(str(shards.GPT2_RANKS))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file without copying it into a cache
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", load)
    theirs = tiktoken.Encoding(**openai_public.r50k_base())
    assert published == [shards.GPT2_SHA256] == [hashlib.sha256(shards.GPT2_RANKS.read_bytes()).hexdigest()]
    ours = get_tokenizer("gpt2").enc
    assert (ours.name, ours.n_vocab, ours.eot_token) == (theirs.name, theirs.n_vocab, theirs.eot_token)
    assert ours.special_tokens_set == theirs.special_tokens_set
    assert all(ours.decode_single_token_bytes(i) == theirs.decode_single_token_bytes(i)
               for i in range(ours.n_vocab))
    text = ("<|endoftext|>x<|endoftext|> <|fim_prefix|><|endofprompt|> <|endoftext\n"
            "  two  spaces,\ttabs\t\t and trailing   \n\n\n   \r\n \u00a0nbsp\u3000ideographic\u200bzwsp\n"
            "it's we'll they'RE I'd don\u2019t 123456789 3.14159 1,000,000 x2y3\n"
            "ünïcödé 数据 naïve café 🙂 \U0001f469\u200d\U0001f467 "
            "العربية नमस्ते ﷽\n"
            + " ".join(make_texts(20)) + "   ")
    for special in ({"disallowed_special": ()}, {"allowed_special": "all"}):
        assert ours.encode(text, **special) == theirs.encode(text, **special)
    assert ours.encode(text, allowed_special="all").count(ours.eot_token) == 2

def test_corrupt_gpt2_vocabulary_is_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(shards.GPT2_RANKS.read_bytes()[:-1000])
    monkeypatch.setattr(shards, "GPT2_RANKS", bad)
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(SystemExit) as error:
        pd.main(["--dataset=text", f"--input={tmp_path / 'a.txt'}", f"--out_dir={tmp_path / 'out'}"])
    message = str(error.value)
    assert message.startswith("prepare_data.py: error: ") and "\n" not in message
    assert str(bad) in message and "sha256" in message and not (tmp_path / "out").exists()

@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_decode_bytes_feeds_an_incremental_utf8_decoder(name):
    tok = get_tokenizer(name)
    text = "ünïcödé 数据 naïve café 🙂 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n"
    ids = tok.encode_batch([text])[0]
    assert tok.decode_bytes([tok.eot_id, *ids, tok.eot_id]) == text.encode()
    pieces = [tok.decode_bytes([i]) for i in ids]
    assert b"".join(pieces) == text.encode() and tok.decode_bytes([tok.eot_id]) == b""
    decoder = codecs.getincrementaldecoder("utf-8")()
    assert "".join(decoder.decode(piece) for piece in pieces) + decoder.decode(b"", final=True) == text
    prefixes = [ids[:k] for k in range(len(ids) + 1)]
    assert any("\ufffd" in tok.decode(x) for x in prefixes)  # some end mid-character
    assert all(tok.decode(x) == tok.decode_bytes(x).decode(errors="replace") for x in prefixes)

@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_token_bytes_count_utf8_bytes(name):
    tok = get_tokenizer(name)
    lengths = token_bytes(name)
    assert lengths.shape == (tok.vocab_size,) and lengths[tok.eot_id] == 0
    for text in make_texts(20):
        assert lengths[tok.encode_batch([text])[0]].sum() == len(text.encode())

def test_read_shard_round_trip_and_errors(tmp_path):
    tokens = np.array([0, 1, 2, 50256, 65535], dtype=np.uint16)
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    shard = read_shard(path)
    assert shard.dtype == np.uint16 and np.array_equal(shard, tokens)
    assert not shard.flags.writeable

    data = path.read_bytes()
    cases = {"truncated": data[:-1], "short_header": data[:10],
             "bad_magic": b"NOTTOKEN" + data[8:],
             "bad_version": data[:8] + (99).to_bytes(8, "little") + data[16:]}
    for name, broken in cases.items():
        bad = tmp_path / f"{name}.bin"
        bad.write_bytes(broken)
        with pytest.raises(ValueError) as error:
            read_shard(bad)
        assert str(bad) in str(error.value) and "\n" not in str(error.value)

def test_fineweb_parquet_end_to_end(tmp_path):
    texts = make_texts(300)
    (tmp_path / "in").mkdir()
    write_fineweb_parquet(tmp_path / "in" / "000_00000.parquet", texts[:180])
    write_fineweb_parquet(tmp_path / "in" / "001_00000.parquet", texts[180:])
    out = tmp_path / "out"
    pd.main(["--dataset=fineweb-edu", f"--input={tmp_path / 'in'}", f"--out_dir={out}",
             "--shard_tokens=4000", "--val_fraction=0.1"])
    meta = check_dataset(out, texts)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("gpt2", 50257, 50256)
    assert len(meta["shards"]["train"]) > 3 and meta["documents"] == 300
    assert 0.05 < meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) < 0.15
    assert not list(out.glob("*.tmp")) and not (out / "progress.json").exists()

def test_text_folder_and_max_tokens(tmp_path):
    texts = make_texts(40, seed=1)
    for i, text in enumerate(texts):
        folder = tmp_path / "in" / f"part{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.txt").write_text(text, encoding="utf-8")
    pd.main(["--dataset=text", "--tokenizer=byte", f"--input={tmp_path / 'in'}",
             f"--out_dir={tmp_path / 'all'}"])
    check_dataset(tmp_path / "all", texts)

    pd.main(["--dataset=text", "--tokenizer=byte", f"--input={tmp_path / 'in'}",
             f"--out_dir={tmp_path / 'cut'}", "--max_tokens=1000"])
    meta = load_meta(tmp_path / "cut")
    assert meta["train_tokens"] + meta["val_tokens"] == 1000

def test_a_text_file_that_is_not_utf8_is_read_with_a_warning(tmp_path, capsys):
    """A stray byte does not stop a corpus: it is read as U+FFFD, and said in one line naming the file,
    the byte and its offset."""
    texts = make_texts(20, seed=2)
    (tmp_path / "in").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i}.txt").write_text(text, encoding="utf-8")
    bad = tmp_path / "in" / "3.txt"
    bad.write_bytes(texts[3][:7].encode() + b"\xff" + texts[3][7:].encode())
    pd.main(["--dataset=text", "--tokenizer=byte", f"--input={tmp_path / 'in'}",
             f"--out_dir={tmp_path / 'out'}"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: {bad}: byte 7 (0xff) is not UTF-8; such bytes are read as U+FFFD"]
    check_dataset(tmp_path / "out", texts[:3] + [texts[3][:7] + "\ufffd" + texts[3][7:]] + texts[4:])

def write_python_files(folder, texts, names):
    for text, name in zip(texts, names):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")

def test_pysource_keeps_each_file_once_and_whole_in_one_split(tmp_path, capsys):
    """pysource: each content once however many files hold it, each file one document wholly in train
    or in val, meta.json's counts those of the shards, and the split decided by the contents alone:
    the same files under other names and folders give the same shards."""
    texts = [f"def f{i}():\n    return {i!r}  # {text}\n" for i, text in enumerate(make_texts(30, seed=4))]
    # a second copy of text 0 elsewhere, an empty __init__.py, a .txt file, and Latin-1 that says so
    latin1 = "# -*- coding: latin-1 -*-\nname = 'café'\n"
    names = [f"pkg{i % 4}/m{i}.py" for i in range(30)] + ["copy/same.py", "pkg0/__init__.py", "notes.txt"]
    write_python_files(tmp_path / "a", texts + [texts[0], "", "not python"], names)
    (tmp_path / "a" / "pkg1" / "latin1.py").write_bytes(latin1.encode("latin-1"))
    broken = tmp_path / "a" / "pkg1" / "broken.py"
    broken.write_bytes(b"x = '\xff'\n")  # UTF-8, as it declares no other encoding, and it is not
    args = ["--dataset=pysource", "--val_fraction=0.2"]
    pd.main(args + [f"--input={tmp_path / 'a'}", f"--out_dir={tmp_path / 'out'}"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: 1 .py files do not decode in the encoding they declare and are skipped: "
                        f"{broken}"]
    meta = check_dataset(tmp_path / "out", texts + [latin1])
    assert meta["documents"] == 31 and meta["tokenizer"] == "gpt2"
    assert "31 .py files" in meta["source"]
    assert "(34 found: 1 duplicates, 1 empty and 1 undecodable dropped)" in meta["source"]

    # the same contents, renamed and moved: the same documents in the same splits, in the same order
    write_python_files(tmp_path / "b", [texts[0], *texts[::-1]],
                       ["z/first.py", *(f"q{i}.py" for i in range(30))])
    (tmp_path / "b" / "lat.py").write_bytes(latin1.encode("latin-1"))
    pd.main(args + [f"--input={tmp_path / 'b'}", f"--out_dir={tmp_path / 'renamed'}"])
    def shards_of(folder):
        return {name: data for name, data in contents(folder).items() if name.endswith(".bin")}
    assert shards_of(tmp_path / "renamed") == shards_of(tmp_path / "out")

def test_pydocs_is_deterministic(tmp_path):
    for name in ("a", "b"):
        pd.main(["--dataset=pydocs", "--tokenizer=byte", f"--out_dir={tmp_path / name}"])
    meta = load_meta(tmp_path / "a")
    assert 1_000_000 < meta["train_bytes"] + meta["val_bytes"] < 4_000_000
    assert meta["val_tokens"] > 0 and meta["vocab_size"] == 256
    assert contents(tmp_path / "a") == contents(tmp_path / "b")

def kill_when_writing(monkeypatch, name, partial_bytes=0):
    """write_atomic (lib/training/data.py's, which prepare_data.py's shards and meta.json go through)
    raises KeyboardInterrupt, as a kill would, when it comes to the file `name`, leaving its first
    partial_bytes in name.tmp; it writes every other file as usual."""
    write_atomic = shards.write_atomic
    def dying(path, *parts):
        if path.name == name:
            path.with_name(path.name + ".tmp").write_bytes(b"".join(parts)[:partial_bytes])
            raise KeyboardInterrupt
        write_atomic(path, *parts)
    monkeypatch.setattr(shards, "write_atomic", dying)
    monkeypatch.setattr(pd, "write_atomic", dying)

def test_rerun_resumes_after_interruption(tmp_path, monkeypatch, capsys):
    texts = make_texts(300, seed=2)
    write_fineweb_parquet(tmp_path / "data.parquet", texts)
    args = ["--dataset=fineweb-edu", f"--input={tmp_path / 'data.parquet'}", "--shard_tokens=3000",
            "--val_fraction=0.1"]
    pd.main(args + [f"--out_dir={tmp_path / 'whole'}"])

    # killed halfway through writing the third train shard
    kill_when_writing(monkeypatch, "train_000002.bin", partial_bytes=1000)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        pd.main(args + [f"--out_dir={out}"])
    assert sorted(p.name for p in out.glob("*.bin")) == [
        "train_000000.bin", "train_000001.bin", "val_000000.bin", "val_000001.bin"]
    for shard in out.glob("*.bin"):
        read_shard(shard)
    with pytest.raises(FileNotFoundError):
        load_meta(out)

    monkeypatch.undo()
    before = snapshot(out)
    capsys.readouterr()
    pd.main(args + [f"--out_dir={out}"])
    assert "resuming" in capsys.readouterr().out
    after = snapshot(out)
    assert all(after[name] == before[name] for name in before if name.endswith(".bin"))
    assert contents(out) == contents(tmp_path / "whole")
    check_dataset(out, texts)

    pd.main(args + [f"--out_dir={out}"])
    assert "already complete" in capsys.readouterr().out
    assert snapshot(out) == after

def test_rerun_killed_at_the_token_limit_adds_nothing(tmp_path, monkeypatch):
    # the last checkpoint holds every token --max_tokens asks for; killed before meta.json
    texts = make_texts(40, seed=3)
    (tmp_path / "in").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i}.txt").write_text(text, encoding="utf-8")
    args = ["--dataset=text", "--tokenizer=byte", f"--input={tmp_path / 'in'}", "--max_tokens=1000"]
    pd.main(args + [f"--out_dir={tmp_path / 'whole'}"])
    kill_when_writing(monkeypatch, "meta.json")
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        pd.main(args + [f"--out_dir={out}"])
    monkeypatch.undo()
    pd.main(args + [f"--out_dir={out}"])
    assert contents(out) == contents(tmp_path / "whole")

def test_pysource_rerun_resumes_after_interruption(tmp_path, monkeypatch):
    """The files' order, by their hashes, is the same on the rerun, so it resumes where the kill struck."""
    texts = [f"x{i} = {text!r}\n" for i, text in enumerate(make_texts(60, seed=5))]
    write_python_files(tmp_path / "in", texts, [f"p{i % 5}/m{i}.py" for i in range(60)])
    args = ["--dataset=pysource", "--tokenizer=byte", f"--input={tmp_path / 'in'}", "--shard_tokens=3000"]
    pd.main(args + [f"--out_dir={tmp_path / 'whole'}"])
    kill_when_writing(monkeypatch, "train_000002.bin", partial_bytes=100)
    with pytest.raises(KeyboardInterrupt):
        pd.main(args + [f"--out_dir={tmp_path / 'resumed'}"])
    monkeypatch.undo()
    pd.main(args + [f"--out_dir={tmp_path / 'resumed'}"])
    assert contents(tmp_path / "resumed") == contents(tmp_path / "whole")
    check_dataset(tmp_path / "whole", texts)
    # a file added between the kill and the rerun: documents resumed by index would be other files'
    kill_when_writing(monkeypatch, "train_000002.bin", partial_bytes=100)
    with pytest.raises(KeyboardInterrupt):
        pd.main(args + [f"--out_dir={tmp_path / 'changed'}"])
    monkeypatch.undo()
    write_python_files(tmp_path / "in", ["y = 1\n"], ["p0/new.py"])
    kept = contents(tmp_path / "changed")
    with pytest.raises(SystemExit, match="^prepare_data.py: error: [^\n]*was begun on pysource: 60 .py files"
                                         "[^\n]*: choose another --out_dir$"):
        pd.main(args + [f"--out_dir={tmp_path / 'changed'}"])
    assert contents(tmp_path / "changed") == kept

def test_load_meta_names_the_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = {"data/pydocs-byte": "`python prepare_data.py --dataset=pydocs --tokenizer=byte`",
             tmp_path / "fineweb-edu-gpt2":
                 f"--dataset=fineweb-edu --tokenizer=gpt2 --out_dir={tmp_path}/fineweb-edu-gpt2`",
             "mine": "--dataset=... --tokenizer=... --out_dir=mine`"}
    for data_dir, command in cases.items():
        with pytest.raises(FileNotFoundError, match=re.escape(command)):
            shard_paths(data_dir, "train")

# -----------------------------------------------------------------------------
# bad input: one line on stderr, a non-zero exit, nothing written or overwritten

BAD_INPUT = [
    (["--dataset=wikipedia"], "invalid choice: 'wikipedia'"),
    (["--tokenizer=llama"], "invalid choice: 'llama'"),
    (["--dataset=text"], "--input is required"),
    (["--dataset=text", "--input=no/such/folder"], "no/such/folder does not exist"),
    (["--dataset=text", "--input={empty}"], "no .txt files"),
    (["--dataset=fineweb-edu", "--input={empty}"], "no .parquet files"),
    (["--dataset=pysource", "--input={empty}"], "no .py files"),
    (["--val_fraction=1.5"], "invalid fraction value"),
    (["--max_tokens=inf"], "invalid count value"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_is_one_line(tmp_path, args, message, capsys):
    """In-process, main's error: argparse's line on stderr and exit code 2, or the message that
    sys.exit prints as one line with exit code 1."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stopped:
        pd.main([*(a.format(empty=tmp_path / "empty") for a in args), f"--out_dir={tmp_path / 'out'}"])
    code = stopped.value.code
    line = code + "\n" if isinstance(code, str) else capsys.readouterr().err
    assert code not in (0, None) and line.count("\n") == 1 and message in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [BAD_INPUT[1], BAD_INPUT[3]])
def test_bad_input_from_the_command_line_is_one_line_on_stderr(tmp_path, args, message):
    result = run_cli(*args, f"--out_dir={tmp_path / 'out'}")
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tmp_path / "out").exists()

def test_corpus_too_small_writes_nothing(tmp_path):
    (tmp_path / "only.txt").write_text("one file is one document, so val would be empty")
    result = run_cli("--dataset=text", "--tokenizer=byte", f"--input={tmp_path / 'only.txt'}",
                     f"--out_dir={tmp_path / 'out'}")
    assert result.returncode != 0 and "too little text" in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()

def test_hub_unreachable_is_one_line(tmp_path):
    result = run_cli("--dataset=fineweb-edu", f"--out_dir={tmp_path / 'out'}", HF_HUB_OFFLINE="1")
    assert result.returncode != 0 and result.stderr.count("\n") == 1
    assert "needs the network" in result.stderr and "--input DIR" in result.stderr
    assert not (tmp_path / "out").exists()

def test_other_settings_do_not_overwrite(tmp_path):
    texts = make_texts(30, seed=3)
    (tmp_path / "in").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i:02d}.txt").write_text(text)
    args = ["--dataset=text", "--tokenizer=byte", f"--input={tmp_path / 'in'}",
            f"--out_dir={tmp_path / 'out'}"]
    pd.main(args)
    before = snapshot(tmp_path / "out")
    result = run_cli(*args, "--val_fraction=0.5")
    assert result.returncode != 0 and result.stderr.count("\n") == 1
    assert "other settings" in result.stderr
    assert snapshot(tmp_path / "out") == before

def small_dataset(tmp_path, *flags):
    """pd.main's arguments for 40 texts as files, into tmp_path / "out", and flags."""
    (tmp_path / "in").mkdir()
    for i, text in enumerate(make_texts(40, seed=3)):
        (tmp_path / "in" / f"{i}.txt").write_text(text, encoding="utf-8")
    return ["--dataset=text", "--tokenizer=byte", f"--input={tmp_path / 'in'}",
            f"--out_dir={tmp_path / 'out'}", *flags]

def test_meta_records_each_shards_largest_token(tmp_path):
    pd.main(small_dataset(tmp_path, "--shard_tokens=2000"))
    meta = load_meta(tmp_path / "out")
    largest = {name: int(read_shard(tmp_path / "out" / name).max())
               for name in meta["shards"]["train"] + meta["shards"]["val"]}
    assert len(largest) > 2 and meta["largest_token"] == largest

# each edit gives meta.json's new contents, from what prepare_data.py wrote
@pytest.mark.parametrize("edit, message", [
    (lambda m: {k: v for k, v in m.items() if k != "shards"}, "field 'shards' is missing"),
    (lambda m: {**m, "shards": {"train": m["shards"]["train"]}}, "field 'shards.val' is missing"),
    (lambda m: {**m, "shards": {**m["shards"], "train": "x.bin"}}, "'shards.train' is str, expected list"),
    (lambda m: {**m, "shards": {**m["shards"], "train": [3]}}, "'shards.train[0]' is int, expected str"),
    (lambda m: {**m, "shards": {**m["shards"], "train": ["../x.bin"]}}, "names '../x.bin', not a shard file"),
    (lambda m: {**m, "vocab_size": "256"}, "field 'vocab_size' is str, expected int"),
    (lambda m: {**m, "vocab_size": True}, "field 'vocab_size' is bool, expected int"),
    (lambda m: [1, 2], "it is list, expected dict"),
    (lambda m: "{not json", "not JSON"),
])
def test_hand_edited_meta_json_names_the_file_and_the_field(tmp_path, edit, message):
    pd.main(small_dataset(tmp_path))
    path = tmp_path / "out" / "meta.json"
    edited = edit(json.loads(path.read_text()))
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(ValueError) as error:
        load_meta(tmp_path / "out")
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)

def test_hand_edited_progress_json_is_one_line(tmp_path, monkeypatch):
    args = small_dataset(tmp_path)
    kill_when_writing(monkeypatch, "meta.json")
    with pytest.raises(KeyboardInterrupt):
        pd.main(args)
    monkeypatch.undo()
    progress = tmp_path / "out" / "progress.json"
    state = json.loads(progress.read_text())
    del state["settings"]
    progress.write_text(json.dumps(state))
    with pytest.raises(SystemExit) as exit:
        pd.main(args)
    assert exit.value.code == f"prepare_data.py: error: {progress}: field 'settings' is missing"
