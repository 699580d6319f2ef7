"""export_hf.py and hf/modeling_lrkv.py on tiny trained checkpoints of every variant, with cla=1 and
cla=2, and with sliding windows, alone and beside cla=2 and yoco: the exported model, loaded by
transformers, gives our logits (fp32 to 1e-5; the remote code in float64 to 1e-9) and, through
transformers' generate, our greedy and sampled tokens, a left-padded batch included; the cache it
holds after a prompt has our cache's bytes (a window's last W positions where that is all its
readers see), and a chunk longer than the window decodes as the full forward; lm-evaluation-harness,
as `lm_eval --model hf` and as a library, scores our log-likelihoods; MHA, GQA and MQA load as
transformers' own NanoChatForCausalLM, without remote code, and so does LRKV with --native; the
tokenizers encode as the data's; bad input is one line and exit code 2 with nothing written."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

# Offline, before transformers, huggingface_hub and datasets read these at import: every model, tokenizer
# and task here is a local folder
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
REASON = "transformers and lm-eval are not installed: pip install -r requirements-hf.txt"
transformers = pytest.importorskip("transformers", reason=REASON)
lm_eval = pytest.importorskip("lm_eval", reason=REASON)

# This repository's code, all that the tests read
import export_hf  # noqa: E402
import train  # noqa: E402
from test_train import data_dir  # noqa: E402,F401 (a fixture)
from lib.attention.decode import generate  # noqa: E402
from lib.training.checkpoint import load_checkpoint  # noqa: E402
from lib.training.data import get_tokenizer  # noqa: E402
from model import GPTConfig  # noqa: E402

from lm_eval import evaluator  # noqa: E402
from lm_eval.__main__ import cli_evaluate  # noqa: E402
import lm_eval.tasks  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("mha", "mqa", "gqa", "mla", "lrkv", "gta", "gla", "tpa", "mlra")
NATIVE = ("mha", "mqa", "gqa")  # with cla=1: transformers' NanoChatForCausalLM
# Every knob small; block_size fits a prompt and 40 new tokens, so that our generate never restarts its
# context
TINY = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, head_dim=8, n_embd=32, n_kv_head=2,
            kv_lora_rank=8, rope_head_dim=4, lrkv_rank=2, gta_kv_heads=2, gla_latent_dim=8,
            mlra_latent_heads=2, mlra_latent_dim=4, tpa_q_rank=3, tpa_kv_rank=2, batch_size=2,
            micro_batch_size=2, max_steps=3, warmup_steps=1, eval_interval=3, eval_tokens=128, log_interval=1,
            device="cpu", dtype="float32", ns_dtype="float32")
EOT, BYTES = 0, 256  # the byte tokenizer's end-of-text id and vocabulary
NEW_TOKENS = 40
PROMPTS = ["def read(path):\n    with", "The cat"]  # two lengths: a left-padded batch
# lm-eval's multiple-choice documents: the context, and the choices it scores as continuations
DOCS = [dict(context="def add(a, b):\n    return", choices=[" a + b", " a - b", " None"], gold=0),
        dict(context="The quick brown fox", choices=[" jumps", " sleeps"], gold=0)]
TASK = "lrkv_export_test"
W = 5  # the layouts' window: shorter than the prompts, far shorter than prompt and generation
# Sliding windows and shared keys, as tests/test_window.py lays them out. "window": layers S L S L,
# layers 0 and 2 keeping only their last W positions. "window-cla2-yoco": layers S S L S S L, layer
# 1 reading layer 0's keys (kept: the last W), layer 2 its own, layers 4 and 5 layer 3's (YOCO's
# middle layer); the L readers keep those two whole.
LAYOUTS = {"window": dict(n_layer=4, window=W, window_pattern="SL"),
           "window-cla2-yoco": dict(n_layer=6, window=W, window_pattern="SSL", cla=2, yoco=True)}


@pytest.fixture(scope="module")
def build(data_dir, tmp_path_factory):
    """build(attn, cla=1, native=False, **layout): a checkpoint trained 3 steps (layout: flags of
    LAYOUTS', over TINY's), exported, and loaded back by transformers (without remote code where the
    export is native), each made once."""
    made = {}

    def get(attn, cla=1, native=False, **layout):
        key = (attn, cla, native, *sorted(layout.items()))
        if key not in made:
            name = f"{attn}-{cla}" + "".join(f"-{k}{v}" for k, v in layout.items())
            run = tmp_path_factory.getbasetemp() / f"run-{name}"
            if not (run / "ckpt.pt").exists():
                flags = {**TINY, "attn": attn, "cla": cla, **layout, "data_dir": data_dir, "out_dir": run}
                with torch.enable_grad():  # the first test to ask may run under torch.no_grad
                    assert train.main([f"--{k}={v}" for k, v in flags.items()]) == 0
            out = tmp_path_factory.mktemp("hf") / f"{name}{'-native' if native else ''}"
            assert export_hf.main([str(run / "ckpt.pt"), str(out), *["--native"] * native]) == 0
            is_native = native or (cla == 1 and attn in NATIVE and not layout)
            _, model = load_checkpoint(run / "ckpt.pt", "cpu")
            hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=not is_native)
            tok = AutoTokenizer.from_pretrained(out, trust_remote_code=not is_native)
            made[key] = SimpleNamespace(attn=attn, cla=cla, native=is_native, ckpt=run / "ckpt.pt", out=out,
                                        model=model.eval(), hf=hf.eval(), tok=tok)
        return made[key]

    return get


@pytest.fixture(scope="module", params=[(attn, cla) for attn in VARIANTS for cla in (1, 2)],
                ids=lambda p: f"{p[0]}-cla{p[1]}")
def exported(request, build):
    return build(*request.param)


def ids_of(tok, text):
    return tok(text, return_tensors="pt")["input_ids"]  # (1, T), end-of-text first


@torch.no_grad()
def test_logits_and_loss_equal_ours(exported):
    model, hf = exported.model, exported.hf
    ids = ids_of(exported.tok, PROMPTS[0])
    ours = model(ids)[0]  # (1, T, vocab) fp32
    theirs = hf(ids, labels=ids)
    torch.testing.assert_close(theirs.logits, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(theirs.loss, F.cross_entropy(ours[0, :-1], ids[0, 1:]), atol=1e-5, rtol=0)
    if not exported.native:
        assert_float64_logits_equal_ours(model, hf, ids)


def assert_float64_logits_equal_ours(model, hf, ids):
    """float64: the same equations, to rounding. Our forward hands back fp32 logits: lm_head's output
    is taken."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model.double()(ids)
        theirs = hf.double()(ids).logits
    finally:
        hook.remove()
        model.float(), hf.float()
    assert theirs.dtype == torch.float64
    torch.testing.assert_close(theirs, captured[0], atol=1e-9, rtol=0)


