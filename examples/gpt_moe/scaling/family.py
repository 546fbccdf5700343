"""The models of the scaling study: one dense GPT and MoE GPTs with the same active parameters.

    sizes = SIZES["full"]                     # or SIZES["quick"]
    for model in family(sizes):               # dense, e4-top2, ..., e32-top1
        ds_config(model, sizes, ranks=4)      # the DeepSpeed JSON with its "moe" block
        model_flags(model, sizes)             # the Megatron flags of pretrain_gpt_moe.py

Same compute per token: the dense model's MLP has FFN size f; an MoE MLP with top-k routing
gives each expert f / k, so the k experts a token visits do the dense MLP's multiply-adds (plus
the router's h x E, under 1% here). More experts add parameters, not compute per token. The MoE
MLP replaces the dense one on every ``moe_layer_interval``-th layer (GShard: every other layer).
Top-2 uses the ``gshard`` router (normalised gates, random routing of the second expert), top-1
the ``switch`` router: the two published recipes. Every model sees the same global batches in the
same order (same seed), for the same number of steps: the same token budget.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """What every model of the family shares."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int          # the dense MLP's; experts get ffn_hidden_size // top_k
    seq_length: int
    micro_batch_size: int         # per rank; global batch = micro x ranks
    train_iters: int
    eval_interval: int
    eval_iters: int
    log_interval: int
    lr: float
    warmup_steps: int
    corpus_bytes: int
    valid_fraction: float
    experts: tuple[int, ...] = (4, 8, 16, 32)
    top_ks: tuple[int, ...] = (2, 1)
    moe_layer_interval: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    aux_loss_coeff: float = 0.01
    seed: int = 1234


SIZES = {
    # The study: nine models, 2.5 to 4.5 minutes each on 4 CPU ranks of a 2-core machine (38 min in all).
    "full": Sizes(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=128,
                  micro_batch_size=4, train_iters=1000, eval_interval=100, eval_iters=8, log_interval=50,
                  lr=2e-3, warmup_steps=50, corpus_bytes=4 << 20, valid_fraction=0.05),
    # CI: the same nine models, tiny, a few steps each; checks the machinery, not the claims.
    "quick": Sizes(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, seq_length=32,
                   micro_batch_size=2, train_iters=24, eval_interval=8, eval_iters=1, log_interval=8,
                   lr=5e-3, warmup_steps=4, corpus_bytes=256 << 10, valid_fraction=0.25),
}


@dataclass(frozen=True)
class Model:
    """One member: ``experts`` 0 is the dense model."""

    experts: int = 0
    top_k: int = 0

    @property
    def name(self) -> str:
        return "dense" if not self.experts else f"e{self.experts}-top{self.top_k}"

    @property
    def dense(self) -> bool:
        return not self.experts


def family(sizes: Sizes) -> list[Model]:
    """Dense first, then by top-k (2, 1) and number of experts."""
    return [Model()] + [Model(e, k) for k in sizes.top_ks for e in sizes.experts]


def by_name(sizes: Sizes, names: list[str]) -> list[Model]:
    """The members called ``names`` (in family order); a ValueError names an unknown one."""
    members = {m.name: m for m in family(sizes)}
    unknown = [n for n in names if n not in members]
    if unknown:
        raise ValueError(f"--models: got {unknown[0]!r}; valid: {', '.join(members)}")
    return [m for m in family(sizes) if m.name in names]


def ds_config(model: Model, sizes: Sizes, ranks: int) -> dict:
    """The DeepSpeed JSON of ``model`` on ``ranks`` data-parallel ranks (ZeRO-1, AdamW). MoE
    models put one rank's share of the experts on each rank (expert parallelism = ranks, carved
    out of data parallelism); the dense model keeps its "moe" block only for the layout."""
    moe: dict = {"num_experts": max(ranks, 2), "parallel": {"expert": 1}}   # 2 at least: the default top-2
    if not model.dense:
        moe = {"num_experts": model.experts, "router": "gshard" if model.top_k == 2 else "switch",
               "top_k": model.top_k, "ffn_hidden_size": sizes.ffn_hidden_size // model.top_k,
               "capacity_factor": sizes.capacity_factor, "eval_capacity_factor": sizes.eval_capacity_factor,
               "min_capacity": 4, "aux_loss_coeff": sizes.aux_loss_coeff,
               "layer_interval": sizes.moe_layer_interval,
               "parallel": {"expert": min(ranks, model.experts)}}
    return {
        "train_batch_size": sizes.micro_batch_size * ranks,
        "train_micro_batch_size_per_gpu": sizes.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": sizes.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": sizes.lr,
                                                     "warmup_num_steps": sizes.warmup_steps}},
        "zero_optimization": {"stage": 1},
        "moe": moe,
    }


def model_flags(model: Model, sizes: Sizes) -> list[str]:
    """``pretrain_gpt_moe.py``'s model and training flags for ``model``."""
    flags = ["--num-layers", sizes.num_layers, "--hidden-size", sizes.hidden_size,
             "--num-attention-heads", sizes.num_attention_heads, "--ffn-hidden-size", sizes.ffn_hidden_size,
             "--seq-length", sizes.seq_length, "--max-position-embeddings", sizes.seq_length,
             "--micro-batch-size", sizes.micro_batch_size, "--train-iters", sizes.train_iters,
             "--eval-interval", sizes.eval_interval, "--eval-iters", sizes.eval_iters,
             "--log-interval", sizes.log_interval, "--seed", sizes.seed, "--corpus-bytes", sizes.corpus_bytes,
             "--valid-fraction", sizes.valid_fraction, "--untie-embeddings-and-output-weights"]   # as the results
    return [str(f) for f in flags] + (["--dense"] if model.dense else [])
