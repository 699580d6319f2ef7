"""
This repository's GPT in Hugging Face transformers. export_hf.py copies model.py, and the files of
lib/attention/ that the model runs (ring.py, layout.py, rivals.py, a variant's own file), beside this one,
their imports made relative, and writes config.json:

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)   # or AutoModel

So the folder computes with the repository's own code, every variant, layout and cache; this file adds
only what transformers asks of a model, and says it where it does:

  - LRKVConfig holds the checkpoint's model_args, which model.GPTConfig checks: an edited config.json is
    refused at load in one line that names the field, and weights that config.json does not describe too.
    Its to_dict() adds the standard sizes they make (hidden_size, ...), which PEFT's prompt tuning reads.
  - Every sequence is read after an end-of-text, as sample.py and eval.py read it and as every training
    document starts: the cache begins with it, so that a text tokenized without one (the tokenizer adds
    none) is scored and continued as this repository scores and continues it. A sequence whose first
    token is end-of-text is read as it is; inputs_embeds are read after the end-of-text's embedding.
  - Positions come from the attention mask: a token's position is the number of real tokens before it in
    its row, so a left-padded batch (the tokenizer pads on the left) decodes as each row would alone.
  - LRKVCache is transformers' Cache around ring.RingKVCache: it holds what the repository's decoder
    caches, growing with the sequence (model.kv_cache_bytes of the positions held, the end-of-text
    included), and beam search, prompt lookup and assisted decoding reorder, repeat and crop it.
  - Training, as transformers' own models train: no cache while the model trains or is checkpointed
    (LRKVModel.read), GPT's training path with each row read alone (read_rows_alone), checkpointing
    through transformers' hook (_set_gradient_checkpointing), the loss first in the output.
  - generate stops at the context, keeping what it made (_prepare_generated_length); an attn_implementation
    or cache_implementation it cannot honour is refused in one line.
  - The forward reads no tensor's value into Python (.item()) and hooks nothing unless asked: one graph
    under torch.compile (docs/export.md names the one break left, a windowed model's padded prompt).
  - The folder runs the code the export wrote: config.json's code_sha256 (check_code), and the
    tokenizer's class is this file's (LRKVTokenizer), so that too old a transformers stops at either,
    in one line (said_in_one_line).
"""

import hashlib
import inspect
import json
import re
import sys
from dataclasses import dataclass, fields

import safetensors
import torch
from torch.utils.checkpoint import checkpoint
import transformers
from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerFast
from transformers.cache_utils import Cache
from transformers.modeling_outputs import ModelOutput
from transformers.utils import cached_file, logging

from . import model
from .model import GPT, GPTConfig
from .ring import RingKVCache

try:  # transformers 5's name; this folder needs transformers >= MIN_TRANSFORMERS
    from transformers import PreTrainedConfig
except ImportError:
    PreTrainedConfig = None

MIN_TRANSFORMERS = (5, 0)


def check_transformers(version):
    """An ImportError of one line where the transformers that imports this file is older than it needs,
    which a script that does not catch it ends with in that one line (said_in_one_line)."""
    if PreTrainedConfig is None or tuple(int(part) for part in version.split(".")[:2]) < MIN_TRANSFORMERS:
        error = ImportError(f"this model needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, not "
                            f"{version}: pip install -U 'transformers>=5'")
        said_in_one_line(error)
        raise error


def said_in_one_line(error):
    """Python's hook for an exception nothing catches, made to print error (or an exception it caused) as
    its one line, `ImportError: ...`, without the traceback through transformers' loading (17 to 20 lines
    on transformers 4.57); every other exception as before."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        chain = value
        while chain is not None and chain is not error:
            chain = chain.__cause__ or chain.__context__
        if chain is None:
            return previous(kind, value, traceback)
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
    sys.excepthook = hook


check_transformers(transformers.__version__)
logger = logging.get_logger(__name__)

# the name generate gives the cache among a forward's arguments: "cache" from transformers 5.24 on
CACHE = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"


def model_arg(field, less=0, settable=False):
    """An attribute of LRKVConfig read from model_args: model_args[field] - less (None with no model_args);
    settable: setting it sets model_args[field]."""
    return property(lambda self: self.model_args[field] - less if self.model_args else None,
                    (lambda self, value: self.model_args.update({field: value + less})) if settable else None)


class LRKVConfig(PreTrainedConfig):
    """model_args: the checkpoint's, GPTConfig's fields all; eot_id: the end-of-text token; variant: where
    the folder's file holds the attention class of a variant that model.VARIANTS does not name."""

    model_type = "lrkv"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # Trainer.evaluate gathers logits, not caches

    def __init__(self, model_args=None, eot_id=None, variant=None, code_sha256=None, use_cache=True,
                 **kwargs):
        sizes = {name: kwargs.pop(name) for name in SIZES if name in kwargs}  # to_dict's, saved back
        self.model_args, self.eot_id, self.variant, self.use_cache = model_args, eot_id, variant, use_cache
        self.code_sha256 = code_sha256  # {file: SHA-256} of the folder's code, as the export wrote it
        if code_sha256 is not None and not (isinstance(code_sha256, dict) and all(
                re.fullmatch(r"\w+\.py", str(name)) and isinstance(d, str)
                for name, d in code_sha256.items())):
            raise ValueError(f"config.json: code_sha256={code_sha256!r}: must be the code files' SHA-256 "
                             "digests")
        if model_args is not None:  # what transformers makes with no arguments is never a model's
            self.gpt_config()  # refused here, at load, in one line
            for name, value in sizes.items():
                if value != getattr(self, name):
                    raise ValueError(f"config.json: {name}={value!r} where model_args make it "
                                     f"{getattr(self, name)!r}")
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def to_dict(self):
        """transformers' record of the config, and the standard sizes (SIZES) that model_args make, which
        tools read from it (PEFT's prompt tuning: hidden_size, num_hidden_layers, num_attention_heads)."""
        record = super().to_dict()
        return {**record, **{name: getattr(self, name) for name in SIZES}} if self.model_args else record

    def gpt_config(self):
        """model.GPTConfig of model_args, or a ValueError naming the field of config.json that cannot be."""
        args = self.model_args
        if not isinstance(args, dict):
            raise ValueError(f"config.json: model_args={args!r}: must be GPTConfig's fields")
        names = [field.name for field in fields(GPTConfig)]
        missing, unknown = [n for n in names if n not in args], [n for n in args if n not in names]
        if missing or unknown:
            which = f"model_args.{(missing or unknown)[0]}"
            raise ValueError(f"config.json: {which}: {'missing' if missing else 'not a field of GPTConfig'}")
        if self.variant is not None:
            if not re.fullmatch(r"\w+\.\w+", str(self.variant)):
                raise ValueError(f"config.json: variant={self.variant!r}: must be a file's name, a class's")
            model.VARIANTS[args["attn"]] = model.LIB + self.variant
        try:
            config = GPTConfig(**args)
        except ValueError as e:
            raise ValueError(f"config.json: model_args.{str(e).removeprefix('--')}") from None
        if type(self.eot_id) is not int or not 0 <= self.eot_id < config.vocab_size:
            raise ValueError(f"config.json: eot_id={self.eot_id!r}: must be a token id below vocab_size")
        return config

    # the names transformers, PEFT and lm-evaluation-harness read (SIZES); max_position_embeddings: the
    # tokens a sequence may hold, block_size less the end-of-text it is read after
    vocab_size = model_arg("vocab_size", settable=True)  # resize_token_embeddings sets it
    hidden_size = model_arg("n_embd")
    num_hidden_layers = model_arg("n_layer")
    num_attention_heads = model_arg("n_head")
    max_position_embeddings = model_arg("block_size", less=1)


SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")


class LRKVTokenizer(PreTrainedTokenizerFast):
    """The folder's tokenizer.json as transformers' fast tokenizer, AutoTokenizer's class with
    trust_remote_code=True (tokenizer_config.json's auto_map): a class of this file, so that a transformers
    too old for the model stops at the tokenizer too, in check_transformers' line."""


class PaddedRingKVCache(RingKVCache):
    """ring.RingKVCache with a position per row and column (its row_positions): columns are what
    transformers counts (a pad takes one), positions what RoPE and windows count (a row's real tokens
    before it), a pad's negative, its own, so that ring.visible shows it to no other token. A layer
    whose readers all have a window W keeps W + pads columns, pads the most any row of the prompt has: a
    row's pads lie between its end-of-text (column 0) and its text, so that its last W positions span W
    columns and its pads. Its buffers grow with the columns held, to that at most: the bytes of the
    columns held. real (B, T): the prompt's tokens, not its pads; None: no pad."""

    def __init__(self, gpt, batch_size, dtype, device, real=None):
        self.real = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # (B, columns): not a pad
        self.pads = 0  # until the spans are known (allocate's buffers are empty, whatever the length)
        super().__init__(gpt, batch_size, gpt.config.block_size, dtype, device)
        if real is not None and self.rings():  # a .item(), a break in a compiled forward: only where needed
            self.pads = int((~real).sum(-1).max())

    def rings(self):
        """Whether a layer keeps fewer than max_len columns (all its readers have windows)."""
        return any(span < self.max_len for span in self.span.values())

    def length(self, layer):
        span = super().length(layer)
        return span if span in (0, self.max_len) else min(span + self.pads, self.max_len)

    def allocate(self, shapes, length, device):  # empty; store grows them
        return {name: torch.zeros(self.batch_size, 0, *shape, dtype=self.dtype, device=device)
                for name, shape in shapes.items()}

    def store(self, layer, slots, entries):
        # the slots reach pos + T - 1 (T: the entries' positions), or the ring's last: counted, not read off
        # slots, so that a compiled forward has no .item()
        needed = min(self.pos + next(iter(entries.values())).size(1), self.length(layer))
        for name, buf in self.layers[layer].items():
            if buf.size(1) < needed:
                self.layers[layer][name] = torch.cat((buf, buf.new_zeros(buf.size(0), needed - buf.size(1),
                                                                         *buf.shape[2:])), 1)
        super().store(layer, slots, entries)

    def columns(self, real):
        """The columns so far and the T a forward brings, real (B, pos + T): positions from them, a pad's
        -1 - its column."""
        self.real = real
        pads = -1 - torch.arange(real.size(1), device=real.device)
        self.positions = torch.where(real, real.long().cumsum(-1) - 1, pads)  # (B, pos + T)

    def row_positions(self, columns):
        return self.positions[:, columns.to(self.positions.device)]

    def select(self, rows):
        """Keep rows (an index tensor) of every buffer, in their order."""
        for layer in self.layers:
            for name, buf in layer.items():
                layer[name] = buf[rows]
        self.real, self.positions, self.batch_size = self.real[rows], self.positions[rows], len(rows)


class LRKVCache(Cache):
    """transformers' Cache over a PaddedRingKVCache, made on the first forward (whose batch it takes),
    which also reads the end-of-text that every sequence starts after."""

    def __init__(self):
        super().__init__(layers=[])
        self.ring = None

    def start(self, gpt, tokens, real, eot_id, padded):
        """The ring, its first column end-of-text, real in rows read after it (after_eot). padded: whether
        real may hold a pad (an attention mask was given)."""
        self.ring = PaddedRingKVCache(gpt, real.size(0), gpt.wte.weight.dtype, real.device,
                                      real if padded else None)
        self.ring.columns(after_eot(tokens, real, eot_id))
        gpt(torch.full_like(real[:, :1], eot_id, dtype=torch.long), cache=self.ring)

    def get_seq_length(self, layer_idx=0):
        return 0 if self.ring is None else self.ring.pos - 1

    def get_max_length(self, layer_idx=None):
        return -1 if self.ring is None else self.ring.max_len - 1

    def get_mask_sizes(self, query_length, layer_idx=0):  # this model makes its own masks (PaddedRingKVCache)
        return self.get_seq_length() + query_length, 0

    @property
    def is_compileable(self):
        return False

    @property
    def is_initialized(self):
        return self.ring is not None

    @property
    def is_croppable(self):
        """A layer whose readers all have windows keeps only their last W positions: what crop drops
        cannot come back once the ring has gone round."""
        return self.ring is None or not self.ring.rings()

    def crop(self, tokens):
        """Drop the newest -tokens positions (tokens < 0), or keep the first `tokens` (> 0, transformers
        before 5.20)."""
        if self.ring is None or tokens == 0:
            return
        keep = 1 + (tokens if tokens > 0 else self.get_seq_length() + tokens)
        if keep < self.ring.pos and not self.is_croppable:
            raise ValueError("this model's sliding windows keep only their last positions: its cache cannot "
                             "be cropped (assisted and prompt-lookup decoding need that)")
        self.ring.pos = min(keep, self.ring.pos)
        self.ring.real, self.ring.positions = self.ring.real[:, :keep], self.ring.positions[:, :keep]

    def reorder_cache(self, beam_idx):
        if self.ring is not None:
            self.ring.select(beam_idx.to(self.ring.real.device))

    def batch_select_indices(self, indices):
        self.reorder_cache(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats):
        if self.ring is not None:
            rows = torch.arange(self.ring.batch_size, device=self.ring.real.device)
            self.ring.select(rows.repeat_interleave(repeats))

    def reset(self):
        self.ring = None


