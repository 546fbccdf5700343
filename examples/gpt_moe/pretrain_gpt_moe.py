"""Train a Megatron-Core GPT whose MLPs are the plugin's MoE layers, driven by the DeepSpeed engine.

    deepspeed --num_gpus 4 examples/gpt_moe/pretrain_gpt_moe.py \\
        --deepspeed_config examples/gpt_moe/configs/tiny_cpu_4rank.json \\
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 \\
        --seq-length 128 --micro-batch-size 4 --train-iters 200 --eval-interval 50

The model flags are Megatron-LM's; the DeepSpeed JSON holds the batch sizes, optimizer,
ZeRO stage and the ``"moe"`` block (experts, router, parallel layout). The script, in order:

1. ``check_run``: flags, JSON, ``"moe"`` block, world size, MoE layers against ``--num-layers``
   and batch arithmetic are checked before any file, process group or model exists; a mistake
   exits with status 2 and one line, printed by rank 0 (``moe_plugin.report_error``).
2. ``build_data``: the training and validation samples (the embedded stdlib corpus, written to
   ``--data-cache`` on first use, or ``--data-path`` in Megatron's indexed format). Still before
   any process group: the ``.idx``/``.bin`` pair is checked against the sizes its index promises,
   and the data's largest token id against the vocabulary (``--vocab-size``).
3. ``moe_plugin.initialize(ds_config, model_provider)``: process groups for the layout, the
   ``GPTModel`` with ``gpt_moe_spec`` (its ``TransformerConfig`` from ``moe_plugin.transformer_config``,
   every weight from ``torch.manual_seed(--seed)``), dense/expert optimizer groups, the DeepSpeed
   engine; rank 0 prints what was built (``result.summary``, also in ``runs/<name>/run.json``). An
   error every rank raises alike (a ``ConfigError``, a model that does not fit the layout) is one
   line on rank 0 (``moe_plugin.report_error``).
4. ``train``: per step, the same global batch for every layout (``GlobalBatches``), this
   data-parallel rank's micro-batches through ``engine.forward / backward / step`` (DeepSpeed's
   gradient accumulation); validation every ``--eval-interval``; one line per ``--log-interval``
   on rank 0; ``runs/<name>/metrics.jsonl`` and, at the end, ``runs/<name>/metrics.png``.
   After every step ``result.guard`` (``moe_plugin.integration.guard``) checks the run: a
   non-finite gradient (fp32, bf16) or ``--max-skipped-steps`` fp16 steps skipped in a row stop it
   on every rank, rank 0 prints one line (the step, the first parameter with a non-finite
   gradient, the last checkpoint of ``--save``) and the exit status is 1; skipped steps are
   counted in the log line and ``metrics.jsonl``; a step 10x slower than the median is reported.
   A stalled rank ends in an error after ``--distributed-timeout-minutes``.
   ``--exit-signal-handler`` (SIGTERM, SIGUSR1) and ``--exit-duration-in-mins`` stop every rank after
   the same step (``moe_plugin.ExitRequest``): the step is saved to ``--save``, the status is 75.

With pipeline parallelism (``moe.parallel.pipeline`` > 1) the model is the same GPT cut into
stages (``moe_plugin.gpt_pipeline_module``), the engine is DeepSpeed's
``PipelineEngine``, and a step is one ``engine.train_batch`` over the same micro-batches: the
pipeline branch is ``gpt_pipeline_provider`` / ``pipeline_train_step`` / ``pipeline_evaluate``.
Checkpoints (``--save``/``--load``) go through ``moe_plugin.save_checkpoint`` / ``load_checkpoint`` (experts
saved by global id, dense weights and the optimizer state re-cut on load, so a run may resume under
another world size, TP, PP, EP or DP layout or ZeRO stage, Adam's moments included). ``--async-save``: the
state is copied to host memory at the save step and written in the background (``moe_plugin.poll_save``
after every step, ``wait_for_save`` before the run ends; a failure stops every rank at the same step).

Load-adaptive placement: when ``moe.placement.policy`` is not ``static`` or ``trace_file`` is set,
``moe_plugin.training_placement`` tracks the gate's load and, at the step
boundary after every step, checks / migrates experts (``runs/<name>/placement.jsonl``, gate
trace in the run directory); the progress line shows its switches and rank imbalance.
``--router-skew S`` makes a Zipf-like load to try it on (``router_skew.py``).
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.autograd.profiler import record_function

from moe_plugin import alike_on_every_rank, raised_alike, report_error
from moe_plugin.checkpoint.trust import TRUST_HELP
from moe_plugin.configs import ConfigError, MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks import RunPlan, check_run, max_token_id  # noqa: E402  (the example's sibling modules)
from training_log import TrainingLog  # noqa: E402


# --- 1. flags (checked in checks.py) -------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = parser.add_argument_group("model (Megatron-LM's flags)")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    model.add_argument("--seq-length", type=int, default=128)
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--hidden-dropout", type=float, default=0.0)
    model.add_argument("--attention-dropout", type=float, default=0.0)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="give the output layer a weight of its own (default: tied to the word embedding, as "
                       "Megatron-LM ties them; tied across the first and last stage under pipeline parallelism)")
    model.add_argument("--disable-bias-linear", action="store_true",
                       help="no biases in the linear layers (Megatron-LM's flag, add_bias_linear=False); a dense model "
                       "to upcycle needs it: the plugin's experts have none (moe-plugin upcycle)")
    model.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                       help="the norm of every layer, the final norm and --qk-layernorm's")
    model.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of every norm (layernorm_epsilon)")
    model.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute",
                       help="learned absolute position embeddings, or rotary embeddings applied to queries and keys")
    model.add_argument("--rotary-base", type=float, default=None, help="RoPE's base period (default 10000; "
                       "needs --position-embedding-type rope)")
    model.add_argument("--rotary-percent", type=float, default=None, help="the share of each head's dimensions "
                       "RoPE rotates, the first ones (default 1.0; GLM-4.5: 0.5; needs --position-embedding-type rope)")
    model.add_argument("--rope-scaling", default=None, metavar="JSON",
                       help="RoPE scaling as Hugging Face's rope_parameters give it, e.g. '{\"rope_type\": \"yarn\", "
                       "\"factor\": 4, \"original_max_position_embeddings\": 4096}' (yarn; needs "
                       "--position-embedding-type rope)")
    model.add_argument("--swiglu", action="store_true",
                       help="gated SiLU dense MLPs (gated_linear_unit, activation silu); the experts' activation is "
                       "moe.activation of the JSON (\"swiglu\")")
    model.add_argument("--group-query-attention", action="store_true",
                       help="grouped-query attention: --num-query-groups key/value heads shared by the query heads")
    model.add_argument("--num-query-groups", type=int, default=None,
                       help="key/value heads with --group-query-attention (default 1); must divide "
                       "--num-attention-heads and be a multiple of moe.parallel.tensor")
    model.add_argument("--qk-layernorm", action="store_true",
                       help="normalise every query and key head (--normalization) before attention")
    model.add_argument("--qk-layernorm-scope", choices=["head", "projection"], default="head",
                       help="with --qk-layernorm: each head on its own (Megatron's, Qwen3's), or every head of the "
                       "query and of the key projection at once (OLMoE's; RMSNorm)")
    model.add_argument("--kv-channels", type=int, default=None,
                       help="size of an attention head (default: --hidden-size / --num-attention-heads)")
    model.add_argument("--add-qkv-bias", action="store_true",
                       help="biases on the query, key and value projections only (Qwen2), also with "
                       "--disable-bias-linear")
    model.add_argument("--window-size", default=None, metavar="LEFT,RIGHT",
                       help="sliding-window attention: a query attends the LEFT keys before it and the RIGHT after "
                       "(Megatron's window_size; a Hugging Face sliding_window W is W-1,0)")
    model.add_argument("--window-attn-skip-freq", default=None, metavar="N|LIST",
                       help="with --window-size: every Nth layer attends fully, or a JSON list with 1 for each "
                       "windowed layer and 0 for a full one (default: every layer windowed)")
    model.add_argument("--softmax-type", choices=["vanilla", "off-by-one", "learnable"], default="vanilla",
                       help="attention sinks (Megatron's softmax_type): learnable adds a learned logit per head to "
                       "every query's softmax (GPT-OSS), off-by-one a zero one")
    model.add_argument("--multi-latent-attention", action="store_true",
                       help="DeepSeek-V2/V3's multi-latent attention (Megatron's MLASelfAttention): low-rank query "
                       "and key/value projections, a rotary key shared by the heads; with --qk-layernorm their "
                       "compressed query and key/value are normalised (DeepSeek's); needs --position-embedding-type "
                       "rope")
    model.add_argument("--q-lora-rank", type=int, default=None,
                       help="MLA: rank of the query's down projection (default: none, a full query projection)")
    model.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: rank of the key/value down projection")
    model.add_argument("--qk-head-dim", type=int, default=None,
                       help="MLA: query/key head dimensions without RoPE (default: --kv-channels or hidden / heads)")
    model.add_argument("--qk-pos-emb-head-dim", type=int, default=None,
                       help="MLA: the rotated query/key head dimensions, the key's shared by the heads "
                       "(default: half of --qk-head-dim)")
    model.add_argument("--v-head-dim", type=int, default=None, help="MLA: value head size (default: --qk-head-dim)")
    model.add_argument("--dense", action="store_true",
                       help="the dense baseline: Megatron's MLP on every layer; the \"moe\" block still gives the "
                       "parallel layout, its expert settings are unused")
    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=None,
                       help="must equal the JSON's train_micro_batch_size_per_gpu (filled in from here when absent)")
    train.add_argument("--train-iters", type=int, default=100, help="optimizer steps (global batches)")
    train.add_argument("--eval-interval", type=int, default=50, help="steps between validations; 0: only at the end")
    train.add_argument("--eval-iters", type=int, default=4, help="validation global batches per validation")
    train.add_argument("--log-interval", type=int, default=10, help="steps between two console lines")
    train.add_argument("--seed", type=int, default=1234, help="model init and data order")
    train.add_argument("--save", default=None, help="checkpoint directory to save to")
    train.add_argument("--save-interval", type=int, default=None, help="steps between checkpoints (default: at the end)")
    train.add_argument("--keep-last", type=int, default=None,
                       help="after each save, remove the tags beyond the newest N (by step), never the one just "
                       "written nor the one 'latest' names (default: keep every tag)")
    train.add_argument("--async-save", action="store_true",
                       help="copy the state to host memory at the save step and write, hash and commit the checkpoint "
                            "in the background while training goes on (the same files); a save waits for the previous "
                            "one, and the run for the last one before it exits")
    train.add_argument("--load", default=None, help="checkpoint directory to resume from")
    train.add_argument("--finetune", action="store_true",
                       help="with --load: its weights only, from step 0, with a fresh optimizer and the JSON's lr "
                       "scheduler (Megatron-LM's flag; no optimizer, scheduler or RNG state of the checkpoint)")
    train.add_argument("--skip-train", action="store_true",
                       help="no training: the validation loss over every held-out sample (or conversation) once, "
                       "printed as 'validation loss X' (Megatron-LM's flag; usually with --load)")
    train.add_argument("--strict-load", action="store_true",
                       help="with --load: a 'latest' tag that fails verification is an error (default: say so in one "
                       "line and load the newest tag that verifies)")
    train.add_argument("--no-load-optim", action="store_true",
                       help="load weights, lr scheduler and step only, not the optimizer state (Adam starts "
                       "afresh); any layout loads with it too, so this is needed only for checkpoints without "
                       "the optimizer record (saved before it existed, or fp16)")
    train.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states of the checkpoint")
    train.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    train.add_argument("--max-skipped-steps", type=int, default=10,
                       help="fp16: stop the run when this many steps in a row were skipped for overflow (fp32 and "
                       "bf16 stop at the first non-finite gradient)")
    train.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="a collective that waits longer (a stalled or dead rank) raises an error (Megatron-LM's "
                       "flag; torch's default would be 30)")
    train.add_argument("--exit-signal-handler", action="store_true",
                       help="on SIGTERM or SIGUSR1 (to the launcher or any rank) finish the step, save to --save and "
                       "exit with status 75, every rank at the same step (Megatron-LM's flag; docs/long_runs.md)")
    train.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="save to --save and exit with status 75 once the run's wall time passes this many minutes "
                       "(checked after every step; Megatron-LM's flag)")
    train.add_argument("--router-skew", type=float, default=0.0,
                       help="bias every router towards low expert ids, offset -S*log(1+e) on the logits that choose "
                       "experts: a Zipf-like load for placement experiments (router_skew.py); 0: off")
    train.add_argument("--freeze-router", action="store_true",
                       help="do not train the routers' weights and do not move their expert biases (aux-loss-free "
                       "balancing), so that the routing stays as loaded (or as --router-skew makes it)")
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", default=None, help="prefix of a Megatron indexed dataset (PREFIX.bin/.idx); "
                      "default: the Python stdlib corpus")
    data.add_argument("--data-cache", default="data", help="where the stdlib corpus is written on first use")
    data.add_argument("--corpus-bytes", type=int, default=4 << 20, help="size cap of the stdlib corpus")
    data.add_argument("--valid-fraction", type=float, default=0.05, help="documents held out for validation")
    data.add_argument("--valid-data-path", default=None,
                      help="prefix of a held-out indexed dataset (text or chat) to validate on instead of a "
                      "--valid-fraction of --data-path; every sample (conversation) of it once per validation")
    data.add_argument("--conversation-overflow", choices=["truncate", "refuse"], default="truncate",
                      help="chat data: a conversation longer than --seq-length is truncated to its first "
                      "--seq-length tokens (counted in the data line), or refused")
    data.add_argument("--vocab-size", type=int, default=None,
                      help="tokenizer vocabulary of --data-path data (default: the one PREFIX.json of moe-plugin "
                      "preprocess records, else its largest token id + 1)")
    data.add_argument("--tokenizer", default=None, help="the Hugging Face tokenizer directory the --data-path data "
                      "was preprocessed with: its vocabulary size (needs the hf extra)")
    data.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    train.add_argument("--profile", action="store_true",
                       help="time the parts of the steps from --profile-step-start to --profile-step-end (attention, "
                       "MLPs, the MoE layer's router / dispatch / all-to-all / experts / combine, collectives, "
                       "optimizer; torch.profiler, CPU) and log them, mean and max over the ranks, to the console and "
                       "parts.json in the run directory (Megatron-LM's flags)")
    train.add_argument("--profile-step-start", type=int, default=10, help="first profiled step (0-based)")
    train.add_argument("--profile-step-end", type=int, default=12, help="the profile stops before this step")
    out = parser.add_argument_group("output")
    out.add_argument("--run-dir", default=None, help="metrics and plot go here (default: runs/<config name>)")
    out.add_argument("--no-plot", action="store_true", help="write no metrics.png (matplotlib takes longer than "
                     "a few steps of a small model)")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    return args


def model_architecture(args: argparse.Namespace) -> dict:
    """The ``TransformerConfig`` fields of the architecture flags (Megatron-LM's translation of them)."""
    fields: dict = dict(normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
                        add_bias_linear=not args.disable_bias_linear, qk_layernorm=args.qk_layernorm,
                        num_query_groups=(args.num_query_groups or 1) if args.group_query_attention else None,
                        kv_channels=args.kv_channels, add_qkv_bias=args.add_qkv_bias, softmax_type=args.softmax_type)
    if args.multi_latent_attention:
        fields.update(mla_fields(args))
    if args.window_size is not None:
        from checks import window_fields

        fields.update(window_fields(args))
    if args.swiglu:
        fields.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    return fields


def mla_fields(args: argparse.Namespace) -> dict:
    """Megatron's ``MLATransformerConfig`` fields of the MLA flags (with --rope-scaling: YaRN's, which set
    MLA's softmax scale; the frequencies come from ``rope_scaled``)."""
    from checks import mla_head_dims

    from moe_plugin.integration.megatron import mla_fields as fields_of

    head, rotated = mla_head_dims(args)
    return fields_of(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=head,
                     qk_pos_emb_head_dim=rotated, v_head_dim=args.v_head_dim or head,
                     rotary_base=position_embedding(args)["rotary_base"],
                     rope_scaling=args.rope_scaling and json.loads(args.rope_scaling))


def position_embedding(args: argparse.Namespace) -> dict:
    """``GPTModel``'s (and ``gpt_pipeline_module``'s) position arguments from the flags."""
    return dict(position_embedding_type=args.position_embedding_type,
                rotary_base=10000 if args.rotary_base is None else args.rotary_base,
                rotary_percent=1.0 if args.rotary_percent is None else args.rotary_percent)


# --- 2. data -------------------------------------------------------------------------------------
@dataclass
class Data:
    train: Any            # TokenSamples, or PackedConversations of chat data
    valid: Any            # the same kind over the held-out documents (or --valid-data-path)
    schedule: Any         # GlobalBatches over train
    valid_schedule: Any   # GlobalBatches over valid, unshuffled: every validation sees the same batches
    vocab_size: int       # padded
    description: str
    valid_batches: Optional[list] = None   # every held-out sample once (chat, --valid-data-path): global batches
    chat: bool = False    # packed conversations with loss masks (moe-plugin preprocess --chat)


def build_data(args: argparse.Namespace, plan: RunPlan) -> Data:
    """The training and validation samples: windows of text, or packed conversations of chat data
    (``moe-plugin preprocess --chat``); held out by ``--valid-fraction`` or ``--valid-data-path``."""
    from moe_plugin.data import (
        ByteTokenizer,
        GlobalBatches,
        corpus_manifest,
        ensure_stdlib_corpus,
        is_chat_dataset,
        num_documents,
        pad_vocab_size,
        split_documents,
    )

    if args.data_path is None:
        prefix = ensure_stdlib_corpus(args.data_cache, args.corpus_bytes)  # one rank writes, with a progress bar
        manifest = corpus_manifest(prefix)
        vocab = ByteTokenizer.vocab_size
        what = (f"Python {manifest['python']} stdlib corpus: {manifest['documents']} files, {manifest['tokens']:,} "
                f"byte tokens, sha256 {manifest['sha256'][:12]} ({prefix})")
    else:
        prefix = args.data_path
        vocab, what = data_vocab_size(args)
    chat = args.data_path is not None and is_chat_dataset(prefix)
    dataset, vocab, what = open_dataset(args, prefix, chat, vocab, what)

    def documents_in(opened) -> int:   # chat data opens as (tokens, loss mask)
        return num_documents(opened[0] if chat else opened)

    if args.valid_data_path is not None:
        if is_chat_dataset(args.valid_data_path) != chat:
            raise ConfigError("--valid-data-path", args.valid_data_path, "holds " + ("text" if chat else "chat")
                              + f" data, --data-path {prefix} " + ("chat" if chat else "text") + " data: validate on "
                              "data of the same kind")
        valid_set, _, _ = open_dataset(args, args.valid_data_path, chat, vocab, "")
        train_docs, valid_docs = range(documents_in(dataset)), range(documents_in(valid_set))
    else:
        valid_set = dataset
        train_docs, valid_docs = split_documents(documents_in(dataset), args.valid_fraction)
        if len(valid_docs) == 0:
            raise ConfigError("--valid-fraction", args.valid_fraction, f"holds out no document of "
                              f"{len(train_docs)}; use a larger fraction")
    padded = pad_vocab_size(vocab, args.make_vocab_size_divisible_by, plan.sizes.tp)
    train = samples_of(args, dataset, train_docs, chat, "training split")
    valid = samples_of(args, valid_set, valid_docs, chat, "validation split" if args.valid_data_path is None
                       else f"--valid-data-path {args.valid_data_path}")
    if chat:
        what += f"\n  training {train.describe()}\n  validation {valid.describe()}"
    else:
        what += (f"\n  training {len(train_docs)} documents, {len(train):,} samples of {args.seq_length + 1} tokens; "
                 f"validation {len(valid_docs)} documents, {len(valid):,} samples")
    what += f"; vocabulary {vocab} padded to {padded}"
    every = None
    if chat or args.valid_data_path is not None:   # every held-out sample once, in whole global batches
        from moe_plugin.data.packing import padded_indices

        every = padded_indices(len(valid), plan.global_batch_size)
        every = [every[i:i + plan.global_batch_size] for i in range(0, len(every), plan.global_batch_size)]
    return Data(train, valid, GlobalBatches(len(train), plan.global_batch_size, seed=args.seed),
                GlobalBatches(len(valid), plan.global_batch_size, shuffle=False), padded, what, every, chat)


def open_dataset(args: argparse.Namespace, prefix: str, chat: bool, vocab: Optional[int], what: str):
    """``(dataset, vocabulary, description)``: the indexed dataset at ``prefix`` (chat: its tokens and
    loss mask, ``read_chat_dataset``), checked against each other and against the vocabulary (None: its
    largest token id + 1)."""
    from moe_plugin.data import read_chat_dataset, read_indexed

    dataset = read_chat_dataset(prefix) if chat else read_indexed(prefix)   # ConfigError naming the file
    tokens = dataset[0] if chat else dataset
    largest = max_token_id(f"{prefix}.bin", tokens.index.dtype, args.data_cache)
    if vocab is None:
        vocab = largest + 1
        what += f" (vocabulary {vocab}: its largest token id + 1; pass --vocab-size to set it)"
    elif largest >= vocab:   # else an IndexError at the first batch holding it (a device-side assert on a GPU)
        flag = "--vocab-size" if args.data_path is not None else f"{prefix}.bin"
        raise ConfigError(flag, vocab, f"the data's largest token id is {largest:,} ({prefix}.bin): the vocabulary "
                          f"must be at least {largest + 1:,}" + ("" if args.data_path is not None else
                                                                 f" (the byte tokenizer's): delete {prefix}.* to "
                                                                 "rebuild the corpus"))
    return dataset, vocab, what


def samples_of(args: argparse.Namespace, dataset, documents, chat: bool, name: str):
    """The samples of ``documents``: windows of ``--seq-length`` + 1 tokens, or (chat) the conversations
    packed into ``--seq-length`` tokens."""
    from moe_plugin.data import TokenSamples
    from moe_plugin.data.packing import PackedConversations

    try:
        if chat:
            return PackedConversations(*dataset, documents, args.seq_length, overflow=args.conversation_overflow,
                                       name=name)
        return TokenSamples(dataset, documents, args.seq_length, name=name)
    except ValueError as err:   # too little data for one sample
        raise ConfigError("--seq-length", args.seq_length, str(err)) from None


def data_vocab_size(args: argparse.Namespace) -> tuple[Optional[int], str]:
    """(vocabulary, description) of ``--data-path`` data: ``--vocab-size``, ``--tokenizer``'s size, or
    the size ``PREFIX.json`` records (``moe-plugin preprocess``); None: the data's largest id + 1.
    A ``--tokenizer`` or ``--vocab-size`` that disagrees with ``PREFIX.json`` is refused."""
    manifest_path = Path(f"{args.data_path}.json")
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    except (OSError, ValueError):
        manifest = {}
    recorded = manifest.get("vocab_size") if isinstance(manifest, dict) else None
    what = f"indexed dataset {args.data_path}"
    if args.tokenizer is not None:
        from moe_plugin.data.hf_tokenizer import load_hf_tokenizer

        vocab, flag = len(load_hf_tokenizer(args.tokenizer, "--tokenizer")), "--tokenizer"
        what += f", tokenizer {args.tokenizer}"
    elif args.vocab_size is not None:
        vocab, flag = args.vocab_size, "--vocab-size"
    elif isinstance(recorded, int):
        return recorded, what + f", tokenizer {manifest.get('tokenizer')} ({manifest_path})"
    else:
        return None, what
    if isinstance(recorded, int) and recorded != vocab:
        raise ConfigError(flag, args.tokenizer if flag == "--tokenizer" else vocab, f"{manifest_path} records a "
                          f"vocabulary of {recorded:,} (tokenizer {manifest.get('tokenizer')}), this gives {vocab:,}: "
                          "the data was preprocessed with another tokenizer")
    return vocab, what


# --- 3. model and engine -------------------------------------------------------------------------
def transformer_config(args: argparse.Namespace, moe_config: MoEConfig):
    """Megatron's TransformerConfig from the flags and ``moe.parallel`` (``moe_plugin.transformer_config``:
    the parallel sizes are written once, in the ``"moe"`` block). CPU initialisation makes
    the weights the same for every layout (Megatron splits one full tensor); the fused kernels
    (apex, CUDA) are off so the model also runs on CPU."""
    import moe_plugin

    return moe_plugin.transformer_config(   # tensor / pipeline / sequence parallel from moe.parallel
        moe_config,
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        **model_architecture(args), pipeline_dtype=torch.float32, use_cpu_initialization=True,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)


def gpt_model_provider(args: argparse.Namespace, vocab_size: int):
    """``model_provider(moe_config, groups)`` for ``moe_plugin.initialize``: a GPTModel with MoE MLPs."""

    def provider(moe_config: MoEConfig, groups):
        from megatron.core.models.gpt import GPTModel

        from moe_plugin import gpt_moe_spec
        from moe_plugin.integration.megatron import gpt_dense_spec

        config = transformer_config(args, moe_config)
        torch.manual_seed(args.seed)  # every weight follows it: the embedding, an untied output layer draw from
        scope = args.qk_layernorm_scope   # torch's seed draws the weights
        spec = (gpt_dense_spec(config, qk_layernorm_scope=scope) if args.dense
                else gpt_moe_spec(moe_config, config, groups, qk_layernorm_scope=scope))
        model = GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=args.max_position_embeddings,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         **position_embedding(args))
        return skewed(args, rope_scaled(args, model))

    return provider


