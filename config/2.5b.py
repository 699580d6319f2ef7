# The paper's "2.5B" row of Table 1 (paper.md section 2): 36 layers, 18 heads of 128 (width 2304),
# GQA with 6 KV heads, MLA with a latent of 384, LRKV with r = 55 (its cache 1/18 + 55/128 =
# 48.5% of MHA's). The paper's table says 18 layers and its figures show 36: 36 counts 2.53B for
# MHA (GPT.get_num_params()), the name, where 18 would count 1.38B (docs/scaling.md, "The presets").
# Training: the paper's recipe (train.py's defaults) for 50B tokens; `python -m tools.plan config/2.5b.py`.
n_layer = 36
n_head = 18
n_embd = 2304
n_kv_head = 6
gta_kv_heads = 6  # GTA (lib/attention/rivals.py) with GQA's G
kv_lora_rank = 384
lrkv_rank = 55
max_steps = 1_525_879  # 50B tokens / 32,768 tokens a step
