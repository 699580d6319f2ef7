# The CPU demo: the 128M model's shape scaled down to 6 heads of 16 dims (n_embd 96) and 4 layers,
# trained on the byte-level Python docs (`python prepare_data.py --dataset=pydocs --tokenizer=byte`)
# for 600 steps of 8 x 128 tokens, about 50 s a variant on one core (`make demo` trains two at
# a time). 600 steps is what the paper's effect needs at this size: at 180 steps every variant's
# heads were still at their random start (effective rank 99-100% of H); at 600, MQA's first layer
# has collapsed to about 4 of 6 while MHA's stays near 6.
# Ranks keep the paper's ratios at the head dim of 16: LRKV's r = 46 of 128 becomes 6 (the
# figures' r = 16 and 64 become --lrkv_rank=2 and 8), MLA's d_c = 128 of d = 768 becomes 16, GQA
# keeps 3 of 6 KV heads. MLA's RoPE key is d_R = d_h = 16 rather than the 128M's d_h / 2: at
# d_R = 8 RoPE has 4 frequencies, too few to place bytes, and MLA trained far worse (docs/results.md).
data_dir = "data/pydocs-byte"
vocab_size = 256
block_size = 128
n_layer = 4
n_head = 6
head_dim = 16
n_embd = 96
n_kv_head = 3
kv_lora_rank = 16
rope_head_dim = 16
lrkv_rank = 6  # for --attn=lrkv by hand; make demo runs the figures' 2 and 8
# lib/attention/rivals.py's knobs at the same ratios (make demo-rivals): GTA keeps G = 3 tied heads
# (its RoPE half is d_h/2 = 8 by its paper), GLA-2 two latent heads of 2 d_h = 32, MLRA-4 four of
# d_h = 16, TPA its ranks
gta_kv_heads = 3
gla_latent_dim = 32
mlra_latent_dim = 16
tpa_q_rank = 6
tpa_kv_rank = 2

batch_size = 8
micro_batch_size = 8
max_steps = 600
warmup_steps = 30
# Twice the paper's lrs: at this width they train better (MHA, 180 steps of the earlier 192-wide
# demo: val loss 1.78 against 1.99), and 2 is nanochat's (n_embd / 768) ** -0.5 for the AdamW lrs
# at 192 wide.
muon_lr = 0.04
embedding_lr = 0.4
unembedding_lr = 0.008
eval_interval = 50  # often enough for analyze.py's loss curves
# fp32 even where the CPU has bf16 instructions: at 96 wide the casts cost more than bf16 saves (an
# AMX CPU, one thread: forward + backward 55 ms in fp32, 91 ms under bf16 autocast).
dtype = "float32"
# Muon's Newton-Schulz in fp32 too, so that the demo computes the same on every CPU: left to
# hardware.native_dtype it ran in bf16 on an AMX CPU, and MQA ended at 1.595 there against 1.609
# with fp32 (docs/results.md); config/demo_deep.py inherits it.
ns_dtype = "float32"
# the pydocs val split holds ~21.6k tokens (Python 3.11); other Pythons ship other docs
eval_tokens = 128 * 128
log_interval = 25