@dataclass
class LRKVModelOutput(ModelOutput):
    """AutoModel's forward, under the names of every transformers 5: the cache as `cache` (5.24 on) and as
    `past_key_values` (before); return_dict=False gives its tuple, the cache once."""
    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple | None = None


@dataclass
class LRKVCausalLMOutput(ModelOutput):
    """AutoModelForCausalLM's forward: the loss first, where Trainer looks for it (out["loss"], out[0])."""
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple | None = None


def as_returned(output, return_dict, config):
    """output, or with return_dict=False (config.return_dict where None) its tuple, as transformers' own
    models give it: the fields that are not None, in order, the cache once (as past_key_values)."""
    if (config.return_dict if return_dict is None else return_dict):
        return output
    return tuple(value for name, value in output.items() if name != "cache")


class LRKVPreTrainedModel(PreTrainedModel):
    config_class = LRKVConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # GPT attends through F.scaled_dot_product_attention, whatever was asked
    _no_split_modules = ["Block"]
    # a batch's loss is the mean over its labels, on every release: Trainer gives no num_items_in_batch
    # (5.0's counts each row's first label, which no prediction scores)
    accepts_loss_kwargs = False

    def _init_weights(self, module):
        """The weights come from model.safetensors; the RoPE table, which no file holds, is GPT's own."""
        if isinstance(module, GPT):
            c = module.config
            module.rope.copy_(model.rope_table(module.blocks[0].attn.rope_dim, c.block_size, c.rope_theta))

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate's cache is an LRKVCache (_prepare_cache_for_generation)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """An empty LRKVCache, which the first forward fills, unless one was given or none is used; a
        ValueError of one line for a cache_implementation other than this growing one ("dynamic", or
        "dynamic_full", which transformers 5.0 asks for assisted decoding)."""
        asked = generation_config.cache_implementation
        if asked not in (None, "dynamic", "dynamic_full"):
            raise ValueError(f"this model caches with its own LRKVCache, which grows with the sequence: "
                             f"cache_implementation={asked!r} cannot be honoured; give none")
        if generation_config.use_cache is not False and model_kwargs.get(CACHE) is None:
            model_kwargs[CACHE] = LRKVCache()

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        """SDPA, the attention model.py computes (F.scaled_dot_product_attention), where none or "sdpa" is
        asked; a ValueError of one line for any other attn_implementation, which it cannot honour."""
        if attn_implementation not in (None, "sdpa"):
            raise ValueError(f"this model attends through SDPA (model.py's F.scaled_dot_product_attention): "
                             f"attn_implementation={attn_implementation!r} cannot be honoured; give 'sdpa' "
                             "or none")
        return "sdpa"

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        """The one attention there is: "sdpa" keeps it, anything else is the ValueError of
        _check_and_adjust_attn_implementation."""
        self._check_and_adjust_attn_implementation(attn_implementation)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained, after checking that config.json describes model.safetensors'
        weights (a ValueError of one line naming the fields that shape the first that it does not)."""
        config = kwargs.get("config")
        where = {k: kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token") if k in kwargs}
        if not isinstance(config, LRKVConfig):
            config = LRKVConfig.from_pretrained(pretrained_model_name_or_path, **where)
        weights = cached_file(pretrained_model_name_or_path, "model.safetensors", **where)
        check_weights(config, weights)
        check_code(config, pretrained_model_name_or_path, where)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=checkpoint,
                                    every_n_layers=1):
        """What transformers' gradient_checkpointing_enable (activation_checkpointing_enable from 5.25), its
        disable and Trainer's gradient_checkpointing=True call: every every_n_layers-th block recomputed in
        the backward by gradient_checkpointing_func (torch.utils.checkpoint, non-reentrant unless asked),
        while the model trains with gradients; set from outside GPT, on its blocks."""
        for i, block in enumerate(self.gpt().blocks):
            block.__dict__.pop("forward", None)
            if enable and i % every_n_layers == 0:
                forward = type(block).forward.__get__(block)  # the class's, bound

                def checkpointed(*args, block=block, forward=forward):
                    if block.training and torch.is_grad_enabled():
                        return gradient_checkpointing_func(forward, *args)
                    return forward(*args)
                block.forward = checkpointed

    @property
    def gradient_checkpointing(self):
        """Whether a block is recomputed in the backward: transformers' is_gradient_checkpointing reads it."""
        return any("forward" in block.__dict__ for block in self.gpt().blocks)

    def checkpointing(self):
        """Whether this forward's blocks are recomputed in the backward, which a cache cannot live through
        (a block's recomputation would read the cache as the forward left it)."""
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def set_output_embeddings(self, value):  # resize_token_embeddings
        self.gpt().lm_head = value


