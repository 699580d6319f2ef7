# Uptraining a converted model (train.py --init_from=CKPT), after config/demo.py: 60 steps, 10% of
# the demo's 600, on the demo's data, batch and evaluation slice. The demo's schedule ended at lr 0,
# at a minimum that a restart at its peak lrs would knock the model off; so the peaks are a tenth
# of the demo's, warmed up over 6 steps while the fresh optimizer states fill, then decayed to 0
# (train.py's lr_multiplier, the one place that says the schedule's shape).
# Chosen on the MHA control alone (MHA uptrained from itself must end no worse than it started),
# before any converted run was looked at (docs/convert.md).
max_steps = 60
warmup_steps = 6
muon_lr = 0.004
embedding_lr = 0.04
unembedding_lr = 0.0008
eval_interval = 10
log_interval = 5
