# The tiny GPT-MoE that the CPU launch scripts train (sourced by run_*_cpu.sh): a byte-level
# model small enough that 4 ranks on a 2-core machine train it for a few minutes and the loss
# visibly drops. Override any flag by passing it again to the run script (the last one wins).
TINY_MODEL_FLAGS=(
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256
    --seq-length 128 --max-position-embeddings 128
    --train-iters 400 --eval-interval 100 --eval-iters 4 --log-interval 25 --seed 1234
    --untie-embeddings-and-output-weights
)
# Untied: this byte-level model reaches validation 2.36 at step 400 with an output layer of its own,
# 2.53 with it tied to the word embedding (the example's default, Megatron-LM's), one run each.