def check_weights(config, path):
    """A ValueError where config's model_args are not those the safetensors file at path records (the
    export writes them), naming every field that differs, or where it records some of the export's records
    but not all, naming the first it lacks; or, a file recording none, where it holds
    another set of tensors, or of shapes, than the model of model_args, naming the fields that shape the
    first that differs."""
    with safetensors.safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
        theirs = {name.removeprefix("model.gpt_model."): list(f.get_slice(name).get_shape())
                  for name in f.keys()}
    # the export records all three; transformers' save_pretrained none
    lacking = [field for field in ("model_args", "model_args_sha256", "code_sha256") if field not in metadata]
    if 0 < len(lacking) < 3:
        raise ValueError(f"model.safetensors: its metadata has no {lacking[0]}, which the export records "
                         "beside the others it has: edited")
    exported, code = recorded(metadata, "model_args"), recorded(metadata, "code_sha256")
    digest = metadata.get("model_args_sha256")
    if digest is not None and sha256(metadata["model_args"].encode()) != digest:
        raise ValueError("model.safetensors: its metadata model_args is not the record the export wrote (its "
                         "SHA-256 is not model_args_sha256's): edited")
    args = config.model_args
    differ = [f"model_args.{field}={args.get(field)!r} where the weights were exported with {value!r}"
              for field, value in (exported or {}).items() if args.get(field) != value]
    if code is not None and config.code_sha256 != code:
        differ.append("code_sha256 where the weights were exported with other code files' digests")
    if differ:
        raise ValueError(f"config.json: {', '.join(differ)} (model.safetensors): another model")
    with torch.device("meta"):
        ours = {name: list(p.shape) for name, p in GPT(config.gpt_config()).state_dict().items()}
    for name in sorted(set(ours) | set(theirs), key=lambda name: (name not in ours, name)):
        if ours.get(name) != theirs.get(name):
            held = tuple(theirs[name]) if name in theirs else "no such tensor"
            made = tuple(ours[name]) if name in ours else "no such tensor"
            fields_ = ", ".join(shaping_fields(config.model_args, name, made))
            raise ValueError(f"config.json: model_args {fields_} make {name} {made}, model.safetensors "
                             f"holds {held}")


def recorded(metadata, field):
    """The JSON object that model.safetensors' metadata records under field (None where it records none,
    as a file that transformers' save_pretrained wrote), or a ValueError of one line naming the file and
    field."""
    if field not in metadata:
        return None
    try:
        value = json.loads(metadata[field])
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"model.safetensors: its metadata {field} is not the JSON object the export writes: "
                         f"{metadata[field][:60]!r}")
    return value


def sha256(data):
    """The SHA-256 of bytes, in hex: the export's record of the folder's code and of its model_args."""
    return hashlib.sha256(data).hexdigest()


def check_code(config, folder, where):
    """A ValueError of one line naming the first code file of folder whose SHA-256 is not config.json's
    code_sha256 (the export's record, which model.safetensors' metadata holds too): the folder runs the code
    the export wrote, or says which file differs."""
    for name, digest in sorted((config.code_sha256 or {}).items()):
        with open(cached_file(folder, name, **where), "rb") as f:
            if sha256(f.read()) != digest:
                raise ValueError(f"{name}: not the file the export wrote (its SHA-256 is not config.json's "
                                 "code_sha256): this folder's code was edited")


