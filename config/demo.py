# The CPU demo: the 128M model's shape scaled down to 6 heads of 32 dims (n_embd 192) and 4 layers,
# trained on the byte-level Python docs (`python prepare_data.py --dataset=pydocs --tokenizer=byte`),
# about a minute a variant on two cores. Ranks scale with the head dim, 128 -> 32: LRKV's r = 46
# becomes 12 (the figures' r = 16 and 64 become --lrkv_rank=4 and 16), MLA's d_c = 128 becomes 32
# and its RoPE key d_R = 64 becomes 16. Give each variant its own --out_dir.
data_dir = "data/pydocs-byte"
out_dir = "out/demo"
vocab_size = 256
block_size = 256
n_layer = 4
n_head = 6
head_dim = 32
n_embd = 192
n_kv_head = 3
kv_lora_rank = 32
rope_head_dim = 16
lrkv_rank = 12

batch_size = 8
micro_batch_size = 8
max_steps = 180
warmup_steps = 18
# Twice the paper's lrs: at this width and a 2,048-token batch they trained better (MHA, 180 steps:
# val loss 1.78 against 1.99), and 2 is nanochat's (n_embd / 768) ** -0.5 for the AdamW lrs.
muon_lr = 0.04
embedding_lr = 0.4
unembedding_lr = 0.008
eval_interval = max_steps  # one evaluation, at the end
eval_tokens = 64 * 256  # the pydocs val split holds ~21.6k tokens (Python 3.11); other Pythons ship other docs
log_interval = 20
