"""export_hf.py and hf/modeling_lrkv.py on tiny trained checkpoints of every variant, with cla=1 and
cla=2, and with sliding windows, alone and beside cla=2 and yoco: the exported model, loaded by
transformers, gives our logits (fp32 to 1e-5; the remote code in float64 to 1e-9) and, through
transformers' generate, our greedy and sampled tokens, a left-padded batch included; the cache it
holds after a prompt has our cache's bytes (a window's last W positions where that is all its
readers see), and a chunk longer than the window decodes as the full forward; lm-evaluation-harness,
as `lm_eval --model hf` and as a library, scores our log-likelihoods; MHA, GQA and MQA load as
transformers' own NanoChatForCausalLM, without remote code, and so does LRKV with --native, every
embedding row training as ours; PEFT's prompt tuning and LoRA train by the card's names; the forward is one
torch.compile graph; the tokenizers encode as the data's; bad input is one line and exit code 2 with
nothing written."""

import copy
import dataclasses
import errno
import functools
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
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
from lib.training.checkpoint import digest, load_checkpoint  # noqa: E402
from lib.training.configurator import Stopped  # noqa: E402
from lib.training.data import get_tokenizer  # noqa: E402
import model as model_module  # noqa: E402
from model import GPTConfig  # noqa: E402

from lm_eval import evaluator  # noqa: E402
from lm_eval.__main__ import cli_evaluate  # noqa: E402
import lm_eval.tasks  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIANTS = tuple(model_module.VARIANTS)  # every variant the repository names, a new one included
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
    """build(attn, cla=1, native=False, remote_code=False, **layout): a checkpoint trained 3 steps
    (layout: flags of LAYOUTS', over TINY's), exported (--native, --remote_code as asked), and loaded back
    by transformers (without remote code where the export is native), each made once."""
    made = {}

    def get(attn, cla=1, native=False, remote_code=False, **layout):
        key = (attn, cla, native, remote_code, *sorted(layout.items()))
        if key not in made:
            name = f"{attn}-{cla}" + "".join(f"-{k}{v}" for k, v in layout.items())
            run = tmp_path_factory.getbasetemp() / f"run-{name}"
            if not (run / "ckpt.pt").exists():
                flags = {**TINY, "attn": attn, "cla": cla, **layout, "data_dir": data_dir, "out_dir": run}
                with torch.enable_grad():  # the first test to ask may run under torch.no_grad
                    assert train.main([f"--{k}={v}" for k, v in flags.items()]) == 0
            out = tmp_path_factory.mktemp("hf") / f"{name}{'-native' * native}{'-code' * remote_code}"
            assert export_hf.main([str(run / "ckpt.pt"), str(out), *["--native"] * native,
                                   *["--remote_code"] * remote_code]) == 0
            is_native = native or (cla == 1 and attn in NATIVE and not layout and not remote_code)
            ckpt, model = load_checkpoint(run / "ckpt.pt", "cpu")
            hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=not is_native)
            tok = AutoTokenizer.from_pretrained(out, trust_remote_code=not is_native)
            made[key] = SimpleNamespace(attn=attn, cla=cla, native=is_native, ckpt=run / "ckpt.pt", out=out,
                                        model=model.eval(), hf=hf.eval(), tok=tok,
                                        model_args=ckpt["model_args"])
        return made[key]

    return get


@pytest.fixture(scope="module", params=[(attn, cla) for attn in VARIANTS for cla in (1, 2)],
                ids=lambda p: f"{p[0]}-cla{p[1]}")
def exported(request, build):
    return build(*request.param)


def ids_of(exported, text):
    """(1, T): what transformers is given, the text as the exported tokenizer encodes it (a native
    folder's puts end-of-text first; the remote code reads every sequence after one itself)."""
    return exported.tok(text, return_tensors="pt")["input_ids"]


def ours_of(exported, ids):
    """Our model's logits (1, T, vocab) for what transformers reads of ids: after end-of-text."""
    if exported.native:
        return exported.model(ids)[0]
    return exported.model(torch.cat((torch.full_like(ids[:, :1], EOT), ids), 1))[0][:, 1:]


@torch.no_grad()
def test_logits_and_loss_equal_ours(exported):
    model, hf = exported.model, exported.hf
    ids = ids_of(exported, PROMPTS[0])
    ours = ours_of(exported, ids)  # (1, T, vocab) fp32
    theirs = hf(ids, labels=ids)
    torch.testing.assert_close(theirs.logits, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(theirs.loss, F.cross_entropy(ours[0, :-1], ids[0, 1:]), atol=1e-5, rtol=0)
    if not exported.native:
        assert_float64_logits_equal_ours(model, hf, ids)


def assert_float64_logits_equal_ours(model, hf, ids):
    """float64: the same code, to rounding. Both forwards hand back fp32 logits (model.py's): lm_head's
    outputs are taken, ours after the end-of-text that the remote code reads first."""
    captured = []
    gpt = hf.model.gpt_model
    hooks = [m.register_forward_hook(lambda module, args, output: captured.append(output))
             for m in (model.lm_head, gpt.lm_head)]
    try:
        model.double()(torch.cat((torch.full_like(ids[:, :1], EOT), ids), 1))
        hf.double()(ids)
    finally:
        for hook in hooks:
            hook.remove()
        model.float(), hf.float()
    ours, theirs = captured[0][:, 1:], captured[-1]
    assert theirs.dtype == torch.float64
    torch.testing.assert_close(theirs, ours, atol=1e-9, rtol=0)


def stop_at_eot(new):
    """Tokens (B, N) as generate leaves them: after a row's first end-of-text, end-of-text (its pad)."""
    after = (new == EOT).long().cumsum(dim=1) > 0
    return new.masked_fill(after, EOT)


def our_greedy(exported, text, new_tokens, **kwargs):
    """Our generate's new tokens after the text, read after end-of-text (as sample.py reads a prompt)."""
    ids = torch.tensor([[EOT, *text.encode()]])
    return stop_at_eot(generate(exported.model, ids, new_tokens, vocab_size=BYTES, **kwargs)[:, ids.size(1):])


def assert_greedy_left_padded_equals_ours(exported, new_tokens=NEW_TOKENS):
    """transformers' generate, greedy on a batch of two prompts of different lengths that the tokenizer
    pads as it does by default (on the left), gives each prompt the new_tokens (40) our generate gives
    it alone."""
    hf, tok = exported.hf, exported.tok
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, 0] == 0  # the second prompt is padded, on the left
    greedy = hf.generate(**batch, max_new_tokens=new_tokens, do_sample=False)[:, batch["input_ids"].size(1):]
    assert greedy.ne(EOT).sum() > new_tokens  # text, not a row that stopped at once
    for row, prompt in enumerate(PROMPTS):
        ours = our_greedy(exported, prompt, new_tokens, temperature=0)
        assert torch.equal(greedy[row:row + 1], ours), prompt