def shaping_fields(args, name, shape):
    """The integer fields of args some change of which (up or down, n_embd following n_head * head_dim)
    changes the shape of the model's tensor name, or whether it is there at all."""
    found = []
    for field, value in args.items():
        if type(value) is not int or field in ("block_size", "n_embd"):
            continue
        for other in (value + 1, 2 * value, value - 1, value // 2):
            trial = {**args, field: other}
            trial["n_embd"] = trial["n_head"] * trial["head_dim"]
            trial["cla"] = trial["cla"] if trial["n_layer"] % trial["cla"] == 0 else 1
            try:
                with torch.device("meta"):
                    tensor = GPT(GPTConfig(**trial)).state_dict().get(name)
            except (ValueError, RuntimeError):
                continue
            if (tuple(tensor.shape) if tensor is not None else "no such tensor") != shape:
                found.append(field)
                break
    return found or ["(all of them)"]


class LRKVModel(LRKVPreTrainedModel):
    """The repository's GPT (model.py), read after an end-of-text, with its hidden states: AutoModel."""

    def __init__(self, config):
        super().__init__(config)
        self.gpt_model = GPT(config.gpt_config())
        self.post_init()

    def gpt(self):
        return self.gpt_model

    def get_input_embeddings(self):
        return self.gpt_model.wte

    def set_input_embeddings(self, value):
        self.gpt_model.wte = value

    def get_output_embeddings(self):
        return self.gpt_model.lm_head

    def forward(self, input_ids=None, attention_mask=None, cache=None, past_key_values=None, use_cache=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """The final hidden states (B, T, d) of the T tokens (input_ids, or inputs_embeds) (norm(x), what
        lm_head reads), and every block's (output_hidden_states), after the cache's positions: read's."""
        _, final, hidden, cache = self.read(input_ids, attention_mask, cache, past_key_values, use_cache,
                                            output_hidden_states, kwargs, final=True)
        return as_returned(LRKVModelOutput(last_hidden_state=final, cache=cache, past_key_values=cache,
                                           hidden_states=hidden), return_dict, self.config)

    def read(self, input_ids, attention_mask, cache, past_key_values, use_cache, output_hidden_states,
             kwargs, final=False):
        """GPT's logits (B, T, vocab), final hidden states (B, T, d; with final, else None), every block's
        (output_hidden_states, else None) of T tokens after the cache's positions, and the cache that holds
        them too (with use_cache; by default not while the model trains, as transformers' own models). The
        tokens: input_ids (B, T), or kwargs' inputs_embeds (B, T, d), wte's outputs (tokens_of).
        attention_mask (B, S), S the cached tokens and these T, 0 a pad; position_ids, which transformers
        passes, are recomputed from it. kwargs: what else was passed, refused unless it asks nothing."""
        tokens = tokens_of(input_ids, kwargs)
        gpt, config = self.gpt_model, self.config
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, LRKVCache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"this model caches with an LRKVCache, not a {type(cache).__name__}")
            cache = None
        use_cache = config.use_cache and not self.training if use_cache is None else use_cache
        if self.checkpointing() and (use_cache or cache is not None):
            if cache is not None and cache.ring is not None:
                raise ValueError("under gradient checkpointing, each block is recomputed in the backward, "
                                 "which a filled cache cannot be: pass no cache, or call "
                                 "gradient_checkpointing_disable()")
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing: no cache is "
                                "kept")
            use_cache, cache = False, None
        if output_hidden_states is None:
            output_hidden_states = getattr(config, "output_hidden_states", False)
        B, T = tokens.shape[:2]
        past, padded = 0 if cache is None else cache.get_seq_length(), attention_mask is not None
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long, device=tokens.device)
        if tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: it must be (batch, "
                             f"cached + new tokens) = ({B}, {past + T}), 1 for a token and 0 for a pad")
        real, eot = attention_mask.bool(), config.eot_id
        if T > gpt.config.block_size - (past + 1):
            raise too_long(gpt.config.block_size, past + T)
        hooked = final or output_hidden_states  # what run hooks to give
        if cache is None and not use_cache:  # training's path
            return (*read_rows_alone(gpt, tokens, real, eot, output_hidden_states, hooked), None)
        cache = cache if cache is not None else LRKVCache()
        if cache.ring is None:
            cache.start(gpt, tokens, real, eot, padded)
        cache.ring.columns(torch.cat((cache.ring.real[:, :1], real), 1))
        logits, final, hidden = run(gpt, tokens, cache.ring, output_hidden_states, hooked)
        return logits, final, hidden or None, cache if use_cache else None