def rope_scaled(args: argparse.Namespace, model: torch.nn.Module) -> torch.nn.Module:
    """``--rope-scaling``: the model's RoPE scaled (YaRN, ``moe_plugin.integration.rope``)."""
    if args.rope_scaling is None:
        return model
    from moe_plugin.integration.rope import RopeScaling, apply_rope_scaling

    return apply_rope_scaling(model, RopeScaling.from_dict(args.rope_scaling),
                              rotary_base=position_embedding(args)["rotary_base"])


def skewed(args: argparse.Namespace, model: torch.nn.Module) -> torch.nn.Module:
    """``--router-skew`` / ``--freeze-router`` on a freshly built model, before the engine sees its
    parameters (a frozen router weight is then simply not in the optimizer)."""
    from router_skew import freeze_routers, skew_routers

    if args.router_skew:
        skew_routers(model, args.router_skew)
    if args.freeze_router:
        freeze_routers(model)
    return model


def gpt_pipeline_provider(args: argparse.Namespace, vocab_size: int):
    """The same GPT as a DeepSpeed ``PipelineModule``: this rank builds only its stage's pieces, with
    the weights ``gpt_model_provider``'s model has (``moe_plugin.integration.seeding``)."""

    def provider(moe_config: MoEConfig, groups):
        from moe_plugin import gpt_pipeline_module

        config = transformer_config(args, moe_config)
        return skewed(args, rope_scaled(args, gpt_pipeline_module(
            config, moe_config, groups, vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings, seed=args.seed,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            qk_layernorm_scope=args.qk_layernorm_scope, **position_embedding(args))))

    return provider


