"""
Export a train.py checkpoint to a folder that Hugging Face transformers and lm-evaluation-harness
load, offline, with its tokenizer:

    python export_hf.py out/demo/lrkv/ckpt.pt out/hf/lrkv
    python export_hf.py out/demo/mha/ckpt.pt out/hf/mha
    python export_hf.py out/demo/lrkv/ckpt.pt out/hf/lrkv-native --native

MHA, GQA and MQA (every layer with keys of its own and no window) become transformers' own
NanoChatForCausalLM, the nanochat model this repository's backbone is; loading needs no
trust_remote_code. Every other checkpoint (MLA, LRKV, GTA, GLA, TPA, MLRA; any that shares keys,
--cla above 1 or --yoco; any with sliding windows, --window) becomes hf/modeling_lrkv.py, copied
into the folder (config.json's auto_map names it): AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True), which attends and caches as this repository's decoder does. --native
turns LRKV into NanoChatForCausalLM too, each head's key and value weights materialised as
W_shared + U_h B_h^T: same outputs, but transformers then caches MHA's full keys and values, not
LRKV's small cache.

The folder holds config.json, model.safetensors, generation_config.json, the tokenizer
(tokenizer.json, tokenizer_config.json) and a README.md model card. It is built in a temporary
folder beside OUT_DIR and renamed at the end: a failed export leaves nothing. Bad input (a
checkpoint that does not load, an OUT_DIR that is not an empty folder, --native for a variant it
cannot express) is one line on stderr and exit code 2. docs/export.md says more.
"""

import base64
import dataclasses
import importlib.util
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

# This repository's code, all of it that the export reads
from lib.training.checkpoint import load_checkpoint
from lib.training.configurator import ArgumentParser, ConfigError

REPO = Path(__file__).resolve().parent
MODELING = REPO / "hf" / "modeling_lrkv.py"  # the remote code, copied into every folder that uses it
GPT2_RANKS = REPO / "gpt2.tiktoken"  # GPT-2's BPE, tiktoken's ranks: a token's id is its rank
EOT = "<|endoftext|>"
NATIVE = ("mha", "gqa", "mqa")  # NanoChatForCausalLM's attention: G key/value heads of d_h
NATIVE_IF_ASKED = ("lrkv",)  # --native: LRKV's heads materialised into MHA's