def too_long(block_size, given):
    """The ValueError of one line for a sequence of `given` tokens past the context."""
    return ValueError(f"a sequence holds at most {block_size - 1} tokens (block_size {block_size}, one of "
                      f"them the end-of-text it is read after), {given} were given")


IGNORED = ("position_ids", "cache_position")  # what generate passes: positions come from the attention mask


def tokens_of(input_ids, kwargs):
    """What a forward reads: input_ids (B, T), or inputs_embeds (B, T, d) (kwargs'), the embeddings wte
    gives, as PEFT's prompt tuning gives them with its virtual tokens'; a ValueError of one line for
    both or neither, for output_attentions (SDPA keeps no attention weights), or for any other argument
    that asks something (not None, not False)."""
    embeds = kwargs.pop("inputs_embeds", None)
    if (input_ids is None) == (embeds is None):
        raise ValueError("this model takes input_ids or inputs_embeds, one of the two")
    if kwargs.get("output_attentions"):
        raise ValueError("this model gives no attention weights (output_attentions=True): it attends through "
                         "SDPA, which keeps none")
    asked = [name for name, value in kwargs.items()
             if name not in IGNORED and value is not None and value is not False]
    if asked:
        raise ValueError(f"this model takes no {asked[0]}")
    return input_ids if embeds is None else embeds


def after_eot(tokens, real, eot):
    """(B, 1): which rows are read after an end-of-text put before them: a row of ids whose first real
    token (real (B, T): not a pad) is not end-of-text, and every row of embeddings."""
    if tokens.is_floating_point():
        return torch.ones_like(real[:, :1])
    return tokens.gather(1, real.long().argmax(-1, keepdim=True)) != eot  # a row's first real token


def take(x, index):
    """x (B, N, ...) at index (B, M) along its columns: (B, M, ...)."""
    B, M = index.shape
    return x.gather(1, index.view(B, M, *[1] * (x.dim() - 2)).expand(B, M, *x.shape[2:]))


def read_rows_alone(gpt, tokens, real, eot, output_hidden_states, hooked):
    """GPT's training forward (no cache) of every row's tokens (real, (B, T): not a pad) after an end-of-text,
    put before the rows after_eot names: run's outputs in the tokens' columns. A row's columns it does not
    read (pads, the end-of-text put before a row that starts with one) move after those it reads, where
    causal attention hides them, so that its positions are its tokens' count; a pad's outputs are those of
    the last token read before it, a left pad's the end-of-text's: so the column before a left-padded row's
    first token predicts it, as the end-of-text does. Every shape is the tokens' and one more column, none
    read off the mask: a compiled forward has no .item()."""
    B, T = real.shape
    read = torch.cat((after_eot(tokens, real, eot), real), 1)  # (B, 1 + T): which of [eot, tokens] it reads
    eots = torch.full_like(real[:, :1], eot, dtype=torch.long)  # (B, 1)
    x = torch.cat((gpt.wte(eots) if tokens.is_floating_point() else eots, tokens), 1)  # (B, 1 + T[, d])
    order = torch.sort((~read).long(), dim=1, stable=True).indices  # (B, 1 + T): the columns read, first
    logits, final, hidden = run(gpt, take(x, order), None, output_hidden_states, hooked)
    place = (read.long().cumsum(-1) - 1).clamp(min=0)[:, 1:]  # (B, T): each column's place in its row read
    return (take(logits, place), None if final is None else take(final, place),
            tuple(take(h, place) for h in hidden) or None)


def run(gpt, tokens, ring, output_hidden_states, hooked):
    """GPT's forward of tokens, ids (B, T) or embeddings (B, T, d) that stand for wte's outputs (through
    the ring, if any): its logits, and where hooked the final hidden states (lm_head's input; else None)
    and, if asked, every block's input and the final hidden states. Hooks only where asked: registering one
    breaks a compiled forward's graph."""
    hidden, final, hooks, idx = [], [], [], tokens
    if tokens.is_floating_point():
        idx = torch.zeros(tokens.shape[:2], dtype=torch.long, device=tokens.device)
        hooks.append(gpt.wte.register_forward_hook(lambda m, args, out: tokens.to(out.dtype)))
    if hooked:
        hooks.append(gpt.lm_head.register_forward_pre_hook(lambda m, args: final.append(args[0])))
    if output_hidden_states:
        hooks += [block.register_forward_pre_hook(lambda m, args: hidden.append(args[0]))
                  for block in gpt.blocks]
    try:
        logits = gpt(idx, cache=ring)[0]
    finally:
        for hook in hooks:
            hook.remove()
    hidden = tuple(hidden[:len(gpt.blocks)]) + tuple(final) if output_hidden_states else ()
    return logits, final[0] if final else None, hidden