def build_engine(args: argparse.Namespace, plan: RunPlan, data: Data):
    """``moe_plugin.initialize``: groups, Megatron's RNG tracker seeded from ``--seed`` (as Megatron-LM
    seeds it: its attention's dropout forks it), model, DeepSpeed engine (a PipelineEngine when pp > 1)."""
    import moe_plugin

    provider = gpt_pipeline_provider if plan.sizes.pp > 1 else gpt_model_provider
    return moe_plugin.initialize(plan.ds_config, provider(args, data.vocab_size), args=args, seed=args.seed,
                                 timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
                                 max_skipped_steps=args.max_skipped_steps)


# --- 4. steps ------------------------------------------------------------------------------------
def position_ids(tokens_BS: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)


def micro_batch_loss(engine, batch, global_tokens: Optional[int] = None, replicas: int = 1) -> torch.Tensor:
    """The loss of one micro-batch: text ``(tokens_BS, labels_BS)``, the mean token cross entropy (the model
    returns it per token); with ``global_tokens`` (chat data, ``PackedBatch``, or text with loss masks) the
    micro-batch's share of the global batch's mean over its loss tokens (``moe_plugin.packed_loss``)."""
    from moe_plugin.data.packing import PackedBatch
    from moe_plugin.integration.packed import packed_loss, weighted_sum

    if isinstance(batch, PackedBatch):
        return packed_loss(engine, batch, global_tokens, replicas)
    tokens_BS, labels_BS, *mask = (t.to(engine.device) for t in batch)
    losses_BS = engine(tokens_BS, position_ids(tokens_BS), None, labels=labels_BS)
    if global_tokens is None:
        return losses_BS.float().mean()
    from moe_plugin.data.packing import token_weights

    return weighted_sum(losses_BS, token_weights(mask[0], global_tokens, replicas))


