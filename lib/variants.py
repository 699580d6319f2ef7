"""
Every attention variant by the name that --attn takes, and the config that builds any of them.
A variant of your own can live here too, beside its name (README: Adding a variant).
"""

from dataclasses import dataclass

from lib.rivals import (GroupedLatentAttention, GroupedTiedAttention, MultiHeadLowRankAttention, RivalKnobs,
                        TensorProductAttention)
from model import (GPTConfig, GroupedQueryAttention, LowRankKVAttention, MultiHeadAttention,
                   MultiHeadLatentAttention, MultiQueryAttention)

ATTENTION = {
    # the paper's five (model.py)
    "mha": MultiHeadAttention,
    "mqa": MultiQueryAttention,
    "gqa": GroupedQueryAttention,
    "mla": MultiHeadLatentAttention,
    "lrkv": LowRankKVAttention,
    # the field's rivals (lib/rivals.py)
    "gta": GroupedTiedAttention,
    "gla": GroupedLatentAttention,
    "tpa": TensorProductAttention,
    "mlra": MultiHeadLowRankAttention,
}


@dataclass
class ModelConfig(RivalKnobs, GPTConfig):
    """GPTConfig and the rivals' knobs: what train.py's flags, presets and a checkpoint's model_args make."""