@torch.no_grad()
def test_generate_equals_ours_greedy_sampled_and_left_padded(exported):
    """Greedy on a left-padded batch as assert_greedy_left_padded_equals_ours; sampling, seed for seed,
    our samples (fewer: the same loop)."""
    assert_greedy_left_padded_equals_ours(exported)
    ids = ids_of(exported, PROMPTS[0])
    torch.manual_seed(1)
    ours = our_greedy(exported, PROMPTS[0], NEW_TOKENS // 4, temperature=0.8, top_k=20)
    torch.manual_seed(1)
    sampled = exported.hf.generate(ids, max_new_tokens=NEW_TOKENS // 4, do_sample=True, temperature=0.8,
                                   top_k=20, top_p=1.0)
    assert torch.equal(sampled[:, ids.size(1):], ours)


def cache_bytes(cache):
    """Bytes of every tensor a transformers cache holds: the remote code's buffers, or a native cache's
    tensors in any of its layers' attributes."""
    def tensors(value):
        if torch.is_tensor(value):
            return [value]
        if isinstance(value, dict):
            return [t for v in value.values() for t in tensors(v)]
        return []
    if hasattr(cache, "ring"):
        return sum(buf.nbytes for layer in cache.ring.layers for buf in layer.values())
    return sum(t.nbytes for layer in cache.layers for t in tensors(vars(layer)))


def cache_of(output):
    return output.cache if getattr(output, "cache", None) is not None else output.past_key_values


@torch.no_grad()
def test_cache_after_a_prompt_holds_our_bytes(exported):
    """The bytes of our cache of the same positions: the remote code's, the end-of-text included."""
    ids = ids_of(exported, PROMPTS[0]).repeat(2, 1)  # (B, S), B = 2
    cache = cache_of(exported.hf(ids, use_cache=True))
    held = ids.size(1) + (not exported.native)
    assert cache_bytes(cache) == exported.model.kv_cache_bytes(2, held, torch.float32) > 0


def test_the_folder_runs_the_repositorys_code(exported):
    """A remote-code folder holds model.py and the lib/attention files the model runs, each as the
    repository has it, but for its imports made relative, and hf/modeling_lrkv.py with an import of each;
    a native one holds none. The card has the Hub's YAML header, the variant and the transformers it
    needs; the licence is beside it."""
    config = json.loads((exported.out / "config.json").read_text())
    if exported.native:
        assert type(exported.hf).__name__ == "NanoChatForCausalLM" and "auto_map" not in config
        assert not list(exported.out.glob("*.py"))
    else:
        assert type(exported.hf).__name__ == "LRKVForCausalLM"
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_lrkv.LRKVForCausalLM"
        assert config["model_args"] == exported.model_args
        modeling = (exported.out / "modeling_lrkv.py").read_text()
        assert modeling.startswith((REPO / "hf" / "modeling_lrkv.py").read_text())
        files = {"model": REPO / "model.py", "ring": REPO / "lib/attention/ring.py",
                 "layout": REPO / "lib/attention/layout.py"}
        own = Path(inspect.getsourcefile(model_module.attention_class(exported.attn)))  # the variant's file
        files.setdefault(own.stem, own)
        assert sorted(p.stem for p in exported.out.glob("*.py")) == sorted([*files, "modeling_lrkv"])
        for name, source in files.items():
            ours = source.read_text().splitlines()
            theirs = (exported.out / f"{name}.py").read_text().splitlines()
            differing = [(a, b) for a, b in zip(ours, theirs) if a != b]
            assert len(ours) == len(theirs) and all(
                a.startswith(("from model ", "from lib.attention", "LIB = ")) for a, _ in differing), name
            assert f"from .{name} import __name__" in modeling
    card = (exported.out / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\nlibrary_name: transformers\npipeline_tag: text-generation\n")
    assert f"--attn={exported.attn}" in card and "export_hf.py" in card
    assert export_hf.transformers_requirement() in card
    assert_card_names_the_variants_own_fields(exported, card)
    assert (exported.out / "LICENSE").read_text() == (REPO / "LICENSE").read_text()


# the own fields (beyond every model's shape) of the variants whose cards the issue named, read off their
# classes
OWN_FIELDS = {"mha": set(), "lrkv": {"lrkv_rank"}, "mla": {"kv_lora_rank", "rope_head_dim"},
              "tpa": {"tpa_q_rank", "tpa_kv_rank"}}


def assert_card_names_the_variants_own_fields(exported, card):
    """The card's own fields: each one its attention class (or a class it derives from) reads from the config,
    with the checkpoint's value (OWN_FIELDS' exactly); the cache bytes per token in the weights' dtype, fp32,
    and in bf16; a snippet loading this folder; its limitations, the context first."""
    model = exported.model
    listed = re.search(r"; its own: (.*?); rope_theta ", card)
    listed = dict(pair.split(" ") for pair in listed.group(1).split(", ")) if listed else {}
    attention = type(model.blocks[0].attn)
    read = {name for cls in attention.__mro__ if issubclass(cls, model_module.Attention)
            for name in re.findall(r"config\.(\w+)", inspect.getsource(cls))}
    assert set(listed) <= read - set(export_hf.SHAPE), listed
    assert listed == {name: str(exported.model_args[name]) for name in listed}
    if exported.attn in OWN_FIELDS:
        assert set(listed) == OWN_FIELDS[exported.attn], card
    per_token = [model.kv_cache_bytes(1, 1, dtype) for dtype in (torch.float32, torch.bfloat16)]
    assert f"{per_token[0]:,} bytes per token in fp32, {per_token[1]:,} in bf16" in card
    trust = "" if exported.native else ", trust_remote_code=True"
    assert f'folder = "{exported.out}"\nmodel = AutoModelForCausalLM.from_pretrained(folder{trust})' in card
    context = model.config.block_size - (not exported.native)
    assert f"Limitations:\n\n- The context: {context} tokens of a sequence's own" in card


@torch.no_grad()
def test_native_lrkv_equals_ours_with_mha_sized_cache(build):
    """--native: LRKV's heads materialised, W_shared + U_h B_h^T, in NanoChatForCausalLM. The same
    logits and greedy tokens; transformers then caches every head's key and value, MHA's cache."""
    lrkv = build("lrkv", 1, native=True)
    model, hf = lrkv.model, lrkv.hf
    assert type(hf).__name__ == "NanoChatForCausalLM"
    ids = ids_of(lrkv, PROMPTS[0])
    torch.testing.assert_close(hf(ids).logits, model(ids)[0], atol=1e-5, rtol=0)
    greedy = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[:, ids.size(1):]
    assert torch.equal(greedy, our_greedy(lrkv, PROMPTS[0], NEW_TOKENS, temperature=0))
    c = model.config
    cache = cache_of(hf(ids, use_cache=True))
    mha = 2 * c.n_layer * ids.size(1) * c.n_head * c.head_dim * 4  # every head's key and value, fp32
    assert cache_bytes(cache) == mha
    assert cache_bytes(cache) > model.kv_cache_bytes(1, ids.size(1), torch.float32)
    card = (lrkv.out / "README.md").read_text()  # MHA's bytes per token, in the weights' fp32 and in bf16
    per_token = mha // ids.size(1)
    assert f"DynamicCache, {per_token:,} bytes per token in fp32, {per_token // 2:,} in bf16" in card


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
    config = json.loads((laid_out.out / "config.json").read_text())["model_args"]
    assert {k: config[k] for k in ("n_layer", "cla", "yoco", "window", "window_pattern")} == \
        {k: getattr(c, k) for k in ("n_layer", "cla", "yoco", "window", "window_pattern")}
    card = (laid_out.out / "README.md").read_text()
    assert f"--window={W} --window_pattern={c.window_pattern}" in card and "- Keys and values: " in card
    assert ("--yoco" in card) == c.yoco
    ids = ids_of(laid_out, PROMPTS[0])
    assert ids.size(1) > W
    torch.testing.assert_close(hf(ids).logits, ours_of(laid_out, ids), atol=1e-5, rtol=0)
    assert_float64_logits_equal_ours(model, hf, ids)
    assert_greedy_left_padded_equals_ours(laid_out, 3 * W)


@torch.no_grad()
def test_a_padded_prompt_shorter_than_the_window_decodes_as_alone(laid_out):
    """A row padded on the left whose prompt is shorter than the window: its first new tokens still see
    the end-of-text it is read after, before its pads, and get the logits they get alone, token by
    token through the cache (the tokens fed: the same for both rows)."""
    hf, tok = laid_out.hf, laid_out.tok
    prompts = ["T", PROMPTS[0]]  # 1 token against W = 5, beside 26: 25 pads
    batch = tok(prompts, padding=True, return_tensors="pt")
    new = torch.tensor([[*b" the cat sat"]]).repeat(2, 1)
    out = hf(**batch, use_cache=True)
    mask, logits = batch["attention_mask"], [out.logits[:, -1:]]
    for t in range(new.size(1)):
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), 1)
        out = hf(new[:, t:t + 1], attention_mask=mask, past_key_values=cache_of(out), use_cache=True)
        logits.append(out.logits)
    for row, prompt in enumerate(prompts):
        alone = hf(torch.cat((ids_of(laid_out, prompt), new[:1]), 1)).logits[:, -new.size(1) - 1:]
        torch.testing.assert_close(torch.cat(logits, 1)[row:row + 1], alone, atol=1e-5, rtol=0, msg=prompt)


