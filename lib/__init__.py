"""
What the top-level scripts (train.py, sample.py, analyze.py, prepare_data.py) are built from,
beside model.py's math: decode.py, decoding fast; muon.py, the optimiser; parallel.py, DDP and
FSDP2 from outside the model; convert.py, one variant's weights to another's; diversity.py, the
effective rank; checkpoint.py, what a run writes; configurator.py, flags and presets;
hardware.py, the device and the precision policy.
"""

# The rivals of LRKV (GTA, GLA, TPA, MLRA) register themselves into model.ATTENTION: importing them
# here, where every script and test first meets lib, makes --attn=gta etc. known everywhere, while
# model.py stays the paper's five (it cannot import them: rivals.py builds on it and on decode.py)
from lib import rivals  # noqa: E402,F401
