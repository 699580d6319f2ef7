"""
Measuring and planning, run from the repository's root: `python -m tools.bench` (step and decode
times per variant), `python -m tools.plan` (what a run needs of each GPU), `tools/bench_gpu.sh`
(what a lent GPU runs), `python -m tools.loss_table` (its runs' losses at one step, beside the paper's).
"""
