"""A Megatron-Core GPT trained by the DeepSpeed engine: the loop of docs/porting.md, before the port
(train_plain_mcore.py) and after it (train_simple_mcore.py, the plugin's MoE layers). The data are
synthetic: every sample counts up from a random token by a random stride (mod the vocabulary), and
step s trains on a global batch drawn from seed s, whatever the layout.
"""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

import moe_plugin

SEED, VOCAB, SEQ = 1234, 128, 32


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-at", type=int, default=None, help="also save after this step")
    parser.add_argument("--load", default=None)
    parser.add_argument("--load-tag", default=None, help="default: the latest checkpoint")
    parser.add_argument("--losses", default=None, help="write {step: loss} here (rank 0)")
    parser.add_argument("--local_rank", type=int, default=0)
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def transformer_config(tp_size):
    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        tensor_model_parallel_size=tp_size, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)


def model_provider(moe_config, groups):
    config = transformer_config(parallel_state.get_tensor_model_parallel_world_size())
    torch.manual_seed(SEED)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    spec = moe_plugin.gpt_moe_spec(moe_config, config, groups)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def get_batch(step, rows, device):
    """Rows ``rows`` of step ``step``'s global batch: (tokens, position ids, labels)."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(VOCAB, (rows.stop, 1), generator=gen)[rows]
    stride = torch.randint(1, 4, (rows.stop, 1), generator=gen)[rows]
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    return tokens[:, :-1].to(device), positions.to(device), tokens[:, 1:].to(device)


def main():
    args = parse_args()
    deepspeed.init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
    run = moe_plugin.initialize(args.deepspeed_config, model_provider, args=args)
    engine = run.engine
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    start = 0
    if args.load:
        _, client_state = moe_plugin.load_checkpoint(run, args.load, tag=args.load_tag)
        start = client_state["step"]
    losses = {}
    for step in range(start, args.steps):
        step_loss = torch.zeros((), device=engine.device)
        for m in range(gas):
            first = (dp_rank * gas + m) * micro
            tokens, positions, labels = get_batch(step, slice(first, first + micro), engine.device)
            loss = engine(tokens, positions, None, labels=labels).mean()
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / gas
        if dp_size > 1:
            dist.all_reduce(step_loss, group=dp_group)
        losses[step + 1] = step_loss.item() / dp_size
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {losses[step + 1]:.6f}", flush=True)
        if args.save and step + 1 in (args.save_at, args.steps):
            moe_plugin.save_checkpoint(run, args.save, tag=f"step{step + 1}", client_state={"step": step + 1})
    if args.losses and dist.get_rank() == 0:
        with open(args.losses, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
    moe_plugin.exit_process(0)   # destroys the process groups; not sys.exit (compat/process_exit.py)