def micro_batches(samples, indices, plan: RunPlan, groups, masked: bool = False):
    """This data-parallel rank's micro-batches of the global batch ``indices``: (tokens_BS, labels_BS) of
    text (``masked``: with a loss mask that is 0 on the padding rows of a last, partial batch), a
    ``PackedBatch`` of chat data."""
    from moe_plugin.data import micro_batch_rows

    dp_rank, dp_size = groups.rank_in("dp"), groups.size("dp")
    for micro_step in range(plan.grad_accumulation):
        rows = micro_batch_rows(indices, dp_rank, dp_size, plan.micro_batch_size, micro_step)
        yield samples.masked_batch(rows) if masked else samples.batch(rows)


def global_tokens(samples, indices) -> Optional[int]:
    """The loss tokens of the global batch ``indices`` of chat data (None: text, every token)."""
    return samples.loss_tokens(indices) if hasattr(samples, "loss_tokens") else None


def train_step(run, data: Data, plan: RunPlan, step: int) -> float:
    """One optimizer step: forward / backward / step per micro-batch (DeepSpeed steps the
    optimizer at the last one). Returns the global batch's loss (averaged over data parallelism; chat
    data: the mean over the global batch's loss tokens)."""
    engine, losses = run.engine, []
    indices = data.schedule.global_batch(step)
    count, replicas = global_tokens(data.train, indices), plan.sizes.dp * plan.grad_accumulation
    for batch in micro_batches(data.train, indices, plan, run.groups):
        with record_function("step.forward"):      # profiler scopes: the phases of --profile's parts
            loss = micro_batch_loss(engine, batch, count, replicas)
        with record_function("step.backward"):
            engine.backward(loss)     # sequence-parallel norm gradients are summed over TP in here
        with record_function("optimizer"):
            engine.step()
        losses.append(loss.detach())
    return data_parallel_mean(torch.stack(losses).mean(), run.groups)