class LRKVForCausalLM(LRKVPreTrainedModel, GenerationMixin):
    """LRKVModel's logits (model.py's: lm_head of the final hidden states, fp32): AutoModelForCausalLM."""

    def __init__(self, config):
        super().__init__(config)
        self.model = LRKVModel(config)
        self.post_init()

    def gpt(self):
        return self.model.gpt_model

    def get_input_embeddings(self):
        return self.model.gpt_model.wte

    def set_input_embeddings(self, value):
        self.model.gpt_model.wte = value

    def get_output_embeddings(self):
        return self.model.gpt_model.lm_head

    def _prepare_generated_length(self, generation_config, **kwargs):
        """transformers' max_length, cut to the context with one warning line: the max_position_embeddings
        tokens a sequence holds (a prompt's pads and an inputs_embeds prompt counted) and the one they
        predict. generate stops there keeping every token it made, as at any max_length; model.generate and
        sample.py slide past it instead, restarting the cache from the last tokens, which generate's one
        cache a call cannot. A prompt longer than the context is refused, before any work, in the forward's
        line (too_long)."""
        generation_config = super()._prepare_generated_length(generation_config, **kwargs)
        embedded = kwargs["inputs_tensor"].shape[1] - kwargs["input_ids_length"] \
            if kwargs["model_input_name"] == "inputs_embeds" else 0  # prompt columns not in input_ids
        context = self.config.max_position_embeddings + 1
        if kwargs["input_ids_length"] + embedded >= context:
            raise too_long(context, kwargs["input_ids_length"] + embedded)
        if generation_config.max_length + embedded > context:
            logger.warning(f"generate stops at the model's context: {context} tokens, the prompt's included "
                           f"(its {context - 1} and the one they predict), not the "
                           f"{generation_config.max_length + embedded} asked")
            generation_config.max_length = context - embedded
        return generation_config

    def _get_candidate_generator(self, generation_config, *args, **kwargs):
        """transformers' guesser for prompt lookup and assisted decoding, its guesses cut to the context: the
        tokens so far and the guesses at most max_length - 1 (_prepare_generated_length's, the tokens a
        sequence holds), as prompt lookup's are not (transformers caps them by the tokens so far alone), so
        that generate stops at the context there too, rather than in the forward's refusal."""
        guesser = super()._get_candidate_generator(generation_config, *args, **kwargs)
        guess, most = guesser.get_candidates, generation_config.max_length - 1

        def get_candidates(input_ids, *args, **kwargs):
            ids, logits = guess(input_ids, *args, **kwargs)  # (B, S + guesses), (B, guesses, vocab) or None
            keep = max(most, input_ids.size(1))
            return ids[:, :keep], None if logits is None else logits[:, :keep - input_ids.size(1)]
        guesser.get_candidates = get_candidates
        return guesser

    def forward(self, input_ids=None, attention_mask=None, cache=None, past_key_values=None, labels=None,
                use_cache=None, output_hidden_states=None, return_dict=None, num_items_in_batch=None,
                **kwargs):
        """LRKVModel.read's logits (B, T, vocab), cache and hidden states; labels (B, T): the loss of
        predicting each token from those before it (-100: none; a pad's label should be), as transformers
        shifts them: their mean, or their sum over num_items_in_batch where a caller gives it (Trainer does
        not)."""
        logits, _, hidden, cache = self.model.read(input_ids, attention_mask, cache, past_key_values,
                                                   use_cache, output_hidden_states, kwargs)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size,
                                                              num_items_in_batch=num_items_in_batch)
        return as_returned(LRKVCausalLMOutput(loss=loss, logits=logits, cache=cache, past_key_values=cache,
                                              hidden_states=hidden), return_dict, self.config)
