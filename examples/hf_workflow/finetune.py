#!/usr/bin/env python
"""Fine-tune an imported MoE on conversations, end to end, on CPU, with the commands a user runs:

    python examples/hf_workflow/finetune.py [--work DIR] [--train-iters 12]

1. a tiny random Qwen3-MoE of transformers' class with a ChatML chat template (a word-level tokenizer
   whose ``<|im_start|>`` / ``<|im_end|>`` are special tokens), saved with ``save_pretrained``; chats
   (``messages``: a system prompt for some, one or two user/assistant turns of a word-reversing task)
   for training and held out;
2. ``moe-plugin import-hf`` -> ``moe-plugin preprocess --chat`` of both sets (tokens and assistant-only
   loss masks) -> the example fine-tunes on 4 ranks, ep 2 (``deepspeed --num_gpus 4
   examples/gpt_moe/pretrain_gpt_moe.py --load CKPT --finetune`` and the flags import-hf printed),
   packed conversations -> ``--skip-train --valid-data-path`` on 2 ranks: the plugin's validation loss
   -> ``moe-plugin export-hf``;
3. transformers' assistant-token loss over the held-out chats, before (the original model) and after
   (the export): it must fall and equal the plugin's validation loss (fp32, 1e-5 relative).

The last line gives both losses and the agreement; a failing step stops the script with status 1,
naming it. Work goes to ``--work`` (kept) or a temporary directory (removed).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import EXAMPLE, StepFailed, export, free_port, import_flags, run_in_work, sh, stepper  # noqa: E402

WORDS, SEQ = 121, 64   # 121 words + <unk>, 3 roles, "reverse" and 2 markers: 128 tokens (the example's multiple)
SPECIAL = ["<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
CHATML = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
QWEN3_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 moe_intermediate_size=32, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, max_position_embeddings=SEQ, initializer_range=0.1, rms_norm_eps=1e-6)
TOLERANCE = 1e-5


def build_model(out: Path, seed: int = 0) -> None:
    """The tokenizer (words w0.., the roles, the two markers) and a random Qwen3-MoE, saved together."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", *ROLES, "reverse", *(f"w{i}" for i in range(WORDS))]
    vocab = {word: i for i, word in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL, "eos_token": "<|im_end|>"})
    tokenizer.chat_template = CHATML
    config = transformers.Qwen3MoeConfig(vocab_size=len(tokenizer), **QWEN3_MOE, bos_token_id=None,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def write_chats(path: Path, count: int, seed: int) -> None:
    """``count`` conversations of the reversing task, one JSON object per line."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(count):
            messages = [{"role": "system", "content": "reverse"}] if rng.random() < 0.3 else []
            for _turn in range(rng.choice([1, 1, 2])):
                words = [f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(2, 6))]
                messages += [{"role": "user", "content": "reverse " + " ".join(words)},
                             {"role": "assistant", "content": " ".join(reversed(words))}]
            out.write(json.dumps({"messages": messages}) + "\n")


def ds_config(moe: dict, parallel: dict, world_size: int, iters: int) -> dict:
    """Global batch 8 packs, AdamW with DeepSpeed's warmup and cosine decay over the run."""
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world_size, "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 6, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": iters, "warmup_num_steps": 2,
                                                               "cos_min_ratio": 0.1}},
            "zero_optimization": {"stage": 1}, "moe": {**moe, "parallel": parallel}}


def launch(work: Path, name: str, ranks: int, ds: dict, *flags: str) -> str:
    """The example under the deepspeed launcher on ``ranks`` CPU ranks; returns what it printed."""
    path = work / f"ds-{name}.json"
    path.write_text(json.dumps(ds, indent=2))
    port = free_port()
    try:
        return sh("deepspeed", "--master_port", str(port), "--num_gpus", str(ranks), str(EXAMPLE), "--deepspeed_config",
                  str(path), *flags, "--run-dir", str(work / f"run-{name}"), "--no-plot", work=work, log=name)
    finally:   # DeepSpeed's CPU all-reduce buffers of this port, should a rank have died before unlinking them
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
            leftover.unlink(missing_ok=True)