def pipe_batches(data_samples, indices, plan: RunPlan, groups, count: Optional[int], masked: bool = False):
    """The PipelineEngine's micro-batches of the global batch ``indices``: ``((tokens, position_ids),
    labels)`` of text, ``((tokens, position_ids, document_ids), (labels, weights))`` of packed or masked
    batches (``moe_plugin.packed_pipe_inputs``)."""
    from moe_plugin.data.packing import PackedBatch, token_weights
    from moe_plugin.integration.packed import packed_pipe_inputs

    replicas = plan.sizes.dp * plan.grad_accumulation
    for batch in micro_batches(data_samples, indices, plan, groups, masked):
        if isinstance(batch, PackedBatch):
            yield packed_pipe_inputs(batch, count, replicas)
        elif masked:
            tokens_BS, labels_BS, mask_BS = batch
            yield (tokens_BS, position_ids(tokens_BS)), (labels_BS, token_weights(mask_BS, count, replicas))
        else:
            tokens_BS, labels_BS = batch
            yield (tokens_BS, position_ids(tokens_BS)), labels_BS


def pipeline_train_step(run, data: Data, plan: RunPlan, step: int) -> float:
    """The same step on the PipelineEngine: ``train_batch`` runs the micro-batches through the
    stages (the first reads the tokens, the last the labels) and returns the loss, averaged over
    the micro-batches and data parallelism, on every rank."""
    indices = data.schedule.global_batch(step)
    return float(run.engine.train_batch(pipe_batches(data.train, indices, plan, run.groups,
                                                     global_tokens(data.train, indices))))


def validation_plan(data: Data, iters: int) -> tuple[list, Optional[int], bool]:
    """``(global batches, loss tokens over all of them, masked)``: every held-out sample once
    (``data.valid_batches``: chat data, ``--valid-data-path``), else the first ``iters`` fixed batches."""
    if data.valid_batches is None:
        return [data.valid_schedule.global_batch(step) for step in range(iters)], None, False
    every = [i for batch in data.valid_batches for i in batch]
    count = (data.valid.loss_tokens(every) if data.chat
             else data.valid.seq_length * sum(1 for i in every if i >= 0))
    return data.valid_batches, count, not data.chat


