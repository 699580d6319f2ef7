# The paper's "6.3B" row of Table 1 (paper.md section 2): 32 layers, 32 heads of 128 (width 4096),
# GQA with 2 KV heads, MLA with a latent of 1024, LRKV with r = 54 (its cache 1/32 + 54/128 = 45.3%
# of MHA's). GPT.get_num_params() counts 6.85B for MHA and 6.28B for LRKV (docs/scaling.md).
# Training: the paper's recipe (train.py's defaults) for 50B tokens. Whole fp32 weights, gradients,
# DDP's copy of them and Muon's state do not fit a GPU beside the activations: shard them with
# --fsdp; `python -m tools.plan config/6.3b.py` says what fits on your GPUs.
n_layer = 32
n_head = 32
n_embd = 4096
n_kv_head = 2
gta_kv_heads = 2  # GTA (lib/attention/rivals.py) with GQA's G
kv_lora_rank = 1024
lrkv_rank = 54
max_steps = 1_525_879  # 50B tokens / 32,768 tokens a step