def transformers_loss(model_dir: Path, data_prefix: Path) -> float:
    """transformers' mean cross entropy over the assistant tokens (the loss mask of ``preprocess --chat``)
    of every conversation at ``data_prefix``, each run alone."""
    import torch
    import transformers

    from moe_plugin.data import read_chat_dataset

    tokens, mask = read_chat_dataset(data_prefix)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(tokens)):
            ids = torch.from_numpy(tokens[i].astype("int64"))[None]
            weight = torch.from_numpy(mask[i][1:].astype("float64"))
            logits = model(input_ids=ids, use_cache=False).logits.double()[0, :-1]
            losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            total += float((losses * weight).sum())
            count += int(weight.sum())
    return total / count


def workflow(work: Path, iters: int) -> str:
    steps, state = [], {}
    step = stepper(steps)

    hf, ckpt, data = work / "hf-qwen3-moe", work / "ckpt", work / "data"
    data.mkdir(exist_ok=True)
    step("tiny Qwen3-MoE with a chat template", lambda: build_model(hf))
    step("chats", lambda: (write_chats(work / "train.jsonl", 160, 1), write_chats(work / "held.jsonl", 24, 2)))
    (work / "ds-import.json").write_text(json.dumps({"moe": {"num_experts": 8, "parallel": {"expert": 2}}}))

    def import_hf():
        printed = sh("moe-plugin", "import-hf", str(hf), "--config", str(work / "ds-import.json"), "--out", str(ckpt),
                     work=work, log="import")
        state["flags"], state["moe"] = import_flags(printed)
        print("   flags: " + " ".join(state["flags"]), flush=True)

    step("import-hf", import_hf)
    for name in ("train", "held"):
        step(f"preprocess --chat {name}", lambda name=name: sh(
            "moe-plugin", "preprocess", "--chat", "--input", str(work / f"{name}.jsonl"), "--tokenizer", str(hf),
            "--output-prefix", str(data / name), "--workers", "1", "--no-progress", work=work, log=f"preprocess-{name}"))
    common = [*state.get("flags", []), "--seq-length", str(SEQ), "--conversation-overflow", "refuse",
              "--valid-data-path", str(data / "held"), "--data-path", str(data / "train")]
    step("fine-tune (4 ranks, ep2)", lambda: state.update(trained=launch(
        work, "finetune", 4, ds_config(state["moe"], {"expert": 2}, 4, iters), "--load", str(ckpt), "--finetune",
        *common, "--train-iters", str(iters), "--eval-interval", "0", "--log-interval", "4",
        "--save", str(work / "trained"))))

    def skip_train():
        printed = launch(work, "validate", 2, ds_config(state["moe"], {"expert": 2}, 2, iters), "--load",
                         str(work / "trained"), *common, "--skip-train")
        state["plugin"] = float(re.findall(r"validation loss (\S+)", printed)[-1])

    step("--skip-train on the held-out chats (2 ranks)", skip_train)
    step("export-hf", lambda: export(work, work / "trained", work / "out"))

    def compare():
        state["before"] = transformers_loss(hf, data / "held")
        state["after"] = transformers_loss(work / "out", data / "held")
        state["relative"] = abs(state["after"] - state["plugin"]) / state["after"]
        print(f"   transformers' assistant-token loss {state['before']:.6f} -> {state['after']:.6f}; the plugin's "
              f"{state['plugin']:.6f} (relative difference {state['relative']:.1e})", flush=True)
        if state["relative"] > TOLERANCE:
            raise StepFailed(f"the plugin's validation loss {state['plugin']} and transformers' {state['after']} differ")
        if not state["after"] < state["before"]:
            raise StepFailed("fine-tuning did not lower the held-out loss")

    step("transformers' held-out loss", compare)
    return (f"fine-tuning: {len(steps)}/{len(steps)} steps ran; held-out assistant-token loss {state['before']:.6f} -> "
            f"{state['after']:.6f}, plugin {state['plugin']:.6f} (relative difference {state['relative']:.1e})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="work directory (kept); default: a temporary one, removed")
    parser.add_argument("--train-iters", type=int, default=12, help="fine-tuning steps")
    args = parser.parse_args(argv)
    return run_in_work(args.work, "moe-finetune-", "fine-tuning", lambda work: workflow(work, args.train_iters))


if __name__ == "__main__":
    sys.exit(main())