def main(argv=None):
    """Export; the exit code: 0 done, 2 bad input."""
    parser = ArgumentParser(prog="export_hf.py", description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("ckpt", help="a ckpt.pt written by train.py")
    parser.add_argument("out_dir", help="the folder to write: it must not exist, or be empty")
    parser.add_argument("--native", action="store_true",
                        help="LRKV as transformers' NanoChatForCausalLM, its heads materialised "
                             "(MHA's cache)")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here needs the network: transformers must not try it
    t0, out = time.perf_counter(), Path(args.out_dir)
    try:
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise ConfigError(f"{out}: exists and is not an empty folder; give another OUT_DIR")
        ckpt, model = load_checkpoint(args.ckpt, "cpu")
        native = check(args.ckpt, ckpt, model.config, args.native)
        modeling = load_modeling()
        check_knobs(args.ckpt, model, modeling)
    except ConfigError as e:
        print(f"export_hf.py: {e}", file=sys.stderr)
        return 2

    command = shlex.join(["python", "export_hf.py", *(argv if argv is not None else sys.argv[1:])])
    try:
        write_atomically(out, lambda folder: export(ckpt, model, modeling, native, folder, command))
    except OSError as e:  # a folder on the way is a file, or read-only; a full disk
        print(f"export_hf.py: {out}: cannot be written: {e.strerror or e}; nothing was written",
              file=sys.stderr)
        return 2
    kind = ("NanoChatForCausalLM (native)" if native
            else "LRKVForCausalLM (remote code, trust_remote_code=True)")
    print(f"{out}: {model.config.attn} as {kind}, in {time.perf_counter() - t0:.1f} s")
    return 0


def check(path, ckpt, config, native):
    """Whether the export is native (NanoChatForCausalLM), or a ConfigError where the checkpoint
    cannot be exported as asked. config: the checkpoint's GPTConfig."""
    args, meta = ckpt["model_args"], ckpt.get("tokenizer")
    if not isinstance(meta, dict) or meta.get("tokenizer") not in ("gpt2", "byte"):
        raise ConfigError(f"{path}: has no tokenizer this export knows (its data's meta.json, gpt2 or byte)")
    if meta["vocab_size"] > args["vocab_size"]:
        raise ConfigError(f"{path}: its tokenizer has {meta['vocab_size']} tokens, its model "
                          f"{args['vocab_size']}")
    flags = layout_flags(config)  # NanoChat has neither shared keys nor windows
    if native and (flags or config.attn not in NATIVE + NATIVE_IF_ASKED):
        raise ConfigError(f"--native: {' '.join([f'--attn={config.attn}', *flags])} is not expressible as "
                          f"NanoChatForCausalLM (only {', '.join(NATIVE + NATIVE_IF_ASKED)}, without --cla, "
                          "--yoco or --window); drop --native for the remote-code export")
    return native or (not flags and config.attn in NATIVE)


def layout_flags(config):
    """The flags, as train.py takes them, by which some layer reads another's keys and values or has
    a window: [] where every layer computes its own and sees every position."""
    layers, flags = range(config.n_layer), []
    if any(config.kv_source(layer) != layer for layer in layers):
        flags += [f"--cla={config.cla}"] * (config.cla > 1) + ["--yoco"] * config.yoco
    if any(config.layer_window(layer) is not None for layer in layers):
        flags += [f"--window={config.window}", f"--window_pattern={config.window_pattern}"]
    return flags


def load_modeling():
    """hf/modeling_lrkv.py as the module modeling_lrkv, the name config.json's auto_map gives it."""
    spec = importlib.util.spec_from_file_location("modeling_lrkv", MODELING)
    modeling = sys.modules["modeling_lrkv"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modeling)  # imports transformers: a few seconds
    return modeling


def check_knobs(path, model, modeling):
    """A ConfigError where the checkpoint's model sets a knob that modeling_lrkv.py does not know (one
    the repository has gained since) to anything but its default: the export would be another model."""
    defaults = {field.name: field.default for field in dataclasses.fields(model.config)}
    unknown = [f"--{name}={value!r}" for name, value in dataclasses.asdict(model.config).items()
               if name not in modeling.LRKVConfig.__dataclass_fields__ and value != defaults[name]]
    if unknown:
        raise ConfigError(f"{path}: {', '.join(unknown)}: hf/modeling_lrkv.py has no such model (it has "
                          "the nine variants, --cla, --yoco and --window); nothing was written")


def write_atomically(out, write):
    """Call write(folder) on a new temporary folder beside out, then rename it to out. Anything
    that fails removes the temporary folder, and the folders above out that this made."""
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        # mkdtemp's folder is private, and so is a file or two that transformers writes: the export is
        # for whoever may read the folder it goes into
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        os.rename(tmp, out)  # replaces out where it is an empty folder, fails where it has been filled since
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # deepest first
            folder.rmdir()
        raise


def export(ckpt, model, modeling, native, folder, command):
    """Write the model, the tokenizer and the card into folder."""
    # imported here, not at the top: most bad input is refused before transformers' seconds of import
    from transformers import GenerationConfig
    from transformers.utils import logging

    logging.disable_progress_bar()  # save_pretrained's bar for a single file

    meta, args = ckpt["tokenizer"], ckpt["model_args"]
    eot = meta["eot_id"]
    hf = native_model(model, eot) if native else remote_model(model, modeling, eot)
    # generate stops at end-of-text, as sample.py does, and draws no id the tokenizer lacks (a
    # vocabulary padded for fast matmuls: GPT-2's 50257 tokens in 50304 rows)
    padding = list(range(meta["vocab_size"], args["vocab_size"]))
    hf.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                                            suppress_tokens=padding or None)
    hf.save_pretrained(folder)
    tokenizer(meta, args["block_size"]).save_pretrained(folder)
    (folder / "README.md").write_text(card(ckpt, model, native, command))


def native_model(model, eot):
    """NanoChatForCausalLM holding the checkpoint's weights, each mapped to exactly one of its own.
    NanoChat is this backbone: RMSNorm without weights on the embedding, before every sublayer, on
    queries and keys and before lm_head; ReLU^2; RoPE turning dims i and i + d_h/2 as model.py's
    does. It normalises after RoPE, model.py before it: the same, a rotation keeping the RMS."""
    from transformers import NanoChatConfig, NanoChatForCausalLM

    c = model.config
    config = NanoChatConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=4 * c.n_embd,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        num_key_value_heads={"mha": c.n_head, "mqa": 1, "gqa": c.n_kv_head, "lrkv": c.n_head}[c.attn],
        max_position_embeddings=c.block_size, hidden_act="relu2",
        # model.py's norm is F.rms_norm with eps=None: the eps of the dtype it computes in, fp32's
        rms_norm_eps=torch.finfo(torch.float32).eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        final_logit_softcapping=None,  # nanochat's soft cap: this model has none
        attention_bias=False, tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    with torch.device("meta"):
        hf = NanoChatForCausalLM(config)
    hf.load_state_dict(native_weights(model), strict=True, assign=True)  # strict: none of theirs left empty
    return hf


def native_weights(model):
    """model's weights under NanoChatForCausalLM's names, or a ValueError naming any left unmapped."""
    c = model.config
    ours = dict(model.state_dict())
    theirs = {"model.embed_tokens.weight": ours.pop("wte.weight"),
              "lm_head.weight": ours.pop("lm_head.weight")}
    for i in range(c.n_layer):
        a, m = f"blocks.{i}.attn.", f"model.layers.{i}."
        theirs[m + "self_attn.q_proj.weight"] = ours.pop(a + "W_q.weight")
        if c.attn == "lrkv":
            k, v = lrkv_head_weights(ours, a, c)
        else:
            k, v = ours.pop(a + "W_k.weight"), ours.pop(a + "W_v.weight")
        theirs[m + "self_attn.k_proj.weight"], theirs[m + "self_attn.v_proj.weight"] = k, v
        theirs[m + "self_attn.o_proj.weight"] = ours.pop(a + "W_o.weight")
        theirs[m + "mlp.fc1.weight"] = ours.pop(f"blocks.{i}.mlp.W_in.weight")
        theirs[m + "mlp.fc2.weight"] = ours.pop(f"blocks.{i}.mlp.W_out.weight")
    if ours:
        raise ValueError(f"weights with no place in NanoChatForCausalLM: {', '.join(ours)}")
    return theirs


def lrkv_head_weights(ours, prefix, c):
    """An LRKV layer's key and value projections as MHA's, in nn.Linear's layout (H d_h, d): head h's
    W_h = W_shared + U_h B_h^T, whose transpose is W_shared^T + B_h U_h^T. The layer's six weights
    are taken out of ours."""
    H, d_h, r = c.n_head, c.head_dim, c.lrkv_rank
    heads = []
    for kind in "kv":
        W_shared = ours.pop(f"{prefix}W_shared_{kind}.weight")  # (d_h, d): W_shared^T
        U = ours.pop(f"{prefix}U_{kind}.weight").view(H, r, -1)  # (H, r, d): the U_h^T
        B = ours.pop(f"{prefix}B_{kind}").view(H, d_h, r)  # (H, d_h, r): the B_h
        heads.append((W_shared + torch.einsum("hdr,hrc->hdc", B, U)).reshape(H * d_h, -1))  # (H d_h, d)
    return heads


def remote_model(model, modeling, eot):
    """modeling_lrkv.py's LRKVForCausalLM of model's config, holding its weights under the same names,
    registered so that save_pretrained copies the file and config.json's auto_map names it."""
    modeling.LRKVConfig.register_for_auto_class()
    modeling.LRKVForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    args = {name: value for name, value in dataclasses.asdict(model.config).items()
            if name in modeling.LRKVConfig.__dataclass_fields__}  # the others at their defaults: check_knobs
    config = modeling.LRKVConfig(**args, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    with torch.device("meta"):
        hf = modeling.LRKVForCausalLM(config)
    hf.load_state_dict(model.state_dict(), strict=True, assign=True)
    return hf


# The tokenizer: the data's, as tokenizers' byte-level BPE, end-of-text before every text as
# sample.py and eval.py put it (it opens every document in the training data)

def tokenizer(meta, block_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    eot = meta["eot_id"]
    symbol = byte_symbols()
    if meta["tokenizer"] == "byte":
        # one token a byte, its id the byte; NUL is end-of-text, so a NUL in a text has no token
        # (tokenizers drops a symbol outside the vocabulary), as prepare_data.py drops it
        vocab = {symbol[b]: b for b in range(256) if b != eot}
        merges, regex = [], False
    else:
        ranks = gpt2_ranks()
        vocab = {"".join(symbol[b] for b in token): rank for token, rank in ranks.items()}
        merges, regex = gpt2_merges(ranks), True
    vocab[EOT] = eot
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[tuple("".join(symbol[b] for b in part) for part in pair)
                                                    for pair in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)  # GPT-2's regex
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B",
                                                       special_tokens=[(EOT, eot)])
    # split_special_tokens: a text that spells <|endoftext|> is encoded as text, as prepare_data.py does
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   model_max_length=block_size, split_special_tokens=True)


def byte_symbols():
    """GPT-2's printable stand-in for each byte, which byte-level BPE vocabularies are written in:
    the byte's own character where it is printable, else chr(256 + n) for the n-th of the others."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def gpt2_ranks():
    """{token's bytes: rank} from gpt2.tiktoken, one `base64 rank` a line."""
    lines = GPT2_RANKS.read_bytes().splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in map(bytes.split, lines)}


def gpt2_merges(ranks):
    """BPE's merges, in rank order, from tiktoken's ranks: a token of rank n is the merge of the two
    parts that BPE leaves of its bytes when only merges ranked below n may apply."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:  # merge the lowest-ranked adjacent pair ranked below the token, as BPE does
            best, i = min((ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(parts)
        elif len(parts) > 2:
            raise ValueError(f"{GPT2_RANKS}: token {rank} is no merge of two tokens ranked below it")
    return merges


# The model card

def layout(c):
    """The card's two lines: which positions each layer sees, and whose keys and values it reads."""
    def these(layers, verb):
        one = len(layers) == 1
        return f"layer{'' if one else 's'} {', '.join(map(str, layers))} {verb}{'s' if one else ''}"

    local = [layer for layer in range(c.n_layer) if c.layer_window(layer) is not None]
    seen = "every layer sees every position before it"
    if local:
        seen = (f"{these(local, 'see')} only the last {c.window} positions (`--window={c.window} "
                f"--window_pattern={c.window_pattern}`, tiled over the layers, the last layer always L); "
                "the others every position before them")
    readers = {}  # owner: the other layers that read its keys and values
    for layer in range(c.n_layer):
        if c.kv_source(layer) != layer:
            readers.setdefault(c.kv_source(layer), []).append(layer)
    shared = "every layer computes its own"
    if readers:
        flags = " ".join([f"--cla={c.cla}"] * (c.cla > 1) + ["--yoco"] * c.yoco)
        shared = f"shared (`{flags}`): " + "; ".join(f"{these(them, 'read')} layer {owner}'s"
                                                     for owner, them in readers.items())
    return f"- Windows: {seen}.\n- Keys and values: {shared}."


def card(ckpt, model, native, command):
    c, cfg, meta = model.config, ckpt.get("config", {}), ckpt["tokenizer"]
    knobs = {"mha": [], "mqa": [], "gqa": ["n_kv_head"], "mla": ["kv_lora_rank", "rope_head_dim"],
             "lrkv": ["lrkv_rank"], "gta": ["gta_kv_heads"], "gla": ["gla_latent_heads", "gla_latent_dim",
             "rope_head_dim"], "tpa": ["tpa_q_rank", "tpa_kv_rank"],
             "mlra": ["mlra_latent_heads", "mlra_latent_dim", "rope_head_dim"]}[c.attn]
    shape = ", ".join(f"{k} {getattr(c, k)}" for k in ("n_layer", "n_head", "head_dim", "n_embd",
                                                      "vocab_size", "block_size", *knobs))
    per_token = {dtype: model.kv_cache_bytes(1, 1, dtype) for dtype in (torch.bfloat16, torch.float32)}
    mha_bytes = 2 * c.n_layer * c.n_embd * 2  # the native LRKV's: every head's key and value, in bf16
    if native:
        load = "from_pretrained(folder)`, no remote code: transformers' NanoChatForCausalLM"
        cache = (f"transformers' DynamicCache, {per_token[torch.bfloat16]:,} bytes per token in bf16"
                 if c.attn != "lrkv" else
                 f"transformers' DynamicCache of every head's full key and value, {mha_bytes:,} bytes "
                 f"per token in bf16 (MHA's), not LRKV's {per_token[torch.bfloat16]:,}: export without "
                 "--native to keep LRKV's cache")
    else:
        load = "from_pretrained(folder, trust_remote_code=True)`, the model's code being modeling_lrkv.py"
        cache = (f"modeling_lrkv.py's LatentCache, what this repository's decoder caches: "
                 f"{per_token[torch.bfloat16]:,} bytes per token in bf16, {per_token[torch.float32]:,} in "
                 "fp32 (model.kv_cache_bytes)")
        full = model.kv_cache_bytes(1, c.block_size, torch.bfloat16)
        if full < c.block_size * per_token[torch.bfloat16]:
            cache += (f"; a layer whose readers all have a window keeps only its last {c.window} positions, "
                      f"so a whole context of {c.block_size} tokens holds {full:,} bytes in bf16, not "
                      f"{c.block_size * per_token[torch.bfloat16]:,}")
    steps, batch = ckpt.get("step"), cfg.get("batch_size")
    tokens = f", {steps * batch * c.block_size:,} tokens" if steps is not None and batch else ""
    val = ckpt.get("val_loss")
    flags = layout_flags(c)
    return f"""# {c.attn}{f" ({' '.join(flags)})" if flags else ""}: a GPT of the lrkv repository

Attention `--attn={c.attn}`, {model.get_num_params():,} parameters: {shape}.

- Load: `AutoModelForCausalLM.{load}; the tokenizer likewise, `AutoTokenizer`.
{layout(c)}
- Cache: {cache}.
- Tokenizer: {meta["tokenizer"]}, {meta["vocab_size"]} tokens, end-of-text id {meta["eot_id"]}, which the
  tokenizer puts before every text (every training document starts with it).
- Training: data `{cfg.get("data_dir", "?")}` ({meta.get("source", "?")}), {steps} steps{tokens}.
- Validation loss: {f"{val:.4f}" if val is not None else "not recorded"} nats per token.
- Made by: `{command}`

Log-likelihoods and greedy tokens equal the repository's model.py (docs/export.md).
"""


if __name__ == "__main__":
    sys.exit(main())