def stop_at_eot(new):
    """Tokens (B, N) as generate leaves them: after a row's first end-of-text, end-of-text (its pad)."""
    after = (new == EOT).long().cumsum(dim=1) > 0
    return new.masked_fill(after, EOT)


def assert_greedy_left_padded_equals_ours(exported, new_tokens=NEW_TOKENS):
    """transformers' generate, greedy on a left-padded batch of two prompts of different lengths,
    gives each prompt the new_tokens (40) our generate gives it alone."""
    model, hf, tok = exported.model, exported.hf, exported.tok
    batch = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    assert batch["attention_mask"][1].eq(0).any()  # the second prompt is padded
    greedy = hf.generate(**batch, max_new_tokens=new_tokens, do_sample=False)[:, batch["input_ids"].size(1):]
    assert greedy.ne(EOT).sum() > new_tokens  # text, not a row that stopped at once
    for row, prompt in enumerate(PROMPTS):
        ids = ids_of(tok, prompt)
        ours = generate(model, ids, new_tokens, temperature=0, vocab_size=BYTES)[:, ids.size(1):]
        assert torch.equal(greedy[row:row + 1], stop_at_eot(ours)), prompt


@torch.no_grad()
def test_generate_equals_ours_greedy_sampled_and_left_padded(exported):
    """Greedy on a left-padded batch as assert_greedy_left_padded_equals_ours; sampling, seed for seed,
    our samples (fewer: the same loop)."""
    assert_greedy_left_padded_equals_ours(exported)
    model, hf, tok = exported.model, exported.hf, exported.tok
    ids = ids_of(tok, PROMPTS[0])
    torch.manual_seed(1)
    ours = generate(model, ids, NEW_TOKENS // 4, temperature=0.8, top_k=20, vocab_size=BYTES)[:, ids.size(1):]
    torch.manual_seed(1)
    sampled = hf.generate(ids, max_new_tokens=NEW_TOKENS // 4, do_sample=True, temperature=0.8, top_k=20,
                          top_p=1.0)
    assert torch.equal(sampled[:, ids.size(1):], stop_at_eot(ours))


def cache_bytes(cache):
    """Bytes of every tensor a transformers cache holds, in any of its layers' attributes."""
    def tensors(value):
        if torch.is_tensor(value):
            return [value]
        if isinstance(value, dict):
            return [t for v in value.values() for t in tensors(v)]
        return []
    return sum(t.nbytes for layer in cache.layers for t in tensors(vars(layer)))


@torch.no_grad()
def test_cache_after_a_prompt_holds_our_bytes(exported):
    ids = ids_of(exported.tok, PROMPTS[0]).repeat(2, 1)  # (B, S), B = 2
    cache = exported.hf(ids, use_cache=True).past_key_values
    assert cache_bytes(cache) == exported.model.kv_cache_bytes(*ids.shape, torch.float32) > 0


def test_native_exports_load_without_remote_code(exported):
    config = json.loads((exported.out / "config.json").read_text())
    if exported.native:
        assert type(exported.hf).__name__ == "NanoChatForCausalLM" and "auto_map" not in config
        assert not (exported.out / "modeling_lrkv.py").exists()
    else:
        assert type(exported.hf).__name__ == "LRKVForCausalLM"
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_lrkv.LRKVForCausalLM"
        copied = (exported.out / "modeling_lrkv.py").read_bytes()
        assert copied == (REPO / "hf" / "modeling_lrkv.py").read_bytes()
    card = (exported.out / "README.md").read_text()
    assert f"--attn={exported.attn}" in card and "export_hf.py" in card


@torch.no_grad()
def test_native_lrkv_equals_ours_with_mha_sized_cache(build):
    """--native: LRKV's heads materialised, W_shared + U_h B_h^T, in NanoChatForCausalLM. The same
    logits and greedy tokens; transformers then caches every head's key and value, MHA's cache."""
    lrkv = build("lrkv", 1, native=True)
    model, hf = lrkv.model, lrkv.hf
    assert type(hf).__name__ == "NanoChatForCausalLM"
    ids = ids_of(lrkv.tok, PROMPTS[0])
    torch.testing.assert_close(hf(ids).logits, model(ids)[0], atol=1e-5, rtol=0)
    greedy = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[:, ids.size(1):]
    assert torch.equal(greedy, stop_at_eot(generate(model, ids, NEW_TOKENS, temperature=0, vocab_size=BYTES)
                                           [:, ids.size(1):]))
    c = model.config
    cache = hf(ids, use_cache=True).past_key_values
    mha = 2 * c.n_layer * ids.size(1) * c.n_head * c.head_dim * 4  # every head's key and value, fp32
    assert cache_bytes(cache) == mha
    assert cache_bytes(cache) > model.kv_cache_bytes(1, ids.size(1), torch.float32)


# Sliding windows and shared keys: remote code for every variant, MHA's included. Every variant
# with windows, CLA and YOCO together; windows alone with MHA and LRKV.

@pytest.fixture(scope="module", params=[(attn, "window-cla2-yoco") for attn in VARIANTS]
                + [("mha", "window"), ("lrkv", "window")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def laid_out(request, build):
    attn, layout = request.param
    return build(attn, **LAYOUTS[layout])


@torch.no_grad()
def test_windows_and_sharing_give_our_logits_and_greedy_tokens(laid_out):
    """The layout goes into config.json and the card; on a prompt longer than the window, our logits
    (fp32 to 1e-5, float64 to 1e-9); generate, greedy on a left-padded batch, 3W tokens past the
    prompts (each longer than W), our tokens."""
    model, hf, c = laid_out.model, laid_out.hf, laid_out.model.config
    assert type(hf).__name__ == "LRKVForCausalLM"
    config = json.loads((laid_out.out / "config.json").read_text())
    assert {k: config[k] for k in ("n_layer", "cla", "yoco", "window", "window_pattern")} == \
        {k: getattr(c, k) for k in ("n_layer", "cla", "yoco", "window", "window_pattern")}
    card = (laid_out.out / "README.md").read_text()
    assert f"--window={W} --window_pattern={c.window_pattern}" in card and "- Keys and values: " in card
    assert ("--yoco" in card) == c.yoco
    ids = ids_of(laid_out.tok, PROMPTS[0])
    assert ids.size(1) > W
    torch.testing.assert_close(hf(ids).logits, model(ids)[0], atol=1e-5, rtol=0)
    assert_float64_logits_equal_ours(model, hf, ids)
    assert_greedy_left_padded_equals_ours(laid_out, 3 * W)


@torch.no_grad()
def test_windows_cache_holds_our_bytes_and_a_chunk_past_the_window_is_exact(laid_out):
    """After a prompt longer than the window, the cache holds kv_cache_bytes, which a window's last W
    positions make less than a full cache; a chunk of 2W + 1 tokens, then tokens one by one, give the
    full forward's logits, and the cache still holds kv_cache_bytes."""
    model, hf = laid_out.model, laid_out.hf
    ids = ids_of(laid_out.tok, PROMPTS[0]).repeat(2, 1)  # (B, S), B = 2
    prompt, chunk = 2 * W, 2 * W + 1
    out = hf(ids[:, :prompt], use_cache=True)
    held = model.kv_cache_bytes(2, prompt, torch.float32)
    assert cache_bytes(out.past_key_values) == held < prompt * model.kv_cache_bytes(2, 1, torch.float32)
    logits = [out.logits]
    for start, end in [(prompt, prompt + chunk), *[(t, t + 1) for t in range(prompt + chunk, ids.size(1))]]:
        out = hf(ids[:, start:end], past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), model(ids)[0], atol=1e-5, rtol=0)
    assert cache_bytes(out.past_key_values) == model.kv_cache_bytes(*ids.shape, torch.float32)


# lm-evaluation-harness

@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A multiple-choice task of DOCS, defined from local files: lm-eval's --include_path."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "task.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "docs.jsonl"}
  cache_dir: {folder / "datasets"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


@torch.no_grad()
def our_loglikelihood(model, context, continuation):
    """log p(continuation | context) by our GPT: the byte tokens, end-of-text before the context as the
    exported tokenizer puts it, summed over the continuation's tokens."""
    ctx, cont = [EOT, *context.encode()], [*continuation.encode()]
    ids = torch.tensor([ctx + cont])
    logp = model(ids[:, :-1])[0][0].log_softmax(dim=-1)  # (T - 1, vocab): the next token's
    return logp[len(ctx) - 1:].gather(1, torch.tensor(cont)[:, None]).sum().item()


def assert_loglikelihoods_equal_ours(model, samples):
    """lm-eval's samples: each a document, its requests' (context, continuation) and their
    (loglikelihood, greedy)."""
    assert len(samples) == len(DOCS)
    for sample in samples:
        requests = sample["arguments"]
        if isinstance(requests, dict):  # as the samples file writes them
            requests = [(r["arg_0"], r["arg_1"]) for r in requests.values()]
        assert len(requests) == len(sample["resps"]) == len(sample["doc"]["choices"])
        for (context, continuation), [(loglikelihood, _)] in zip(requests, sample["resps"]):
            ours = our_loglikelihood(model, context, continuation)
            assert float(loglikelihood) == pytest.approx(ours, abs=1e-5), (context, continuation)


@pytest.fixture(scope="module")
def task_manager(task_dir):
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def test_lm_eval_loglikelihoods_equal_ours(exported, task_manager):
    """lm-eval's HF model (HFLM), as `lm_eval --model hf` builds it, scores our log-likelihoods."""
    lm = HFLM(pretrained=str(exported.out), trust_remote_code=True, device="cpu", batch_size=4)
    results = evaluator.evaluate(lm, task_manager.load([TASK]), log_samples=True, bootstrap_iters=0)
    assert_loglikelihoods_equal_ours(exported.model, results["samples"][TASK])


def test_lm_eval_command_offline(build, task_dir, tmp_path, monkeypatch):
    """The command docs/export.md gives, `lm_eval --model hf --model_args pretrained=OUT_DIR,
    trust_remote_code=True`, on the remote code of LRKV sharing keys across layers: its samples file
    holds our log-likelihoods. Run through the function the lm_eval script calls, in this process
    (a new process would spend seconds importing what this one has), and with lm-eval's own ~14,000
    task configs left unread (20 s on 2 cores): the test's task is all in --include_path."""
    lrkv = build("lrkv", 2)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))
    monkeypatch.setattr(sys, "argv", [
        "lm_eval", "--model", "hf", "--model_args", f"pretrained={lrkv.out},trust_remote_code=True",
        "--tasks", TASK, "--include_path", str(task_dir), "--device", "cpu", "--batch_size", "4",
        "--log_samples", "--output_path", str(tmp_path)])
    cli_evaluate()
    [samples] = tmp_path.rglob(f"samples_{TASK}_*.jsonl")
    lines = samples.read_text().splitlines()
    assert_loglikelihoods_equal_ours(lrkv.model, [json.loads(line) for line in lines])


# The tokenizers

TEXTS = ["Hello, world!", "  def f(x):\n\treturn x ** 2  # été ✓\n", "<|endoftext|> spelled out", "a\0b"]


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_tokenizer_encodes_as_the_data_does(name, tmp_path):
    """The exported tokenizer: end-of-text, then what prepare_data.py's tokenizer makes of the text
    (a NUL is no byte token: it would read as end-of-text); decoding gives the text back."""
    ours = get_tokenizer(name)
    meta = dict(tokenizer=name, vocab_size=ours.vocab_size, eot_id=ours.eot_id)
    export_hf.tokenizer(meta, 64).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        if name == "byte":
            expected = ours.encode_bytes(text.encode()).tolist()
        else:
            expected = ours.encode_batch([text])[0].tolist()
        ids = tok(text)["input_ids"]
        assert ids == [ours.eot_id, *expected], text
        assert tok.decode(ids, skip_special_tokens=True) == ours.decode(expected)


# Bad input: one line, exit code 2, nothing written

def one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.startswith("export_hf.py: ") and err.count("\n") == 1, err
    return err


def test_a_checkpoint_that_does_not_load(tmp_path, capsys):
    bad = tmp_path / "ckpt.pt"
    bad.write_text("not a checkpoint")
    assert export_hf.main([str(bad), str(tmp_path / "out")]) == 2
    assert "not a PyTorch checkpoint" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_an_out_dir_that_holds_files(build, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert export_hf.main([str(build("mha", 1).ckpt), str(out)]) == 2
    assert "not an empty folder" in one_line_error(capsys)
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder beside it


@pytest.mark.parametrize("attn, cla, layout", [("mla", 1, None), ("mha", 2, None), ("mha", 1, "window")])
def test_native_for_a_variant_it_cannot_express(build, attn, cla, layout, tmp_path, capsys):
    """NanoChat has neither MLA, nor shared keys, nor windows."""
    ckpt = build(attn, cla, **LAYOUTS.get(layout, {})).ckpt
    assert export_hf.main([str(ckpt), str(tmp_path / "out"), "--native"]) == 2
    assert one_line_error(capsys).startswith(f"export_hf.py: --native: --attn={attn}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("knobs, native", [
    (dict(), True), (dict(n_layer=2, yoco=True), True), (dict(window=5, window_pattern="L"), True),
    (dict(window=5), False), (dict(cla=2), False), (dict(n_layer=4, yoco=True), False),
    (dict(attn="lrkv"), False)])
def test_mha_is_native_unless_a_layer_shares_keys_or_has_a_window(knobs, native):
    """A flag that changes no layer (--yoco on 2 layers, a window no layer has) keeps MHA native."""
    meta = dict(tokenizer="byte", vocab_size=BYTES, eot_id=EOT)
    ckpt = dict(model_args=dict(vocab_size=BYTES), tokenizer=meta)
    assert export_hf.check("ckpt.pt", ckpt, GPTConfig(**{"attn": "mha", **knobs}), False) == native


def test_a_knob_the_remote_code_does_not_know(build, tmp_path, monkeypatch, capsys):
    """A knob of model_args that modeling_lrkv.py lacks (one the repository gains after it) is
    refused unless it is at its default: here a stand-in modeling_lrkv.py that lacks lrkv_rank, and
    a checkpoint trained with --lrkv_rank=2."""
    ckpt = build("lrkv", 1).ckpt  # exported by the real modeling_lrkv.py, before the stand-in
    known = {name: None for name in export_hf.load_modeling().LRKVConfig.__dataclass_fields__}
    del known["lrkv_rank"]
    stand_in = SimpleNamespace(LRKVConfig=SimpleNamespace(__dataclass_fields__=known))
    monkeypatch.setattr(export_hf, "load_modeling", lambda: stand_in)
    assert export_hf.main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "--lrkv_rank=2" in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing(build, tmp_path, monkeypatch):
    """A failure while writing (here the card) removes the temporary folder and the folders it made."""
    def fail(*args):
        raise RuntimeError("the disk went away")

    ckpt = build("mha", 1).ckpt  # exported whole, before the card fails
    monkeypatch.setattr(export_hf, "card", fail)
    with pytest.raises(RuntimeError, match="the disk went away"):
        export_hf.main([str(ckpt), str(tmp_path / "new" / "out")])
    assert list(tmp_path.iterdir()) == []


def test_bad_input_from_the_command_line(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "export_hf.py"), str(tmp_path / "missing.pt"),
                          str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "missing.pt" in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []
