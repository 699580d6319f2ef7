# One GPU, about 10 minutes a variant on an H200: the paper's 128M model and batch (the defaults:
# 12 layers, 6 heads of 128, 16 x 2048 tokens a step, the paper's lrs), 8,000 steps = 262M tokens
# of FineWeb-Edu. bench.py measured 73 ms a step for MHA there, 85 for LRKV and 91 for MLA
# (docs/benchmarks.md), so MHA's run takes 10 minutes and MLA's 12, evaluations included.
#     python prepare_data.py --dataset=fineweb-edu --max_tokens=300000000
#     make gpu-demo        # the six runs of the paper's figures, then analyze.py
max_steps = 8_000
# The paper warms up over 2,000 of its 3M steps; a run of 8,000 cannot give a quarter of itself
# to it, and 3% is what the paper's recipe family (nanochat, modded-nanogpt) spends on short runs.
warmup_steps = 250
eval_interval = 500  # 16 points on analyze.py's loss curves
log_interval = 100
