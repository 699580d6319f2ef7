"""sample.py on a tiny LRKV checkpoint that train.py writes: a greedy sample is generate()'s, with
the cache and without; a seed reproduces a sample and draws what generate() draws; the flags reach
decode.stream; end-of-text ends a sample; a character split over byte tokens prints whole as soon as
it is; the last line reports the speed and kv_cache_bytes; bad input is one line and exit code 2."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lib.training import checkpoint

from lib.training import hardware

from lib.training.data import get_tokenizer
import sample
import train
from lib.attention.decode import compiled_decode, exact_step, generate
from lib.attention.quant import Int8KVCache
from lib.attention.ring import RingKVCache
from test_train import data_dir, flags, flip_a_bit  # noqa: F401 (data_dir is a fixture)

REPO = Path(__file__).resolve().parents[1]  # the repository, above tests/
BYTES = get_tokenizer("byte")
PROMPT, NEW = "def ", 20
SEPARATOR = "\n---------------\n"


@pytest.fixture(scope="module")
def ckpt(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # float32 by choice, as config/demo.py: sample.py then decodes in float32, as `model` below does
    assert train.main(flags(data_dir=data_dir, out_dir=out, max_steps=4, dtype="float32")) == 0
    return out / "ckpt.pt"


@pytest.fixture(scope="module")
def model(ckpt):
    return checkpoint.load_checkpoint(ckpt, "cpu")[1].eval()


def run(capsys, ckpt, *args, read_before=False, err_says=""):
    """sample.py's samples and its last line, after its first, the precision's (unless the test has
    read it already: read_before); stderr empty, or the one line that err_says is in."""
    code = sample.main([str(ckpt), "--device=cpu", f"--max_new_tokens={NEW}", *args])
    out, err = capsys.readouterr()
    assert code == 0 and (err == "" if not err_says else err.count("\n") == 1 and err_says in err), err
    if not read_before:
        first, out = without_precision_line(out)
    *samples, last = out.split(SEPARATOR)
    assert last.endswith("\n") and last.count("\n") == 1
    return samples, last


def without_precision_line(out):
    """(sample.py's first line, what follows it), the first line checked to be the precision's."""
    first, out = out.split("\n", 1)
    assert re.fullmatch(r"precision: (float32|bfloat16|float16) weights \(.+\) \| "
                        r"(KV cache .+ \(.+, 1 x \d+ tokens\)|no KV cache \(--no_cache\))", first), first
    return first, out


def reference(model, prompt, max_new_tokens=NEW, **kwargs):
    """What sample.py prints of one sample, from generate(): the text up to the end-of-text that
    ends the document, and the tokens drawn up to it, it included."""
    ids = [BYTES.eot_id, *BYTES.encode_batch([prompt])[0].tolist()]
    new = generate(model, torch.tensor([ids]), max_new_tokens, **kwargs)[0, len(ids):].tolist()
    drawn = new.index(BYTES.eot_id) + 1 if BYTES.eot_id in new else max_new_tokens
    return BYTES.decode(ids + new[:drawn]), drawn


@pytest.mark.parametrize("cache", [True, False])
def test_greedy_sample_is_generate(capsys, ckpt, model, cache):
    samples, last = run(capsys, ckpt, f"--prompt={PROMPT}", "--temperature=0", "--num_samples=2",
                        *([] if cache else ["--no_cache"]))
    text, drawn = reference(model, PROMPT, temperature=0, use_cache=cache)
    assert samples == [text, text]
    assert last.startswith(f"2 samples, {2 * drawn} tokens in ")


def test_seed_reproduces_a_sample_and_another_seed_changes_it(capsys, ckpt, model):
    probs = torch.softmax(model(torch.tensor([[BYTES.eot_id, *PROMPT.encode()]]))[0][0, -1], dim=-1)
    assert probs.max() < 0.1  # far from one token's: different draws give different samples
    args = f"--prompt={PROMPT}", "--temperature=0.8", "--top_k=40", "--num_samples=2"
    samples = run(capsys, ckpt, *args, "--seed=1")[0]
    assert samples == run(capsys, ckpt, *args, "--seed=1")[0]
    assert samples[0] != samples[1]  # seeded once, not once a sample
    assert run(capsys, ckpt, *args, "--seed=2")[0][0] != samples[0]
    torch.manual_seed(1)
    assert samples[0] == reference(model, PROMPT, temperature=0.8, top_k=40)[0]


def fake_stream(monkeypatch, tokens, before_each=lambda: None):
    """decode.stream, as sample.py calls it, drawing the given tokens, calling before_each before
    each; the tokens drawn and the arguments of each call."""
    drawn, calls = [], []

    def stream(model, idx, max_new_tokens, temperature, top_k, use_cache, step, vocab_size, cache_class):
        assert vocab_size == BYTES.vocab_size and cache_class is RingKVCache
        calls.append((idx.tolist(), max_new_tokens, temperature, top_k, use_cache, step))
        for token in tokens:
            before_each()
            drawn.append(token)
            yield torch.tensor([[token]])
    monkeypatch.setattr(sample, "stream", stream)
    return drawn, calls


def test_the_flags_reach_stream(capsys, monkeypatch, ckpt):
    calls = fake_stream(monkeypatch, [])[1]
    run(capsys, ckpt)
    run(capsys, ckpt, f"--prompt={PROMPT}", "--temperature=0.5", "--top_k=none", "--no_cache",
        "--num_samples=2")
    run(capsys, ckpt, "--compile")
    assert calls == ([([[BYTES.eot_id]], NEW, 0.8, 200, True, exact_step)]
                     + [([[BYTES.eot_id, *PROMPT.encode()]], NEW, 0.5, None, False, None)] * 2
                     + [([[BYTES.eot_id]], NEW, 0.8, 200, True, compiled_decode)])


def test_end_of_text_ends_a_sample(capsys, monkeypatch, ckpt):
    drawn = fake_stream(monkeypatch, [*b"ab", BYTES.eot_id, *b"cd"])[0]
    samples, last = run(capsys, ckpt, f"--prompt={PROMPT}", "--num_samples=2")
    assert samples == [PROMPT + "ab"] * 2
    assert drawn == [*b"ab", BYTES.eot_id] * 2
    assert last.startswith("2 samples, 6 tokens in ")


def test_a_character_split_over_byte_tokens_prints_whole_once_drawn(capsys, monkeypatch, ckpt):
    printed = []  # what sample.py has printed by each draw
    fake_stream(monkeypatch, [*"é€🐍".encode(), 0xE2], lambda: printed.append(capsys.readouterr().out))
    samples = run(capsys, ckpt, "--prompt=ü", read_before=True)[0]
    printed[0] = without_precision_line(printed[0])[1]
    assert printed == ["ü", "", "é", "", "", "€", "", "", "", "🐍"]
    assert samples == ["\ufffd"]  # a lone first byte that no more bytes complete, when the sample ends


def test_the_last_line_reports_speed_and_kv_cache_bytes(capsys, ckpt):
    stats = r"1 sample, (\d+) tokens in (\d+\.\d) s: (\d+) tokens/s \| "
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        last = run(capsys, ckpt, "--temperature=0", f"--dtype={name}")[1]
        model = checkpoint.load_checkpoint(ckpt, "cpu")[1].to(dtype)
        size = model.kv_cache_bytes(1, 1 + NEW, dtype)  # the default prompt is one end-of-text token
        assert size < 2**20
        cache = f"KV cache {size / 2**10:.1f} KiB ({name}, 1 x {1 + NEW} tokens)\n"
        match = re.fullmatch(stats + re.escape(cache), last)
        assert match and int(match[1]) == reference(model, "", temperature=0)[1] and int(match[3]) > 0, last
    assert re.fullmatch(stats + r"no KV cache \(--no_cache\)\n", run(capsys, ckpt, "--no_cache")[1])


def test_a_sample_goes_on_past_the_models_context(capsys, ckpt, model, tmp_path):
    """1000 tokens from a model of block_size 32, and a prompt longer than it: each sample is
    generate()'s, which crops the context, and the KV cache reported is the one allocated, block_size
    tokens."""
    samples, last = run(capsys, ckpt, "--temperature=0", "--max_new_tokens=1000")
    text, drawn = reference(model, "", 1000, temperature=0)
    assert drawn == 1000 and samples == [text] and last.startswith("1 sample, 1000 tokens in ")
    size = model.kv_cache_bytes(1, model.config.block_size)
    assert last.endswith(f"KV cache {size / 2**10:.1f} KiB (float32, 1 x {model.config.block_size} tokens)\n")
    (tmp_path / "long.txt").write_text(PROMPT * 20)
    samples = run(capsys, ckpt, "--temperature=0", f"--prompt=FILE:{tmp_path / 'long.txt'}")[0]
    assert samples == [reference(model, PROMPT * 20, temperature=0)[0]]


def bad_inputs(ckpt, tmp_path):
    """(arguments, what the error line says) for each kind of bad input. The hand-edited
    checkpoints have no digest, as those from before digests: with theirs, they would be refused
    as damaged."""
    names = ("junk.pt", "old.pt", "fifo.pt", "bad.pt")
    junk, untokenized, fifo, damaged = (tmp_path / name for name in names)
    junk.write_bytes(b"not a checkpoint")
    saved = {k: v for k, v in torch.load(ckpt, weights_only=True).items() if k != "digest"}
    torch.save({k: v for k, v in saved.items() if k != "tokenizer"}, untokenized)
    torch.save({**saved, "tokenizer": "byte"}, tmp_path / "string.pt")
    torch.save({**saved, "tokenizer": {**saved["tokenizer"], "tokenizer": "gpt2"}}, tmp_path / "gpt2.pt")
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    damaged.write_bytes(ckpt.read_bytes())
    flip_a_bit(damaged)
    unavailable = "mps" if torch.cuda.is_available() else "cuda"
    return [
        ([fifo], "fifo.pt: not a regular file, so not a checkpoint"),
        ([damaged], "bad.pt: damaged: its contents do not match the digest saved with them"),
        ([tmp_path / "string.pt"], "string.pt: field 'tokenizer' is str, expected dict"),
        ([tmp_path / "gpt2.pt", "--prompt=def \udcff"],
         "--prompt: byte 4 (0xff) is not UTF-8, and the gpt2 tokenizer encodes text"),
        ([ckpt, f"--seed={2**64}"], f"argument --seed: {2**64}: must be between 0 and 2**64 - 1"),
        ([ckpt, "--device=tpu"], "--device=tpu: not a device; valid: auto, cuda, mps, cpu"),
        ([ckpt, "--device=cpu:banana"], "--device=cpu:banana: not a device; valid: auto, cuda, mps, cpu"),
        ([tmp_path / "missing.pt"], "missing.pt: No such file or directory"),
        ([junk], "junk.pt: not a PyTorch checkpoint"),
        ([untokenized], "old.pt: has no 'tokenizer'"),
        ([ckpt, "--prompt=FILE:"], "--prompt=FILE:: No such file or directory"),
        ([ckpt, f"--prompt=FILE:{tmp_path}"], "Is a directory"),
        ([ckpt, "--bogus"], "unrecognized arguments: --bogus"),
        ([ckpt, "--temperature=-0.5"], "argument --temperature: -0.5: must be a finite number >= 0"),
        ([ckpt, "--top_k=0"], "argument --top_k: 0: must be at least 1"),
        ([ckpt, "--num_samples=0"], "argument --num_samples: 0: must be at least 1"),
        ([ckpt, "--max_new_tokens=0"], "argument --max_new_tokens: 0: must be at least 1"),
        ([ckpt, f"--device={unavailable}"], f"--device={unavailable}: not available on this machine"),
        ([ckpt, "--compile", "--no_cache"], "--compile compiles the cached single-token step"),
        ([ckpt, "--kv_quant=int3"], "argument --kv_quant: 'int3': must be one of none, int8, int4"),
        ([ckpt, "--kv_quant=int8", "--no_cache"], "--kv_quant=int8 stores the KV cache: it cannot go with"),
        ([ckpt, f"--prompts={tmp_path}/missing.txt"], "--prompts=" + f"{tmp_path}/missing.txt: No such file"),
        ([ckpt, f"--prompts={two_prompts(tmp_path)}", "--num_samples=2"], "not with --num_samples"),
        ([ckpt, f"--prompts={two_prompts(tmp_path)}", "--kv_budget=nan"],
         "must be a finite number of MiB > 0"),
        ([ckpt, f"--prompts={two_prompts(tmp_path)}", "--kv_budget=0.0001"],
         "holds no block of 16 positions"),
        ([ckpt, f"--prompts={two_prompts(tmp_path)}", "--max_new_tokens=100000"], "pass the context"),
    ]


def test_a_bad_prompt_file_or_budget_is_one_line_before_the_model_loads(capsys, ckpt, tmp_path, monkeypatch):
    """--prompts: an empty file, one that is not text (not UTF-8; NUL bytes), an endless one (/dev/zero:
    read up to its limit) and a budget above the machine's memory, each refused in one line and exit code 2
    before the checkpoint is read; a prompt longer than the context in one line, by its line."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes(b"def \ncaf\xe9\n")
    (tmp_path / "nul.txt").write_bytes(b"def \nclass\0A:\n")
    (tmp_path / "long.txt").write_bytes(b"def \n" + b"x" * 200 + b"\n")  # 201 tokens, the context 32
    monkeypatch.setattr(sample, "FILE_LIMIT", 2**16)  # /dev/zero's refusal, without reading 64 MiB
    loaded = sample.load_checkpoint
    for name, says in (("empty.txt", "empty.txt: the file is empty"),
                       ("latin1.txt", "latin1.txt: line 2 is not text: byte 8 (0xe9) is not UTF-8"),
                       ("nul.txt", "nul.txt: line 2 is not text: it holds a NUL byte"),
                       ("/dev/zero", "/dev/zero: more than 0 MiB, too long for prompts"),
                       ("prompts.txt --kv_budget=1e12", "--kv_budget=1e+12: more than the "),
                       ("long.txt", "long.txt: line 2 has 201 tokens, more than the model's context, "
                                    "block_size = 32")):
        monkeypatch.setattr(sample, "load_checkpoint", loaded if name == "long.txt" else None)
        two_prompts(tmp_path)
        path, *more = name.split()
        assert exit_code([str(ckpt), "--device=cpu", f"--prompts={tmp_path / path}", *more]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("sample.py: ") and says in err, err


def two_prompts(tmp_path):
    (tmp_path / "prompts.txt").write_text("def \nclass A:\n")
    return tmp_path / "prompts.txt"


def test_a_file_of_prompts_samples_each_as_generate(capsys, ckpt, model, tmp_path):
    """--prompts: each line's greedy sample, drawn together by continuous batching, is generate()'s of it;
    the last line reports the engine's measures."""
    assert sample.main([str(ckpt), "--device=cpu", f"--max_new_tokens={NEW}", "--temperature=0",
                        f"--prompts={two_prompts(tmp_path)}", "--kv_budget=1"]) == 0
    out, err = capsys.readouterr()
    *samples, last = out.split(SEPARATOR)
    assert samples == [reference(model, prompt, temperature=0)[0] for prompt in ("def ", "class A:")]
    assert re.fullmatch(r"2 prompts, 40 tokens in .+ tokens/s \| paged KV cache 1.0 MiB \(float32\), at most "
                        r"2 sequences at once, 0 preempted\n", last), last


def test_auto_dtype_is_the_precision_policy_unless_the_run_chose_float32(ckpt):
    assert torch.load(ckpt, weights_only=True)["config"]["dtype"] == "float32"
    assert hardware.decoding_dtype("float32", torch.device("cpu"))[0] == torch.float32
    assert hardware.decoding_dtype("auto", torch.device("cpu")) == hardware.precision("decode", "cpu")


def exit_code(argv):
    """sample.main's exit code, a bad flag's included: argparse exits with it while parsing."""
    try:
        return sample.main(argv)
    except SystemExit as e:
        return e.code


def test_bad_input_is_one_line_and_exit_code_2(capsys, ckpt, tmp_path):
    for args, says in bad_inputs(ckpt, tmp_path):
        # a --device in args comes later: it wins
        assert exit_code(["--device=cpu", *map(str, args)]) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, (args, err)
        assert err.startswith("sample.py: ") and says in err, (args, err)


def test_bad_input_from_the_command_line(ckpt, tmp_path):
    # one case: the script's exit code and stderr are main()'s, and each start imports torch for seconds
    args, says = bad_inputs(ckpt, tmp_path)[1]  # the junk checkpoint
    result = subprocess.run([sys.executable, "sample.py", *map(str, args)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr


def test_a_prompt_that_is_not_utf8_is_its_bytes_to_the_byte_tokenizer(capsys, ckpt, tmp_path):
    """From the command line (its bytes as a subprocess gets them, and as Python hands them to
    main), or from a file, the same bytes make the same prompt and sample."""
    (tmp_path / "prompt.bin").write_bytes(b"def \xff")
    said = "--prompt: byte 4 (0xff) is not UTF-8: the byte tokenizer reads the prompt's 5 bytes as they are"
    prompt = f"--prompt=FILE:{tmp_path / 'prompt.bin'}"
    from_file = run(capsys, ckpt, prompt, "--temperature=0", err_says=said)[0]
    assert run(capsys, ckpt, "--prompt=def \udcff", "--temperature=0", err_says=said)[0] == from_file
    assert from_file[0].startswith("def \ufffd")
    result = subprocess.run([sys.executable, "sample.py", str(ckpt), b"--prompt=def \xff", "--temperature=0",
                             f"--max_new_tokens={NEW}", "--device=cpu"], cwd=REPO, capture_output=True,
                            timeout=60)
    assert result.returncode == 0
    assert without_precision_line(result.stdout.decode())[1].split(SEPARATOR)[:-1] == from_file


def test_a_temperature_too_small_for_floating_point_is_greedy(capsys, ckpt):
    greedy = run(capsys, ckpt, f"--prompt={PROMPT}", "--temperature=0")[0]
    for tiny in ("1e-45", "1e-300"):
        assert run(capsys, ckpt, f"--prompt={PROMPT}", f"--temperature={tiny}")[0] == greedy, tiny


def test_lrkv_precision_decides_as_the_readme_says(capsys, ckpt, monkeypatch):
    """LRKV_PRECISION forces the precision, of a run trained in float32 by choice too."""
    monkeypatch.setenv("LRKV_PRECISION", "bf16")
    code = sample.main([str(ckpt), "--device=cpu", "--max_new_tokens=1"])
    first = capsys.readouterr().out.split("\n")[0]
    assert code == 0 and first.startswith("precision: bfloat16 weights (LRKV_PRECISION=bf16) | "), first


def test_an_int8_cache_samples_as_generate_through_it(capsys, ckpt, model):
    """--kv_quant=int8: generate's greedy tokens through an int8 cache, the header saying its bytes."""
    code = sample.main([str(ckpt), "--device=cpu", f"--max_new_tokens={NEW}", f"--prompt={PROMPT}",
                        "--temperature=0", "--kv_quant=int8"])
    out = capsys.readouterr().out
    first, rest = out.split("\n", 1)
    ids = [BYTES.eot_id, *PROMPT.encode()]
    size = model.kv_cache_bytes(1, len(ids) + NEW, torch.float32, Int8KVCache)
    header = f"| KV cache {size / 2**10:.1f} KiB (int8, scales in float32, 1 x {len(ids) + NEW} "
    assert code == 0 and header in first
    new = generate(model, torch.tensor([ids]), NEW, temperature=0, step=exact_step,
                   cache_class=Int8KVCache)[0, len(ids):].tolist()
    drawn = new.index(BYTES.eot_id) + 1 if BYTES.eot_id in new else NEW
    assert rest.split(SEPARATOR)[0] == BYTES.decode(ids + new[:drawn])