@torch.no_grad()
def evaluate(run, data: Data, plan: RunPlan, iters: int) -> float:
    """The validation loss (eval mode: eval capacity factor): the mean over every held-out loss token
    (``validation_plan``), else the mean of ``iters`` fixed batches' losses."""
    engine, losses = run.engine, []
    batches, count, masked = validation_plan(data, iters)
    replicas = plan.sizes.dp * plan.grad_accumulation
    engine.eval()
    for indices in batches:
        for batch in micro_batches(data.valid, indices, plan, run.groups, masked):
            losses.append(micro_batch_loss(engine, batch, count, replicas))
    engine.train()
    mean = torch.stack(losses).mean() * (len(batches) if count is not None else 1)   # weighted: a sum over batches
    return data_parallel_mean(mean, run.groups)


def pipeline_evaluate(run, data: Data, plan: RunPlan, iters: int) -> float:
    """``evaluate`` on the PipelineEngine (``eval_batch`` broadcasts each batch's loss to every stage)."""
    batches, count, masked = validation_plan(data, iters)
    losses = [run.engine.eval_batch(pipe_batches(data.valid, indices, plan, run.groups, count, masked)).detach().float()
              for indices in batches]
    mean = torch.stack(losses).mean() * (len(batches) if count is not None else 1)
    return data_parallel_mean(mean, run.groups)


def data_parallel_mean(value: torch.Tensor, groups) -> float:
    """``value`` averaged over the data-parallel group (tensor-parallel peers hold equal values)."""
    import torch.distributed as dist

    value = value.detach().float().reshape(1).clone()
    if groups.dp is not None:
        dist.all_reduce(value, group=groups.dp)
        value /= groups.size("dp")
    return value.item()


def moe_report(metrics) -> dict:
    """The MoE part of a progress report from ``ExpertMetrics`` (``integration/monitor.py``), whose
    sums cover every training forward since the previous report. ``imbalance``: max / mean of the
    tokens routed to each expert, averaged over the MoE layers (1.0 is perfectly even);
    ``dropped_fraction``: routes over capacity over all layers; ``moe``: the compact log line;
    ``moe_layers``: each layer's figures, with the ``expert_bias`` its last forward chose experts with
    (moved once per optimizer step by ``moe.bias_update_rate``)."""
    layers = metrics.metrics
    if not layers:
        return {}
    routed = sum(sum(m.tokens_per_expert) for m in layers)
    kept = sum(sum(m.kept_per_expert) for m in layers)
    return {"imbalance": sum(m.imbalance for m in layers) / len(layers),
            "dropped_fraction": 1.0 - kept / routed if routed else 0.0, "moe": metrics.log_line(),
            "moe_layers": [{"layer": m.layer, "imbalance": m.imbalance, "dropped_fraction": m.dropped_fraction,
                            "balance_loss": m.aux_loss, "tokens_per_expert": m.tokens_per_expert,
                            "expert_bias": m.expert_bias} for m in layers]}


def peak_memory_mb(device: str) -> float:
    """This process's peak memory so far (MiB): the accelerator's peak allocation on a GPU, the
    peak resident set size on CPU (which includes the interpreter and the imported libraries)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2 ** 20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def per_rank(value: float, device) -> list[float]:
    """``value`` of every rank, in rank order (collective; ``device``: the engine's, which the
    backend communicates from: NCCL takes no CPU tensors)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [round(value, 1)]
    values = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64, device=device))
    return [round(float(v.item()), 1) for v in values]


def log_parts(log: TrainingLog, parts: dict[str, float], args, device) -> None:
    """``--profile``: the parts of the profiled steps, mean and max over the ranks (collective)."""
    from moe_plugin_tools.bench.step_parts import over_ranks, table

    ranks = over_ranks(parts, device)
    if log.enabled:
        log.run_dir.mkdir(parents=True, exist_ok=True)
        (log.run_dir / "parts.json").write_text(json.dumps(
            {"steps": [args.profile_step_start, args.profile_step_end], "unit": "ms per step", **ranks}, indent=1))
    log.info(f"parts of steps {args.profile_step_start}-{args.profile_step_end - 1}, ms per step "
             f"(torch.profiler; mean and max over the ranks):\n" + table({"mean": ranks["mean"], "max": ranks["max"]}))


# --- checkpoints ----------------------------------------------------------------------------------
def save_checkpoint(run, directory: str, step: int, keep_last: Optional[int] = None,
                    async_save: bool = False) -> Optional[str]:
    """Collective. Experts are saved by global id, the rest by DeepSpeed (``moe_plugin.save_checkpoint``);
    ``keep_last`` (``--keep-last``): the newest tags kept. ``async_save`` (``--async-save``): written in the
    background (``moe_plugin.poll_save`` after each step, ``wait_for_save`` at the end). Returns the
    directory of an earlier asynchronous save this one waited for (None: none was in flight), so
    that its commit is reported whichever call saw it."""
    from moe_plugin import save_checkpoint as save, wait_for_save

    committed = wait_for_save(run)   # what save would wait for first (its failure raised here, on every rank)
    save(run, directory, tag=f"step{step}", client_state={"step": step}, keep_last=keep_last, async_save=async_save)
    return committed


def resume(args: argparse.Namespace, run) -> int:
    """``--load`` (collective): the steps already trained, 0 with ``--finetune`` (the weights only: a
    fresh optimizer, the JSON's scheduler from its start, no RNG state). A resume with nothing left to
    train, or whose scheduler gives lr 0 for every step to come, is a ``ConfigError`` (exit status 2)."""
    if not args.load:
        return 0
    if args.finetune:
        from moe_plugin import checkpoint_exists

        if not checkpoint_exists(args.load):
            raise ConfigError("--load", args.load, "--finetune trains the weights of a checkpoint, and there is "
                              "none there (missing or empty directory)")
        load_checkpoint(run, args.load, optimizer=False, rng=False, strict=args.strict_load,
                        trust=args.trust_checkpoint, module_only=True)
        return 0
    start = load_checkpoint(run, args.load, not args.no_load_optim, not args.no_load_rng, args.strict_load,
                            args.trust_checkpoint)
    if args.skip_train or start == 0:
        return start
    if start >= args.train_iters:
        raise ConfigError("--train-iters", args.train_iters, f"--load {args.load} has trained {start} steps already: "
                          f"nothing is left to train; pass --finetune to train its weights from step 0 with a fresh "
                          f"optimizer and the JSON's schedule, or a --train-iters above {start} to resume")
    learning_rates = future_learning_rates(run.lr_scheduler, start, args.train_iters)
    if learning_rates and max(learning_rates) <= 0.0:
        raise ConfigError("--load", args.load, f"its lr scheduler gives lr 0 for every step to come (steps "
                          f"{start + 1}-{args.train_iters}: the schedule of the run that saved it has ended); pass "
                          "--finetune for the JSON's schedule from step 0")
    return start


