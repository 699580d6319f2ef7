# The CPU demo at the paper's 12 layers, for `make demo-deep`: config/demo.py's model and recipe
# (6 heads of 16, 96 wide, 8 x 128 byte-level tokens a step), 12 layers deep, for as many steps as
# the six runs can take within 20 minutes on this 2-core machine. A preset on top of the demo's:
#   python train.py config/demo.py config/demo_deep.py --attn=mqa --out_dir=out/demo-deep/mqa
#
# Measured 2026-12-01 on this machine, its 2 cores shared with other jobs, one thread a run; a
# 4-layer demo MHA step took 163 ms beside one other job, as in `make demo`. A 12-layer step, ms:
# MHA 404, LRKV r=2 408, r=8 598, MQA 554, MLA 754, GQA 466 (40 steps each, noisy). At 450 steps the
# six, two at a time in make's order, take about 770 s, 870 s with 10 evaluations and start-up
# each; with the venv (70 s), the data and analyze.py and the samples (about 100 s): 17-18 minutes.
#
# Width: the demo's. 48 wide (heads of 8) stepped 32% faster (508 against 744 ms), too little to
# change what the steps do below, and at d_h = 8 RoPE has 4 frequencies (MLA trained far worse so,
# docs/results.md); keeping 96 leaves depth the only change from `make demo`.
#
# Steps: the criterion, fixed before the runs: a random 12-layer model's ranks (3 seeds) are MHA
# 5.997-5.999 and MQA 5.974-5.997 per layer; a layer has moved once it is 0.10 below its variant's
# lowest random value; a step count passes if it moves all of MQA's layers 4-11 and 4 of MHA's.
# One 500-step run each, checkpointed every 100 steps (seed 0), layers 4-11:
#   MQA: step 200 5.78-5.95, 400 5.71-5.95, 500 5.71-5.94: 6 of the 8 moved (layers 7 and 8 not);
#   MHA: 5.994-5.999 at every step: none moved; only layer 0 moved more than 0.01 (5.93 at 500).
# So no step count this budget affords passes. 450 are the most that keep ~10% of the 20 minutes
# in hand; steps 400-500 of a 500-step run moved every layer by 0.03 or less.
n_layer = 12
max_steps = 450
eval_interval = 50