@torch.no_grad()
def test_windows_cache_holds_our_bytes_and_a_chunk_past_the_window_is_exact(laid_out):
    """After a prompt longer than the window, the cache holds kv_cache_bytes, which a window's last W
    positions make less than a full cache; a chunk of 2W + 1 tokens, then tokens one by one, give the
    full forward's logits, and the cache still holds kv_cache_bytes (the end-of-text counted)."""
    model, hf = laid_out.model, laid_out.hf
    ids = ids_of(laid_out, PROMPTS[0]).repeat(2, 1)  # (B, S), B = 2
    prompt, chunk = 2 * W, 2 * W + 1
    out = hf(ids[:, :prompt], use_cache=True)
    held = model.kv_cache_bytes(2, prompt + 1, torch.float32)
    assert cache_bytes(cache_of(out)) == held < (prompt + 1) * model.kv_cache_bytes(2, 1, torch.float32)
    logits = [out.logits]
    for start, end in [(prompt, prompt + chunk), *[(t, t + 1) for t in range(prompt + chunk, ids.size(1))]]:
        out = hf(ids[:, start:end], past_key_values=cache_of(out), use_cache=True)
        logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), ours_of(laid_out, ids), atol=1e-5, rtol=0)
    assert cache_bytes(cache_of(out)) == model.kv_cache_bytes(2, ids.size(1) + 1, torch.float32)


# lm-evaluation-harness