def future_learning_rates(scheduler, start: int, end: int) -> list[float]:
    """The largest learning rate of each step ``start .. end - 1`` that DeepSpeed's ``scheduler`` will give
    (the next step trains at the rate of its current iteration, each step moves it on by one); [] for a
    scheduler without DeepSpeed's ``last_batch_iteration`` and ``get_lr``. The scheduler is left as it was."""
    if scheduler is None or not hasattr(scheduler, "last_batch_iteration") or not hasattr(scheduler, "get_lr"):
        return []
    saved, rates = scheduler.last_batch_iteration, []
    try:
        for iteration in range(max(saved, 0), max(saved, 0) + end - start):
            scheduler.last_batch_iteration = iteration
            rates.append(max(scheduler.get_lr()))
    finally:
        scheduler.last_batch_iteration = saved
    return rates


def load_checkpoint(run, directory: str, optimizer: bool = True, rng: bool = True, strict: bool = False,
                    trust: bool = False, module_only: bool = False) -> int:
    """Resume from the ``latest`` tag of ``directory`` (if it fails verification, from the newest tag
    that verifies, with one line saying why; ``strict`` (``--strict-load``): an error instead);
    returns the number of steps already trained.
    ``optimizer=False`` (``--no-load-optim``): weights only (any layout takes the optimizer state too).
    A missing or empty ``directory`` starts from scratch (0), as Megatron-LM does: a first run may
    name its ``--save`` directory in ``--load``. One that holds a tag but no ``latest`` is an error.
    ``trust`` (``--trust-checkpoint``): read pickles as torch does (DeepSpeed files holding other objects)."""
    import torch.distributed as dist

    from moe_plugin import CheckpointError, checkpoint_exists
    from moe_plugin import load_checkpoint as load

    if not checkpoint_exists(directory):
        if dist.get_rank() == 0:
            print(f"--load {directory}: no checkpoint there (missing or empty directory); starting from scratch",
                  flush=True)
        return 0
    began = time.perf_counter()
    try:
        path, client_state = load(run, directory, strict=strict, load_optimizer_states=optimizer and not module_only,
                                  load_rng_states=rng, trust=trust, load_module_only=module_only,
                                  load_lr_scheduler_states=not module_only)
    except CheckpointError as err:
        if "load_optimizer_states=False" in str(err):
            raise CheckpointError(f"{err} (in this script: --no-load-optim)") from None
        raise
    if dist.get_rank() == 0:
        tag = os.path.dirname(path) if os.path.isfile(path) else path   # DeepSpeed names its module file
        print(f"loaded {tag} in {time.perf_counter() - began:.2f} s", flush=True)
    return int((client_state or {}).get("step", run.engine.global_steps))


# --- the run -------------------------------------------------------------------------------------
def train(args: argparse.Namespace, plan: RunPlan, data: Data, result, log: TrainingLog, placement=None,
          exit_request=None) -> Optional[str]:
    """The training loop. ``placement`` (a ``TrainingPlacement`` or None) is stepped after every
    optimizer step, at the step boundary, on every rank; its time counts as training time.
    ``exit_request`` (``moe_plugin.ExitRequest`` or None): checked after every step; returns its
    reason once it stopped the run early (a checkpoint of that step saved), else None."""
    from moe_plugin import ExpertMetrics

    start = resume(args, result)
    if start:
        log.info(f"resumed from {args.load} after {start} steps")
    elif args.finetune:
        log.info(f"fine-tuning the weights of {args.load} from step 0 (a fresh optimizer, the JSON's lr schedule)")
    from moe_plugin import wait_for_save

    metrics = ExpertMetrics(result.engine.module, groups=result.groups)   # expert load, also to DeepSpeed's monitor
    try:
        leaving = _train_steps(args, plan, data, result, log, placement, metrics, start, exit_request)
        # the last --async-save is written before the run ends (or fails it)
        log_written(log, wait_for_save(result), args.save)
        return leaving
    finally:
        metrics.close()


def _train_steps(args, plan, data, result, log: TrainingLog, placement, metrics, start: int,
                 exit_request=None) -> Optional[str]:
    from moe_plugin import poll_save

    engine = result.engine
    step_fn, eval_fn = (pipeline_train_step, pipeline_evaluate) if plan.sizes.pp > 1 else (train_step, evaluate)
    tokens_per_step = plan.global_batch_size * args.seq_length
    interval_s, interval_steps = 0.0, 0   # training time only: validation and checkpoints excluded
    profile = None
    for step in range(start, args.train_iters):
        if args.profile and step == args.profile_step_start:
            from moe_plugin_tools.bench.step_parts import PartsProfile
            profile = PartsProfile(engine.module)
            profile.start()
        began = time.perf_counter()
        loss = step_fn(result, data, plan, step)
        if placement is not None:
            placement.step(step)   # tracks the load, every check_interval steps may migrate experts
        step_s = time.perf_counter() - began
        interval_s += step_s
        interval_steps += 1
        done = step + 1
        if profile is not None and done == args.profile_step_end:
            log_parts(log, profile.stop(done - args.profile_step_start), args, engine.device)
            profile = None
        health = result.guard.after_step(done, step_s)   # collective: non-finite gradients, skipped steps, slow step
        if not math.isfinite(loss) and health.stopped is None:
            raise FloatingPointError(f"step {done}: the loss is {loss}; lower the learning rate or check the data")
        report = None
        if done % args.log_interval == 0 or done == args.train_iters:
            metrics.collect()              # collective: the interval's expert load over all ranks
            if metrics.metrics:            # (none in the dense baseline)
                metrics.write(engine, done)    # the monitor backends the DeepSpeed JSON enables
            report = {"tokens_per_s": tokens_per_step * interval_steps / interval_s,
                      "epoch": data.schedule.epoch_of(done), **moe_report(metrics)}
            if placement is not None:
                report["placement"] = placement.summary()
            report["peak_memory_mb"] = per_rank(peak_memory_mb(str(engine.device)), engine.device)   # collective
            interval_s, interval_steps = 0.0, 0
        log.train(done, loss, engine.get_lr()[0], report, step_s=step_s, skipped_steps=health.skipped_steps)
        health.raise_if_stopped()   # TrainingStopped on every rank, the same message
        if args.async_save:   # collective while a save is in flight: committed, or its failure on every rank
            log_written(log, poll_save(result), args.save)
        leaving = exit_request.after_step(done) if exit_request is not None else None   # collective
        if leaving is not None and done < args.train_iters:   # a signal, or --exit-duration-in-mins: save, leave
            began = time.perf_counter()
            log_written(log, save_checkpoint(result, args.save, done), args.save)
            log.info(f"{leaving}: saved checkpoint step{done} to {args.save} in {time.perf_counter() - began:.1f} s; "
                     f"exiting with status {exit_request.EXIT_STATUS} (resume with --load {args.save})")
            return leaving
        if (args.eval_interval and done % args.eval_interval == 0) or done == args.train_iters:
            log.valid(done, eval_fn(result, data, plan, args.eval_iters))
        if args.save and ((args.save_interval and done % args.save_interval == 0) or done == args.train_iters):
            began = time.perf_counter()
            waited = save_checkpoint(result, args.save, done, args.keep_last, args.async_save)
            took = time.perf_counter() - began   # the step's stall
            log_written(log, waited, args.save)
            log.info(f"checkpoint step{done}: copied in {took:.2f} s, being written to {args.save} in the background"
                     if args.async_save else f"saved checkpoint step{done} to {args.save} in {took:.2f} s")
    return None


