"""
What the top-level scripts (train.py, sample.py, analyze.py, prepare_data.py) are built from,
beside model.py's math: decode.py, decoding fast; muon.py, the optimiser; parallel.py, DDP and
FSDP2 from outside the model; convert.py, one variant's weights to another's; diversity.py, the
effective rank; checkpoint.py, what a run writes; configurator.py, flags and presets;
hardware.py, the device and the precision policy; rivals.py, GTA, GLA, TPA and MLRA, the rivals of
LRKV, each a variant registered into model.ATTENTION.
"""

# The rivals of LRKV (GTA, GLA, TPA, MLRA) register themselves into model.ATTENTION when imported:
# here, where every script and test first meets lib, so that --attn=gta etc. is known everywhere. Not
# from model.py, which stays the paper's five: rivals.py imports decode.py, which imports model, so a
# last-line import in model.py would meet decode.py half-imported wherever decode.py comes first.
from lib import rivals  # noqa: F401