@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two tasks defined from local files (lm-eval's --include_path): multiple choice over DOCS, and the
    rolling log-likelihood of TEXTS_TO_SCORE (bits per byte, as wikitext's)."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "texts.jsonl").write_text("".join(json.dumps(dict(text=t)) + "\n" for t in TEXTS_TO_SCORE))
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
    (folder / "rolling.yaml").write_text(f"""task: {ROLLING}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "texts.jsonl"}
  cache_dir: {folder / "datasets-rolling"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
""")
    return folder


ROLLING = "lrkv_export_rolling"
# one text within a window (block_size 64 less the end-of-text: 63 tokens), one of two windows
TEXTS_TO_SCORE = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 2]


@torch.no_grad()
def our_loglikelihood(model, context, continuation):
    """log p(continuation | context) by our GPT: the byte tokens after end-of-text, as eval.py reads a
    request, summed over the continuation's tokens."""
    ctx, cont = [EOT, *context.encode()], [*continuation.encode()]
    ids = torch.tensor([ctx + cont])
    logp = model(ids[:, :-1])[0][0].log_softmax(dim=-1)  # (T - 1, vocab): the next token's
    return logp[len(ctx) - 1:].gather(1, torch.tensor(cont)[:, None]).sum().item()


@torch.no_grad()
def our_bits_per_byte(model, texts):
    """Every text's tokens scored after end-of-text, in windows of block_size: each text's first after
    end-of-text, each next window after end-of-text and the tokens that precede it (as many as fit): the
    summed log-likelihoods over the summed bytes, in bits."""
    L, total, n_bytes = model.config.block_size, 0.0, 0
    for text in texts:
        tokens, done = [*text.encode()], 0
        while done < len(tokens):
            new = min(len(tokens) - done, L - 1)
            context = tokens[max(0, done + new - (L - 1)):done]
            scored = bytes(tokens[done:done + new]).decode()
            total += our_loglikelihood(model, bytes(context).decode(), scored)
            done += new
        n_bytes += len(text.encode())
    return -total / n_bytes / math.log(2)


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


@pytest.mark.parametrize("attn", ["lrkv", "mla", "mha"])
def test_lm_eval_rolling_bits_per_byte_and_choices_equal_ours_with_one_folder(build, task_manager, attn):
    """One remote-code folder at lm-eval's defaults: the rolling log-likelihood's bits per byte is ours
    to 1e-4 (texts read after end-of-text, no end-of-text scored), and the multiple-choice
    log-likelihoods ours to 1e-5 (contexts after end-of-text), in the same evaluation. MHA exported
    with --remote_code reads texts as the remote code does."""
    exported = build(attn, 1, remote_code=attn == "mha")
    assert not exported.native
    lm = HFLM(pretrained=str(exported.out), trust_remote_code=True, device="cpu", batch_size=4)
    results = evaluator.evaluate(lm, task_manager.load([TASK, ROLLING]), log_samples=True, bootstrap_iters=0)
    assert_loglikelihoods_equal_ours(exported.model, results["samples"][TASK])
    bpb = results["results"][ROLLING]["bits_per_byte,none"]
    assert bpb == pytest.approx(our_bits_per_byte(exported.model, TEXTS_TO_SCORE), abs=1e-4)


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


# What users reach for: SDPA, AutoModel and hidden states, gradient checkpointing, prompt lookup and
# assisted decoding, the context's end

@torch.no_grad()
def test_sdpa_automodel_and_hidden_states(build):
    """attn_implementation="sdpa" loads (the model attends through SDPA whatever is asked); AutoModel
    gives the final hidden states (lm_head's input in our model) and, with output_hidden_states, n_layer
    + 1 of them, the first the normalised embedding, the last the final."""
    lrkv = build("lrkv", 2)
    sdpa = AutoModelForCausalLM.from_pretrained(lrkv.out, trust_remote_code=True, attn_implementation="sdpa")
    ids = ids_of(lrkv, PROMPTS[0])
    torch.testing.assert_close(sdpa(ids).logits, ours_of(lrkv, ids), atol=1e-5, rtol=0)
    base = AutoModel.from_pretrained(lrkv.out, trust_remote_code=True)
    assert type(base).__name__ == "LRKVModel"
    captured = []
    hooks = [lrkv.model.lm_head.register_forward_pre_hook(lambda m, args: captured.append(args[0])),
             lrkv.model.blocks[0].register_forward_pre_hook(lambda m, args: captured.append(args[0]))]
    try:
        lrkv.model(torch.cat((torch.full_like(ids[:, :1], EOT), ids), 1))
    finally:
        for hook in hooks:
            hook.remove()
    embedding, final = captured[0][:, 1:], captured[1][:, 1:]
    for out in (base(ids, output_hidden_states=True), base(ids, output_hidden_states=True, use_cache=False)):
        torch.testing.assert_close(out.last_hidden_state, final, atol=1e-5, rtol=0)
        assert len(out.hidden_states) == lrkv.model.config.n_layer + 1
        torch.testing.assert_close(out.hidden_states[0], embedding, atol=1e-6, rtol=0)
        torch.testing.assert_close(out.hidden_states[-1], final, atol=1e-5, rtol=0)


def our_loss_and_gradients(exported, hf, ids, real=None):
    """Our GPT with hf's weights: the loss of predicting every row's tokens ids (B, T) after the first, read
    after end-of-text (real (B, T): not a pad; each row alone, its pads dropped, the first token scored too
    where a pad stands before it, the loss the mean over all rows' predictions), and each weight's gradient
    under hf's name."""
    ours = copy.deepcopy(exported.model).train()
    ours.load_state_dict({name.removeprefix("model.gpt_model."): w for name, w in hf.state_dict().items()})
    real = torch.ones_like(ids, dtype=torch.bool) if real is None else real
    losses, scored = [], 0
    for row, mask in zip(ids, real):  # GPT's own loss: a target -1 is not scored
        row, padded = row[mask], not bool(mask.all())
        first = row[:1] if padded else torch.tensor([-1])
        idx, targets = torch.cat((torch.tensor([EOT]), row[:-1]))[None], torch.cat((first, row[1:]))[None]
        losses.append(ours(idx, targets)[1] * (len(row) - 1 + padded))
        scored += len(row) - 1 + padded
    loss = sum(losses) / scored
    loss.backward()
    return loss.detach(), {f"model.gpt_model.{name}": p.grad for name, p in ours.named_parameters()}


def assert_equal_to_ours(exported, hf, ids, loss, real=None):
    ours, grads = our_loss_and_gradients(exported, hf, ids, real)
    torch.testing.assert_close(loss.detach(), ours, atol=1e-5, rtol=0)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layout", [None, "window-cla2-yoco"])
def test_training_forward_with_checkpointing_and_no_use_cache(build, layout):
    """A training forward as transformers users write it, no use_cache argument: no cache kept while the model
    trains; with gradient_checkpointing_enable() each block is recomputed in the backward (its attention runs
    twice); the loss first in the output (out[0], out["loss"]) and in return_dict=False's tuple; the loss and
    every gradient our GPT's, on a batch without pads and on a left-padded one (each row as alone, its pads'
    labels -100, its first token predicted by the pad before it as by the end-of-text), and the same again
    after gradient_checkpointing_disable(); where transformers has every_n_layers (5.25), only those blocks
    recomputed; in eval mode (from_pretrained's) with checkpointing enabled, the same loss and gradients
    through the cache. Plain, and with windows, shared keys and YOCO (layers reading an owner's keys)."""
    lrkv = build("lrkv", **LAYOUTS.get(layout, {}))
    hf = AutoModelForCausalLM.from_pretrained(lrkv.out, trust_remote_code=True).train()
    ids = lrkv.tok([PROMPTS[0][:12], PROMPTS[0][5:17]], return_tensors="pt")["input_ids"]
    padded = lrkv.tok(PROMPTS, padding=True, return_tensors="pt")
    labels = padded["input_ids"].masked_fill(padded["attention_mask"] == 0, -100)
    runs = []
    hf.model.gpt_model.blocks[0].attn.register_forward_pre_hook(lambda module, args: runs.append(1))
    for checkpointing in (True, False):
        hf.gradient_checkpointing_enable() if checkpointing else hf.gradient_checkpointing_disable()
        assert hf.gradient_checkpointing == checkpointing
        for batch, real in ((dict(input_ids=ids, labels=ids), None),
                            (dict(**padded, labels=labels), padded["attention_mask"].bool())):
            hf.zero_grad()
            runs.clear()
            out = hf(**batch)
            assert list(out.keys()) == ["loss", "logits"] and out[0] is out["loss"] is out.loss
            out.loss.backward()
            assert len(runs) == 1 + checkpointing
            assert_equal_to_ours(lrkv, hf, batch["input_ids"], out.loss, real)
        as_tuple = hf(ids, labels=ids, return_dict=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
        torch.testing.assert_close(as_tuple[0], out.loss.new_tensor(our_loss_and_gradients(lrkv, hf, ids)[0]),
                                   atol=1e-5, rtol=0)
    if hasattr(hf, "activation_checkpointing_enable"):  # 5.25's every_n_layers=2: block 0 recomputed, not 1
        hf.train().activation_checkpointing_enable(every_n_layers=2)
        per_block = []
        hf.model.gpt_model.blocks[1].attn.register_forward_pre_hook(lambda module, args: per_block.append(1))
        runs.clear()
        hf(ids, labels=ids).loss.backward()
        assert (len(runs), len(per_block)) == (2, 1)
    hf.eval().gradient_checkpointing_enable()  # as from_pretrained leaves it: no recomputation, a cache kept
    hf.zero_grad()
    out = hf(ids, labels=ids)
    out.loss.backward()
    assert_equal_to_ours(lrkv, hf, ids, out.loss)
    with torch.no_grad():
        assert cache_of(hf(ids)) is not None  # outside training the cache is kept, as generate wants it
        assert tuple(type(x).__name__ for x in hf(ids, return_dict=False)) == ("Tensor", "LRKVCache")


@pytest.mark.parametrize("attn, checkpointing", [("lrkv", True), ("mla", True), ("lrkv", False)])
def test_trainer_gives_our_loss_and_gradients(build, attn, checkpointing, tmp_path):
    """transformers' Trainer, gradient_checkpointing=True (and without), 3 steps of 2 rows: at every step,
    before the optimizer moves the weights, the loss and every gradient are our GPT's on the same batch
    (1e-5), and each block ran twice where checkpointed; Trainer.evaluate gives our loss."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    exported = build(attn, 1)
    hf = AutoModelForCausalLM.from_pretrained(exported.out, trust_remote_code=True)
    text = (PROMPTS[0] * 4).encode()
    data = [dict(input_ids=torch.tensor([*text[i:i + 16]]), labels=torch.tensor([*text[i:i + 16]]))
            for i in range(6)]
    seen, runs, checked = [], [], []
    hf.register_forward_hook(lambda module, args, kwargs, out: seen.append((kwargs["input_ids"], out.loss)),
                             with_kwargs=True)
    hf.model.gpt_model.blocks[0].attn.register_forward_pre_hook(lambda module, args: runs.append(1))

    class Check(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            ids, loss = seen[-1]
            assert_equal_to_ours(exported, hf, ids, loss)
            checked.append(len(runs))

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_checkpointing=checkpointing, learning_rate=1e-2, max_grad_norm=0,
                             report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=hf, args=args, train_dataset=data, callbacks=[Check()])
    trainer.train()
    assert checked == [(1 + checkpointing) * step for step in (1, 2, 3)] and len(seen) == 3
    if not checkpointing:  # evaluate: the loss of the trained weights, ours
        loss = trainer.evaluate(data[:2])["eval_loss"]
        ids = torch.stack([row["input_ids"] for row in data[:2]])
        assert loss == pytest.approx(our_loss_and_gradients(exported, hf, ids)[0].item(), abs=1e-5)


@torch.no_grad()
def test_resize_token_embeddings_and_what_the_model_refuses(build, tmp_path):
    """resize_token_embeddings: the vocabulary grows, the old tokens' logits unchanged; config.json's
    model_args follow, and the folder saved and loaded again gives the same logits (its config.json now
    holding the standard sizes too, to_dict's). Both input_ids and inputs_embeds, output_attentions and any
    other argument that asks something: one line each."""
    lrkv = build("lrkv", 1)
    hf = AutoModelForCausalLM.from_pretrained(lrkv.out, trust_remote_code=True).eval()
    ids = ids_of(lrkv, PROMPTS[0])
    before = hf(ids).logits
    hf.resize_token_embeddings(BYTES + 44)
    after = hf(ids).logits
    assert after.shape[-1] == hf.config.vocab_size == hf.config.model_args["vocab_size"] == BYTES + 44
    torch.testing.assert_close(after[..., :BYTES], before, atol=1e-6, rtol=0)
    hf.save_pretrained(tmp_path / "resized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized", trust_remote_code=True)
    torch.testing.assert_close(again(ids).logits, after, atol=0, rtol=0)
    embeds = hf.get_input_embeddings()(ids)
    assert json.loads((tmp_path / "resized" / "config.json").read_text())["vocab_size"] == BYTES + 44
    for kwargs, message in [(dict(input_ids=ids, inputs_embeds=embeds), r"takes input_ids or inputs_embeds, "
                                                                          r"one of the two$"),
                            (dict(input_ids=ids, output_attentions=True), r"gives no attention weights"),
                            (dict(input_ids=ids, head_mask=torch.ones(4)), r"takes no head_mask$")]:
        for model in (hf, hf.model):
            with pytest.raises(ValueError, match=rf"^this model {message}") as error:
                model(**kwargs)
            assert "\n" not in str(error.value)


@torch.no_grad()
@pytest.mark.parametrize("attn", ["lrkv", "mla"])
def test_prompt_lookup_and_assisted_decoding_give_greedy_tokens(build, attn):
    """Prompt lookup and assisted decoding (the model assisting itself) need a cache that generate can
    crop: they give the greedy tokens, with no cache made by hand."""
    exported = build(attn, 2)
    ids = ids_of(exported, PROMPTS[0])
    greedy = exported.hf.generate(ids, max_new_tokens=20, do_sample=False)
    looked_up = exported.hf.generate(ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    assisted = exported.hf.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=exported.hf)
    assert torch.equal(looked_up, greedy) and torch.equal(assisted, greedy)


def test_a_sequence_past_the_context_is_one_line(build):
    lrkv = build("lrkv", 1)
    too_long = torch.ones(1, TINY["block_size"], dtype=torch.long)  # and the end-of-text: block_size + 1
    for use_cache in (True, False):
        with pytest.raises(ValueError, match=r"^a sequence holds at most 63 tokens \(block_size 64, one of "
                                             r"them the end-of-text it is read after\), 64 were given$"):
            lrkv.hf(too_long, use_cache=use_cache)


@torch.no_grad()
def test_generate_past_the_context_stops_there_keeping_its_tokens(build, caplog):
    """generate asked for more tokens than the context holds stops at it, with one warning line: 64 tokens
    (the prompt's 24 and 40 new), the last predicted from the 63 a sequence holds, our greedy tokens, and
    the same with prompt lookup's and assisted decoding's guesses; a left-padded batch likewise (its pads
    counted); a prompt of 64 tokens is refused in one line."""
    lrkv = build("lrkv", 1)
    ids = ids_of(lrkv, PROMPTS[0])
    caplog.clear()
    greedy = lrkv.hf.generate(ids, max_new_tokens=200, do_sample=False)
    context = TINY["block_size"]
    assert greedy.shape == (1, context)
    ours = our_greedy(lrkv, PROMPTS[0], context - ids.size(1), temperature=0)
    assert torch.equal(greedy[:, ids.size(1):], ours)
    [warning] = [r.getMessage() for r in caplog.records if "context" in r.getMessage()]
    assert warning == (f"generate stops at the model's context: {context} tokens, the prompt's included (its "
                       f"{context - 1} and the one they predict), not the {ids.size(1) + 200} asked")
    for guessing in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=lrkv.hf)):  # their guesses too
        assert torch.equal(lrkv.hf.generate(ids, max_new_tokens=200, do_sample=False, **guessing), greedy)
    batch = lrkv.tok(PROMPTS, padding=True, return_tensors="pt")
    assert lrkv.hf.generate(**batch, max_new_tokens=200, do_sample=False).shape == (2, context)
    with pytest.raises(ValueError, match=r"^a sequence holds at most 63 tokens .*, 64 were given$"):
        lrkv.hf.generate(torch.ones(1, context, dtype=torch.long), max_new_tokens=5)


@torch.no_grad()
def test_inputs_embeds_read_as_their_ids(build):
    """inputs_embeds, wte's embeddings of ids, read after the end-of-text's embedding: the logits of the ids,
    through the cache (eval) and without (training's path), on a left-padded batch; generate from them
    gives the ids' greedy tokens."""
    lrkv = build("lrkv", 2)
    hf, batch = lrkv.hf, lrkv.tok(PROMPTS, padding=True, return_tensors="pt")
    embeds = hf.get_input_embeddings()(batch["input_ids"])
    for training in (False, True):
        hf.train(training)
        theirs = hf(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits
        torch.testing.assert_close(theirs, hf(**batch).logits, atol=1e-6, rtol=0)
    hf.eval()
    ids = ids_of(lrkv, PROMPTS[0])
    greedy = hf.generate(ids, max_new_tokens=10, do_sample=False)[:, ids.size(1):]
    embeds = hf.get_input_embeddings()(ids)
    from_embeds = hf.generate(inputs_embeds=embeds, max_new_tokens=10, do_sample=False)
    assert torch.equal(from_embeds, greedy)


def test_config_gives_the_standard_sizes(build, tmp_path):
    """config.to_dict() has the sizes tools read (PEFT's prompt tuning, memory estimators), model_args' own;
    a config.json whose size disagrees with its model_args is refused in one line naming it."""
    lrkv = build("lrkv", 1)
    c, record = lrkv.model.config, lrkv.hf.config.to_dict()
    assert {name: record[name] for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "vocab_size", "max_position_embeddings")} == \
        dict(hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
             vocab_size=c.vocab_size, max_position_embeddings=c.block_size - 1)
    refused(edited(lrkv.out, tmp_path, lambda config: config.update(hidden_size=64)),
            "config.json: hidden_size=64 where model_args make it 32")


def test_prompt_tuning_trains_3_steps(build):
    """PEFT's prompt tuning (PromptTuningConfig, 4 virtual tokens), which reads config.to_dict()'s sizes and
    gives the model inputs_embeds: the loss and the virtual tokens' gradient are our GPT's on the end-of-text,
    the virtual tokens' embeddings and the text's (1e-5, labels -100 on the virtual tokens); 3 steps of Adam
    lower the loss, moving the virtual tokens alone."""
    peft = pytest.importorskip("peft", reason="pip install -r requirements-hf.txt")
    lrkv = build("lrkv", 1)
    hf = AutoModelForCausalLM.from_pretrained(lrkv.out, trust_remote_code=True)
    tuned = peft.get_peft_model(hf, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    frozen = {name: p.clone() for name, p in hf.named_parameters()}
    [prompt] = [p for p in tuned.parameters() if p.requires_grad]  # (4, d): the virtual tokens' embeddings
    ids = ids_of(lrkv, PROMPTS[0])
    optimizer, losses = torch.optim.Adam([prompt], lr=1e-2), []
    tuned.train()
    for step in range(3):
        optimizer.zero_grad()
        loss = tuned(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            ours, grad = our_prompt_tuned_loss(lrkv.model, prompt.detach(), ids)
            torch.testing.assert_close(loss.detach(), ours, atol=1e-5, rtol=0)
            torch.testing.assert_close(prompt.grad, grad, atol=1e-5, rtol=0)
        optimizer.step()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]
    assert all(torch.equal(p, frozen[name]) for name, p in hf.named_parameters() if "prompt" not in name)


def our_prompt_tuned_loss(model, prompt, ids):
    """Our GPT's loss of ids (1, T) after the end-of-text and the virtual tokens' embeddings prompt (P, d)
    (wte's output replaced by them: the same forward), each of ids' tokens predicted, and prompt's
    gradient."""
    ours = copy.deepcopy(model).train()
    prompt = prompt.clone().requires_grad_()
    P, T = prompt.size(0), ids.size(1)
    eot = torch.full_like(ids[:, :1], EOT)
    embeds = torch.cat((ours.wte(eot), prompt[None], ours.wte(ids)), 1)  # (1, 1 + P + T, d)
    hook = ours.wte.register_forward_hook(lambda module, args, out: embeds)
    try:
        targets = torch.cat((torch.full((1, P), -1), ids, torch.full((1, 1), -1)), 1)
        loss = ours(torch.zeros(1, 1 + P + T, dtype=torch.long), targets)[1]
    finally:
        hook.remove()
    loss.backward()
    return loss.detach(), prompt.grad


def test_one_graph_under_torch_compile(build):
    """torch._dynamo.explain of an LRKV export's forward: one graph, no break, for a left-padded prompt
    through the cache, a decoding step after it, and a training forward with labels."""
    lrkv = build("lrkv", 1)
    hf, batch = lrkv.hf, lrkv.tok(PROMPTS, padding=True, return_tensors="pt")
    mask = torch.cat((batch["attention_mask"], torch.ones_like(batch["attention_mask"][:, :1])), 1)
    try:
        with torch.no_grad():
            cache = cache_of(hf(**batch, use_cache=True))
        for training, kwargs in [(False, batch), (False, dict(input_ids=batch["input_ids"][:, -1:],
                                                              attention_mask=mask, past_key_values=cache)),
                                 (True, dict(**batch, labels=batch["input_ids"]))]:
            hf.train(training)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(hf)(**kwargs)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    finally:
        hf.eval()
        torch._dynamo.reset()


def test_attention_and_cache_implementations_it_cannot_honour_are_one_line(build):
    """The model attends through SDPA and caches with its LRKVCache: attn_implementation="eager" (at load
    and set later) and cache_implementation="static" are refused in one line each; "sdpa" and "dynamic"
    are what it does."""
    lrkv = build("lrkv", 1)
    for load in (lambda: AutoModelForCausalLM.from_pretrained(lrkv.out, trust_remote_code=True,
                                                              attn_implementation="eager"),
                 lambda: lrkv.hf.set_attn_implementation("flash_attention_2")):
        with pytest.raises(ValueError, match=r"^this model attends through SDPA \(model\.py's F\."
                                             r"scaled_dot_product_attention\): attn_implementation='") as e:
            load()
        assert "\n" not in str(e.value)
    lrkv.hf.set_attn_implementation("sdpa")
    ids = ids_of(lrkv, PROMPTS[0])
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"^this model caches with its own LRKVCache, which grows with "
                                             r"the sequence: cache_implementation='static' cannot be "
                                             r"honoured"):
            lrkv.hf.generate(ids, max_new_tokens=3, cache_implementation="static")
        dynamic = lrkv.hf.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="dynamic")
        assert torch.equal(dynamic, lrkv.hf.generate(ids, max_new_tokens=3, do_sample=False))


def test_native_trains_every_embedding_row(build):
    """A native folder's embedding has no padding_idx (config.json's pad_token_id null; generate pads with
    end-of-text, generation_config.json's): every row's gradient is our GPT's on the same ids, end-of-text's
    (id 0, before every text) too, and so is lm_head's."""
    mha = build("mha", 1)
    assert mha.native and json.loads((mha.out / "config.json").read_text())["pad_token_id"] is None
    hf = AutoModelForCausalLM.from_pretrained(mha.out).train()
    ids = mha.tok([PROMPTS[0][:12], PROMPTS[0][5:17]], return_tensors="pt")["input_ids"]  # end-of-text first
    hf(ids, labels=ids).loss.backward()
    ours = copy.deepcopy(mha.model).train()
    ours(ids[:, :-1], ids[:, 1:])[1].backward()
    theirs = hf.model.embed_tokens.weight.grad
    assert theirs[EOT].norm() > 0
    torch.testing.assert_close(theirs, ours.wte.weight.grad, atol=1e-7, rtol=0)
    torch.testing.assert_close(hf.lm_head.weight.grad, ours.lm_head.weight.grad, atol=1e-7, rtol=0)


def test_the_cards_snippet_prints_text(build, capsys):
    """The card's snippet, run as it stands on a native folder: the text it prints has no <|endoftext|> (the
    token its tokenizer puts first), the prompt and what follows it."""
    mha = build("mha", 1)
    card = (mha.out / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    capsys.readouterr()
    with torch.no_grad():
        exec(snippet, {})
    printed = capsys.readouterr().out
    assert printed.startswith("def parse(text):") and len(printed) > len("def parse(text):\n")
    assert export_hf.EOT not in printed


@pytest.mark.parametrize("attn, remote_code", [("lrkv", False), ("mha", False), ("mha", True)],
                         ids=["lrkv", "mha-native", "mha-remote"])
def test_peft_lora_by_the_cards_names(build, attn, remote_code):
    """The card's names for PEFT: target_modules="all-linear" adapts exactly its linear layers (NanoChat's
    q_proj ... fc2 natively, the repository's W_q ... W_out in remote code), and LoRA on those names puts
    every one in the forward (its lora_B has a gradient). LRKV's B_k and B_v, bare parameters, train whole
    beside the adapters, as the card says: PEFT 0.22's target_parameters stops at its own error on any
    module holding a W_q (HQQ's name for a quantised weight), which the test checks, to know when it no
    longer does."""
    peft = pytest.importorskip("peft", reason="pip install -r requirements-hf.txt")
    exported = build(attn, 1, remote_code=remote_code)
    card = (exported.out / "README.md").read_text()
    line = re.search(r"- Fine-tuning with PEFT: `target_modules` names (.*?) \(each block's", card).group(1)
    names = re.findall(r"`(\w+)`", line)
    assert names[:2] == (["q_proj", "k_proj"] if exported.native else ["W_q", "W_o"])

    def load():
        return AutoModelForCausalLM.from_pretrained(exported.out, trust_remote_code=not exported.native)

    every = peft.get_peft_model(load(), peft.LoraConfig(target_modules="all-linear"))
    adapted = {name.split(".")[-1] for name, m in every.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(names)
    lora = peft.get_peft_model(load(), peft.LoraConfig(target_modules=names))
    bare = [p for name, p in lora.named_parameters() if name.endswith((".B_k", ".B_v"))]
    assert ("`B_k`, `B_v`, bare parameters" in card) == (attn == "lrkv" and not exported.native) == bool(bare)
    for p in bare:  # the card's way: trained whole
        p.requires_grad_()
    ids = ids_of(exported, PROMPTS[0])
    lora(input_ids=ids, labels=ids).loss.backward()
    grads = {}
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            grads[name.split(".lora_B")[0].split(".")[-1]] = p.grad.norm()
    assert set(grads) == set(names) and all(g > 0 for g in grads.values()), grads
    assert all(p.grad.norm() > 0 for p in bare)
    if bare:
        with pytest.raises(AttributeError, match="'Linear' object has no attribute 'device'"):
            config = peft.LoraConfig(target_modules=names, target_parameters=["B_k", "B_v"])
            peft.get_peft_model(load(), config)


def test_a_variant_defined_only_in_a_test_exports(data_dir, tmp_path, monkeypatch):
    """tests/variants.py's PerLayerRankAttention (LRKV whose rank grows with depth), registered under an
    --attn name for this test alone, as test_variant.py registers it: it trains, exports (its file
    carried into the folder, no line of export_hf.py or modeling_lrkv.py naming it) and loads with our
    logits."""
    from variants import PerLayerRankAttention

    monkeypatch.setitem(model_module.VARIANTS, "lrkv_per_layer_test", PerLayerRankAttention)
    run, out = tmp_path / "run", tmp_path / "hf"
    flags = {**TINY, "attn": "lrkv_per_layer_test", "data_dir": data_dir, "out_dir": run}
    assert train.main([f"--{k}={v}" for k, v in flags.items()]) == 0
    assert export_hf.main([str(run / "ckpt.pt"), str(out)]) == 0
    files = ["layout.py", "model.py", "modeling_lrkv.py", "ring.py", "variants.py"]
    assert sorted(p.name for p in out.glob("*.py")) == files
    assert json.loads((out / "config.json").read_text())["variant"] == "variants.PerLayerRankAttention"
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    _, model = load_checkpoint(run / "ckpt.pt", "cpu")
    ids = torch.tensor([[*PROMPTS[0].encode()]])
    with torch.no_grad():
        ours = model(torch.cat((torch.full_like(ids[:, :1], EOT), ids), 1))[0][:, 1:]
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-5, rtol=0)


@torch.no_grad()
def full_forward_greedy(model, ids, new_tokens):
    """Our greedy tokens (1, new_tokens) after ids (1, T), read after end-of-text, each the argmax of our
    GPT's full forward over all before it: no cache, no decoding path."""
    idx = torch.cat((torch.full_like(ids[:, :1], EOT), ids), 1)
    for _ in range(new_tokens):
        idx = torch.cat((idx, model(idx)[0][:, -1:].argmax(-1)), 1)
    return idx[:, ids.size(1) + 1:]


@pytest.mark.parametrize("layout", ["plain", "cla2", "window-cla2-yoco"])
def test_a_variant_with_its_own_softmax_exports_equal(data_dir, tmp_path, monkeypatch, layout):
    """tests/variants.py's ScaledSoftmaxAttention (LRKV whose softmax has a learned temperature per head,
    times 1 + layer / 4: an attend of its own, which a layer reading another's keys must use), registered
    under an --attn name for this test alone: trained, exported and loaded, plain, with --cla=2 and with
    windows, --cla=2 and --yoco, its logits are ours (1e-5) and its greedy tokens our full forward's."""
    from variants import ScaledSoftmaxAttention

    monkeypatch.setitem(model_module.VARIANTS, "lrkv_scaled_softmax_test", ScaledSoftmaxAttention)
    run, out = tmp_path / "run", tmp_path / "hf"
    knobs = {"plain": {}, "cla2": dict(cla=2), **LAYOUTS}[layout]
    flags = {**TINY, **knobs, "attn": "lrkv_scaled_softmax_test", "data_dir": data_dir, "out_dir": run}
    assert train.main([f"--{k}={v}" for k, v in flags.items()]) == 0
    assert export_hf.main([str(run / "ckpt.pt"), str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    _, model = load_checkpoint(run / "ckpt.pt", "cpu")
    model.eval()
    assert type(hf.model.gpt_model.blocks[1].attn).__name__ == "ScaledSoftmaxAttention"
    ids = torch.tensor([[*PROMPTS[0].encode()]])
    with torch.no_grad():
        ours = model(torch.cat((torch.full_like(ids[:, :1], EOT), ids), 1))[0][:, 1:]
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-5, rtol=0)
        greedy = hf.generate(ids, max_new_tokens=NEW_TOKENS // 2, do_sample=False)[:, ids.size(1):]
    assert torch.equal(greedy, stop_at_eot(full_forward_greedy(model, ids, NEW_TOKENS // 2)))


def test_a_variant_whose_file_imports_what_a_folder_cannot_hold_is_one_line(build, tmp_path, monkeypatch,
                                                                             capsys):
    """A variant class in a file that imports more than torch, Python and the repository's model code
    (here train.py's) is refused in one line, nothing written."""
    ckpt = build("mha", 1).ckpt
    capsys.readouterr()
    monkeypatch.setitem(model_module.VARIANTS, "mha", type("Imported", (model_module.MultiHeadAttention,),
                                                           {"__module__": __name__}))
    monkeypatch.setattr(export_hf.inspect, "getsourcefile", lambda cls: __file__)
    assert export_hf.main([str(ckpt), str(tmp_path / "out"), "--remote_code"]) == 2
    assert "which an exported folder cannot hold" in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


# The tokenizers

TEXTS = ["Hello, world!", "  def f(x):\n\treturn x ** 2  # été ✓\n", "<|endoftext|> spelled out", "a\0b"]


@pytest.mark.parametrize("native", [False, True], ids=["remote", "native"])
@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_tokenizer_encodes_as_the_data_does(name, native, tmp_path):
    """The exported tokenizer: what prepare_data.py's tokenizer makes of the text (a NUL is no byte
    token: it would read as end-of-text), end-of-text before it for NanoChat, which does not read texts
    after one itself; padding on the left; decoding gives the text back."""
    ours = get_tokenizer(name)
    export_hf.tokenizer(ours, 64, native).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.padding_side == "left"
    for text in TEXTS:
        if name == "byte":
            expected = ours.encode_bytes(text.encode()).tolist()
        else:
            expected = ours.encode_batch([text])[0].tolist()
        ids = tok(text)["input_ids"]
        assert ids == [ours.eot_id] * native + expected, text
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
    """A flag that changes no layer (--yoco on 2 layers, a window no layer has) keeps MHA native;
    --remote_code makes none native."""
    tok = get_tokenizer("byte")
    config = GPTConfig(**{"attn": "mha", "vocab_size": BYTES, **knobs})
    assert export_hf.check("ckpt.pt", tok, config, False, False) == native
    assert export_hf.check("ckpt.pt", tok, config, False, True) is False


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


# An exported folder refuses a config.json that cannot make the model its weights are, in one line

def edited(folder, tmp_path, edit):
    """A copy of folder whose config.json edit(config) has changed."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def refused(folder, *fragments):
    """from_pretrained's error: one line, naming what config.json has wrong."""
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    message = str(error.value)
    assert "\n" not in message and message.startswith("config.json: "), message
    assert all(fragment in message for fragment in fragments), message
    return message


FIELDS = [field.name for field in dataclasses.fields(GPTConfig)]
WRONG_TYPES = {int: "4", float: "10000.0", bool: "yes", str: 5, int | None: 2.5}
OUT_OF_RANGE = [("n_layer", 0), ("cla", 3), ("window", 0), ("window", -1), ("window", 65),
                ("window_pattern", "sxl"), ("window_pattern", "SXL"), ("window_pattern", ""),
                ("rope_theta", 0), ("rope_theta", float("nan")),
                ("attn", "flash"), ("head_dim", 7), ("lrkv_rank", 9), ("yoco", 1)]


@pytest.mark.parametrize("field", FIELDS)
def test_a_missing_or_mistyped_field_is_refused_by_name(build, tmp_path, field):
    lrkv = build("lrkv", 2)
    missing = edited(lrkv.out, tmp_path, lambda c: c["model_args"].pop(field))
    refused(missing, f"model_args.{field}", "missing")
    kind = {f.name: f.type for f in dataclasses.fields(GPTConfig)}[field]
    bad = WRONG_TYPES[kind]
    shutil.rmtree(tmp_path / "edited")
    mistyped = edited(lrkv.out, tmp_path, lambda c: c["model_args"].update({field: bad}))
    refused(mistyped, f"model_args.{field}=")


@pytest.mark.parametrize("field, value", OUT_OF_RANGE, ids=lambda v: str(v))
def test_an_out_of_range_field_is_refused_by_name(build, tmp_path, field, value):
    lrkv = build("lrkv", 2)
    out_of_range = edited(lrkv.out, tmp_path, lambda c: c["model_args"].update({field: value}))
    refused(out_of_range, f"model_args.{field}=")


@pytest.mark.parametrize("edits, named", [
    (dict(vocab_size=300), "vocab_size"), (dict(lrkv_rank=3), "lrkv_rank"),
    (dict(head_dim=16, n_embd=64), "head_dim"), (dict(n_layer=4), "n_layer"),
    (dict(n_head=2, head_dim=16), "n_head"), (dict(rope_theta=20000.0), "rope_theta"),
    (dict(window=4, window_pattern="SL"), "window"), (dict(cla=1), "cla"), (dict(attn="mla"), "attn")])
def test_fields_that_disagree_with_the_weights_are_refused_by_name(build, tmp_path, edits, named):
    """Fields each valid, but not those the weights were exported with, shapes kept or not: the weights
    record theirs, and the message names each that differs. Weights that record none (an older
    export) are checked by shape: the message names the fields that shape the first tensor that
    disagrees."""
    lrkv = build("lrkv", 2)
    disagreeing = edited(lrkv.out, tmp_path, lambda c: c["model_args"].update(edits))
    refused(disagreeing, f"model_args.{named}=", "the weights were exported with")
    if named in ("vocab_size", "lrkv_rank", "head_dim", "n_layer", "n_head"):  # shapes that change
        weights = safetensors.torch.load_file(disagreeing / "model.safetensors")
        safetensors.torch.save_file(weights, disagreeing / "model.safetensors", metadata={"format": "pt"})
        refused(disagreeing, named, "model.safetensors holds")


def with_metadata(folder, tmp_path, **edits):
    """A copy of folder whose model.safetensors' metadata edits change."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    with safetensors.safe_open(copy / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    weights = safetensors.torch.load_file(copy / "model.safetensors")
    safetensors.torch.save_file(weights, copy / "model.safetensors", metadata={**metadata, **edits})
    return copy


def refused_in_one_line(folder, pattern):
    with pytest.raises(ValueError, match=pattern) as error:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert "\n" not in str(error.value)


def test_weights_whose_model_args_record_is_not_json_are_refused_naming_file_and_field(build, tmp_path):
    lrkv = build("lrkv", 2)
    refused_in_one_line(with_metadata(lrkv.out, tmp_path, model_args="{not json"),
                        r"^model\.safetensors: its metadata model_args is not the JSON object the export "
                        r"writes: '\{not json'$")
    shutil.rmtree(tmp_path / "edited")
    refused_in_one_line(with_metadata(lrkv.out, tmp_path, code_sha256="[1, 2]"),
                        r"^model\.safetensors: its metadata code_sha256 is not the JSON object")


def test_weights_lacking_one_of_the_exports_records_are_refused_naming_file_and_field(build, tmp_path):
    """model.safetensors' metadata with model_args removed (model_args_sha256 and code_sha256 kept), or
    another of the three: one line naming the file and the field, not a KeyError."""
    lrkv = build("lrkv", 2)
    for field in ("model_args", "model_args_sha256", "code_sha256"):
        copy = tmp_path / field
        shutil.copytree(lrkv.out, copy)
        with safetensors.safe_open(copy / "model.safetensors", "pt") as f:
            metadata = f.metadata()
        weights = safetensors.torch.load_file(copy / "model.safetensors")
        del metadata[field]
        safetensors.torch.save_file(weights, copy / "model.safetensors", metadata=metadata)
        refused_in_one_line(copy, rf"^model\.safetensors: its metadata has no {field}, which the export "
                                  r"records beside the others it has: edited$")


def test_the_folder_runs_the_code_the_export_wrote_or_names_the_file(build, tmp_path):
    """An edited copy of a code file (model.py's MLP scaling its output by 1.5) is refused, naming the file;
    so are config.json and the weights' metadata edited together (another rope_theta in both), and
    config.json's digests edited to match the edited file, which the weights' metadata records too. Each
    digest is the file's SHA-256, computed here."""
    lrkv = build("lrkv", 2)
    config = json.loads((lrkv.out / "config.json").read_text())
    assert config["code_sha256"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                     for p in lrkv.out.glob("*.py")}
    copy = tmp_path / "edited"
    shutil.copytree(lrkv.out, copy)
    source = (copy / "model.py").read_text()
    scaled = source.replace("return x + self.mlp.W_out(", "return x + 1.5 * self.mlp.W_out(", 1)
    assert scaled != source
    (copy / "model.py").write_text(scaled)
    refused_in_one_line(copy, r"^model\.py: not the file the export wrote \(its SHA-256 is not "
                              r"config\.json's code_sha256\): this folder's code was edited$")
    config["code_sha256"]["model.py"] = hashlib.sha256(scaled.encode()).hexdigest()
    (copy / "config.json").write_text(json.dumps(config))
    refused_in_one_line(copy, r"^config\.json: code_sha256 where the weights were exported with other code")
    shutil.rmtree(copy)
    args = {**lrkv.model_args, "rope_theta": 20000.0}
    both = edited(with_metadata(lrkv.out, tmp_path, model_args=json.dumps(args)).rename(tmp_path / "both"),
                  tmp_path, lambda c: c["model_args"].update(rope_theta=20000.0))
    refused_in_one_line(both, r"^model\.safetensors: its metadata model_args is not the record the export "
                              r"wrote")


def test_a_bad_end_of_text_or_variant_is_refused(build, tmp_path):
    lrkv = build("lrkv", 2)
    refused(edited(lrkv.out, tmp_path, lambda c: c.update(eot_id=None)), "eot_id=None")
    shutil.rmtree(tmp_path / "edited")
    refused(edited(lrkv.out, tmp_path, lambda c: c.update(eot_id=999)), "eot_id=999")
    shutil.rmtree(tmp_path / "edited")
    refused(edited(lrkv.out, tmp_path, lambda c: c.update(model_args=[1, 2])), "model_args=[1, 2]")


def test_too_old_a_transformers_is_one_line(build, monkeypatch, capsys):
    """The folder's code says which transformers it needs, in one line, where an older one imports it
    (its import calls check_transformers with transformers' version), for the model and for the tokenizer,
    whose class it holds; the version is requirements-hf.txt's lowest. A script that does not catch it ends
    with that one line on stderr, no traceback (Python's hook, sys.excepthook, as the error it raised, or
    one it caused, reaches it), and any other exception as before."""
    lrkv = build("lrkv", 2)
    module = sys.modules[type(lrkv.hf).__module__]
    low = re.search(r"transformers>=([0-9.]+)", export_hf.transformers_requirement()).group(1)
    assert ".".join(map(str, module.MIN_TRANSFORMERS)) == low
    message = rf"^this model needs transformers >= {re.escape(low)}, not 4\.57\.3: "
    before = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: before.append(args[1]))
    with pytest.raises(ImportError, match=message) as error:
        module.check_transformers("4.57.3")
    try:  # as transformers' loading might wrap it
        raise RuntimeError("loading failed") from error.value
    except RuntimeError as wrapped:
        for raised in (error.value, wrapped):
            capsys.readouterr()
            sys.excepthook(type(raised), raised, raised.__traceback__)
            assert capsys.readouterr().err == f"ImportError: {error.value}\n"
    other = ValueError("another")
    sys.excepthook(ValueError, other, None)
    assert before == [other]
    module.check_transformers(transformers.__version__)
    # the tokenizer's class is the same file's (tokenizer_config.json's auto_map), so that too stops there
    assert type(lrkv.tok).__module__ == type(lrkv.hf).__module__
    record = json.loads((lrkv.out / "tokenizer_config.json").read_text())
    assert record["auto_map"] == {"AutoTokenizer": [None, "modeling_lrkv.LRKVTokenizer"]}


# export_hf.py's own failures: a full disk, a folder it cannot write, a tokenizer record of another age,
# an export killed midway

@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_a_full_disk_is_one_line_and_leaves_nothing(build, tmp_path, monkeypatch, capsys, error):
    """A stand-in for a disk that fills while the weights are written (root can mount no tmpfs here):
    the OSError Python raises, or the SafetensorError safetensors raises for it."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        if error == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                              "message: \"No space left on device\" })")

    ckpt = build("lrkv", 1).ckpt
    capsys.readouterr()
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert export_hf.main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "No space left on device" in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_the_tokenizer_writes_is_one_line(build, tmp_path, monkeypatch, capsys):
    """The tokenizers library's own error for a full disk, a bare Exception: its tokenizer.json written to
    /dev/full, a device that is always full."""
    real = export_hf.tokenizer

    def onto_a_full_disk(*args):
        backend = real(*args).backend_tokenizer
        return SimpleNamespace(save_pretrained=lambda folder: backend.save("/dev/full"))

    ckpt = build("lrkv", 1).ckpt
    capsys.readouterr()
    monkeypatch.setattr(export_hf, "tokenizer", onto_a_full_disk)
    assert export_hf.main([str(ckpt), str(tmp_path / "out")]) == 2
    err = one_line_error(capsys)
    assert "cannot be written: No space left on device (os error 28); nothing was written" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("when", ["card", "mkdir"])
def test_ctrl_c_during_an_export_is_one_line_and_leaves_nothing(build, tmp_path, monkeypatch, capsys, when):
    """Ctrl-C while the folder is written (here as the card is), or just as the temporary folder (and the
    folder above OUT_DIR it needs) has been made, before anything is written into it: one line, exit code
    130, nothing left, no .OUT_DIR.* folder nor the folder above."""
    real = os.mkdir

    def interrupted(path=None, *args, **kwargs):
        if when == "mkdir":
            real(path, *args, **kwargs)
            if not Path(path).name.startswith(".out."):
                return
        raise KeyboardInterrupt

    ckpt = build("lrkv", 1).ckpt
    capsys.readouterr()
    monkeypatch.setattr(*(export_hf, "card") if when == "card" else (os, "mkdir"), interrupted)
    assert export_hf.main([str(ckpt), str(tmp_path / "new" / "out")]) == 130
    assert one_line_error(capsys) == "export_hf.py: interrupted; nothing was written\n"
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_an_export_says_so_and_exits_with_its_number(build, tmp_path, monkeypatch, capsys):
    """SIGTERM (run_main's Stopped, a KeyboardInterrupt) while the card is written: its own line and 128 +
    15, not Ctrl-C's, and nothing left."""
    def stopped(*args, **kwargs):
        raise Stopped(signal.SIGTERM)

    ckpt = build("lrkv", 1).ckpt
    capsys.readouterr()
    monkeypatch.setattr(export_hf, "card", stopped)
    assert export_hf.main([str(ckpt), str(tmp_path / "out")]) == 128 + signal.SIGTERM
    assert one_line_error(capsys) == "export_hf.py: stopped by SIGTERM; nothing was written\n"
    assert list(tmp_path.iterdir()) == []


def test_a_folder_it_cannot_write_is_one_line(build, tmp_path, capsys):
    """OUT_DIR under a file (root writes any folder, so a file stands where a folder must)."""
    (tmp_path / "file").write_text("a file")
    ckpt = build("lrkv", 1).ckpt
    capsys.readouterr()
    assert export_hf.main([str(ckpt), str(tmp_path / "file" / "out")]) == 2
    assert f"cannot be written: File exists ({tmp_path / 'file'})" in one_line_error(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize("record, exports", [
    ({"tokenizer": "byte", "vocab_size": 256, "eot_id": 0}, "silently"),  # the record of today's meta.json
    ({"tokenizer": "byte"}, "vocab_size=None, eot_id=None"),  # older: its vocabulary and end-of-text
    ({"tokenizer": "byte", "vocab_size": "256", "eot_id": None}, "vocab_size='256', eot_id=None"),
    (None, False), ({"tokenizer": "sentencepiece"}, False), ("byte", False)])
def test_tokenizer_records_of_another_age(build, tmp_path, capsys, record, exports):
    """A record the export reads as sample.py does, by the tokenizer's name, says so in one line on stderr
    naming what it lacks; one it cannot read is refused in one line, nothing written."""
    ckpt = torch.load(build("lrkv", 1).ckpt, weights_only=True)
    if record is None:
        del ckpt["tokenizer"]
    else:
        ckpt["tokenizer"] = record
    ckpt.pop("digest")
    ckpt["digest"] = digest(ckpt)  # an intact checkpoint of another age, not a damaged one
    torch.save(ckpt, tmp_path / "ckpt.pt")
    capsys.readouterr()
    code = export_hf.main([str(tmp_path / "ckpt.pt"), str(tmp_path / "out")])
    if exports:
        assert code == 0 and (tmp_path / "out" / "tokenizer.json").exists()
        err = capsys.readouterr().err
        if exports == "silently":
            assert err == ""
        else:
            assert err == (f"export_hf.py: {tmp_path / 'ckpt.pt'}: its tokenizer record has {exports}: "
                           "exported as the 'byte' tokenizer's, 256 tokens, end-of-text id 0\n")
    else:
        assert code == 2 and "tokenizer" in one_line_error(capsys)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_killed_exports_temporary_folder_is_removed_and_said(build, tmp_path, capsys):
    stale = tmp_path / ".out.k1ll3d"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    ckpt = build("lrkv", 1).ckpt
    capsys.readouterr()
    assert export_hf.main([str(ckpt), str(tmp_path / "out")]) == 0
    assert f"removed {stale}" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