def validate_only(args: argparse.Namespace, plan: RunPlan, data: Data, result, log: TrainingLog) -> int:
    """``--skip-train``: ``--load``'s weights (if given), the validation loss once, no training, no save."""
    start = resume(args, result)
    loss = (pipeline_evaluate if plan.sizes.pp > 1 else evaluate)(result, data, plan, args.eval_iters)
    log.valid(start, loss)   # "step N | validation loss X"
    return 0


def log_written(log, committed: Optional[str], directory: str) -> None:
    """The line of an asynchronous save once committed (``committed``: its directory; None: nothing to say)."""
    if committed is not None:
        log.info(f"checkpoint {os.path.basename(committed)} written to {directory} in the background")


def configure_threads() -> None:
    """Share the machine's cores between the ranks on it when the launcher did not set threads."""
    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))


def quiet_other_ranks(rank: int) -> None:
    """Every rank imports Megatron-Core and DeepSpeed and would print the same library warnings
    ("Apex is not installed", deprecations); rank 0 shows them once."""
    if rank != 0:
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)


def main(argv: Optional[list[str]] = None) -> int:
    started_at = time.monotonic()   # --exit-duration-in-mins counts from here
    rank = int(os.environ.get("RANK", "0"))
    quiet_other_ranks(rank)
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        plan = check_run(args, world_size)
        data = build_data(args, plan)   # may write the corpus; errors here are about the data's size
    except ConfigError as err:
        return report_error(err)   # one line, on rank 0; status 2 on every rank
    configure_threads()
    from moe_plugin.compat.shm_buffers import remove_shm_buffers
    from moe_plugin import CheckpointError, ExitRequest, TrainingStopped

    exit_request = None   # the handler stays until the process exits: the launcher signals each rank in turn
    if args.exit_signal_handler or args.exit_duration_in_mins is not None:
        exit_request = ExitRequest(args.exit_signal_handler, args.exit_duration_in_mins, start=started_at)

    atexit.register(remove_shm_buffers, range(world_size))   # DeepSpeed's /dev/shm buffers, every rank's
    run_dir = Path(args.run_dir or Path("runs") / Path(args.deepspeed_config).stem)
    memory_before_mb = peak_memory_mb("cpu")   # the interpreter and the libraries, before the model
    try:
        result = build_engine(args, plan, data)   # prints what it built on rank 0 (result.summary)
    except Exception as err:   # moe_plugin.initialize's checks (batch arithmetic for this layout, ZeRO, ...)
        if not raised_alike(err):   # one rank's own error: its traceback tells
            raise
        return report_error(err)   # raised alike on every rank: one line on rank 0, the same status everywhere
    log = TrainingLog(run_dir, enabled=result.groups.rank == 0, append=bool(args.load))
    result.guard.log = log.info
    result.guard.checkpoint_dir = args.save or args.load
    placement = None
    try:
        if args.router_skew or args.freeze_router:
            log.info(f"routers: skew {args.router_skew} (experts with low ids preferred)"
                     + (", weights frozen" if args.freeze_router else ""))
        from moe_plugin import training_placement

        placement = training_placement(result, run_dir, resumed=bool(args.load))
        memory_before = per_rank(memory_before_mb, result.engine.device)
        log.info(f"data: {data.description}")
        log.info(f"batch: global {plan.global_batch_size} = micro {plan.micro_batch_size} x accumulation "
                 f"{plan.grad_accumulation} x dp {plan.sizes.dp}")
        if log.enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "run.json").write_text(json.dumps({
                "args": vars(args), "ds_config": plan.ds_config, "world_size": world_size,
                "vocab_size": data.vocab_size, "summary": result.summary.to_dict(),
                "parameters": result.summary.parameters, "memory_before_model_mb": memory_before},
                indent=2, default=str) + "\n")
        if args.skip_train:
            return validate_only(args, plan, data, result, log)
        started = time.perf_counter()
        if train(args, plan, data, result, log, placement, exit_request) is not None:
            return ExitRequest.EXIT_STATUS   # 75: stopped early with a checkpoint (the finally below still runs)
        log.info(f"reached step {args.train_iters} in {time.perf_counter() - started:.1f} s")
        peak = per_rank(peak_memory_mb(str(result.engine.device)), result.engine.device)   # collective
        estimate = result.summary.memory_per_rank_mb["with_async_save" if args.async_save else "total"]
        if log.enabled:   # the whole run's peak beside its estimate (tests/e2e/test_memory_estimate.py reads it)
            (run_dir / "memory.json").write_text(json.dumps({"peak_memory_mb": peak, "estimate_mb": estimate,
                                                             "memory_per_rank_mb": result.summary.memory_per_rank_mb}))
        log.info(f"peak memory per rank over the run (saves included): {max(peak):,.0f} MiB, "
                 f"{max(peak) / estimate:.2f}x the run summary's estimate ({estimate:,.0f} MiB"
                 + (", its asynchronous save's copy included)" if args.async_save else ")"))
        plot = None if args.no_plot else log.plot()
        log.info(f"metrics: {log.metrics_path}" + (f"\nplot:    {plot}" if plot else ""))
    except (TrainingStopped, FloatingPointError, CheckpointError, ConfigError) as err:   # on every rank together
        return report_error(alike_on_every_rank(err))   # one line on rank 0, status 1 on every rank
    finally:
        if placement is not None:
            placement.close()
        result.close()
    return 0


if __name__ == "__main__":
    from moe_plugin import run_and_exit

    run_and_exit(main)   # not sys.exit: see moe_plugin/compat/process_exit.py
