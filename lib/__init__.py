"""
What the top-level scripts (train.py, sample.py, analyze.py, eval.py, prepare_data.py) are built from,
beside model.py's math: variants.py, every variant by its --attn name; rivals.py, GTA, GLA, TPA
and MLRA; decode.py, decoding fast; muon.py, the optimiser; parallel.py, DDP and FSDP2 from
outside the model; convert.py, one variant's weights to another's; diversity.py, the effective
rank; checkpoint.py, what a run writes; configurator.py, flags and presets; hardware.py, the
device and the precision policy; downstream.py, the downstream tasks that eval.py and train.py
--eval_tasks score.
"""
