# The paper's "1.2B" row of Table 1 (paper.md section 2): 24 layers, 12 heads of 128 (width 1536),
# GQA with 4 KV heads, MLA with a latent of 256, LRKV with r = 51 (its cache 1/12 + 51/128 = 48.2%
# of MHA's, the paper's figure). GPT.get_num_params() counts 0.83B for MHA, not 1.2B: the shape is
# the paper's as it lists it, name aside (docs/scaling.md, "The presets").
# Training: the paper's recipe (train.py's defaults: 16 x 2048 tokens a step, Muon and AdamW at the
# paper's lrs, 2,000 warm-up steps, then train.py's lr_multiplier) for 50B tokens.
# `python -m tools.plan config/1.2b.py` says what fits on your GPUs.
n_layer = 24
n_head = 12
n_embd = 1536
n_kv_head = 4
gta_kv_heads = 4  # GTA (lib/attention/rivals.py) with GQA's G
kv_lora_rank = 256
lrkv_rank = 51
max_steps = 1_525_879  # 50B tokens / 32,768 tokens a step
