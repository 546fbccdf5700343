#!/usr/bin/env python
"""The Hugging Face workflow end to end, on CPU, with the commands a user runs:

    python examples/hf_workflow/run.py [--work DIR] [--train-iters 4]

1. corpus: ``moe-plugin stdlib-jsonl``; tokenizer: ``moe-plugin train-tokenizer`` (a byte-level BPE
   of 384 tokens);
2. two tiny random Hugging Face models built with transformers' classes and saved with
   ``save_pretrained``, the tokenizer saved next to them: a Mixtral (8 experts, top-2) and a dense Llama;
3. ``moe-plugin preprocess`` the corpus with that tokenizer;
4. Mixtral: ``moe-plugin import-hf`` -> the example trains it on 2 ranks, ep 2
   (``deepspeed --num_gpus 2 examples/gpt_moe/pretrain_gpt_moe.py --load ... --data-path ... --tokenizer ...``
   and the flags import-hf printed) -> ``moe-plugin export-hf`` -> transformers loads it, generates a few
   tokens, and its logits are compared with the plugin's evaluation of the trained checkpoint (1 rank);
5. Llama: ``import-hf`` (the example's ``--dense`` model) -> ``moe-plugin upcycle`` (4 experts, top-2)
   -> train as in 4 -> ``export-hf --arch mixtral`` -> the same comparison.

The last line says which steps ran and the logit agreement. A failing step stops the script with
status 1, naming the step. Work goes to ``--work`` (kept) or a temporary directory (removed); every
launcher started is killed with its ranks when the script stops.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
VOCAB, SEQ = 384, 32
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-5)
MODELS = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=8,
                                                                    num_experts_per_tok=2)),
          "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64, tie_word_embeddings=True))}
UPCYCLE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "activation": "swiglu"}
TOLERANCE = 1e-5   # max |logit difference| / max |logit|, fp32


class StepFailed(Exception):
    pass


def sh(*argv: str, work: Path, log: str, env: dict | None = None) -> str:
    """Run a command in its own process group (killed with its children should this script stop);
    its output goes to WORK/logs/LOG and is returned; a non-zero status fails the step."""
    (work / "logs").mkdir(exist_ok=True)
    path = work / "logs" / f"{log}.log"
    print("$ " + " ".join(argv), flush=True)
    with open(path, "w+") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            status = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        text = out.read()
    if status != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise StepFailed(f"`{argv[0]} {argv[1] if len(argv) > 1 else ''}` exited with {status}; {path}:\n{tail}")
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the steps ------------------------------------------------------------------------------------
def build_hf_model(name: str, tokenizer_dir: Path, out: Path, seed: int) -> None:
    """A random model of transformers' own class, saved with save_pretrained, with the tokenizer."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config_cls, model_cls, fields = MODELS[name]
    config = getattr(transformers, config_cls)(**{**TINY, "vocab_size": len(tokenizer)}, **fields, bos_token_id=None,
                                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    getattr(transformers, model_cls)(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def import_flags(printed: str) -> tuple[list[str], dict]:
    """The example's flags (after ``--load CKPT``) and the completed "moe" block import-hf printed."""
    flags = re.search(r"^\s*--load \S+ (.*)$", printed, re.MULTILINE)
    block = re.search(r'^\s*"moe": (\{.*\})$', printed, re.MULTILINE)
    if flags is None:
        raise StepFailed("import-hf printed no example flags")
    return flags.group(1).split(), (json.loads(block.group(1)) if block else {})


def ds_config(moe: dict, parallel: dict, world_size: int) -> dict:
    """Global batch 4: micro-batches of 4 // world_size, ZeRO-1 (the example's configs' stage)."""
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world_size, "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": 1 if world_size > 1 else 0}, "moe": {**moe, "parallel": parallel}}


def train(work: Path, name: str, ckpt: Path, flags: list[str], moe: dict, data: Path, hf: Path, iters: int) -> Path:
    """The example on 2 CPU ranks, ep 2, from the imported checkpoint; returns its --save."""
    ds = work / f"ds-{name}.json"
    ds.write_text(json.dumps(ds_config(moe, {"expert": 2}, 2), indent=2))
    port, saved = free_port(), work / f"trained-{name}"
    try:
        sh("deepspeed", "--master_port", str(port), "--num_gpus", "2", str(EXAMPLE), "--deepspeed_config", str(ds),
           "--load", str(ckpt), *flags, "--data-path", str(data), "--tokenizer", str(hf), "--seq-length", str(SEQ),
           "--micro-batch-size", "2", "--train-iters", str(iters), "--eval-interval", "0", "--eval-iters", "1",
           "--log-interval", "1", "--valid-fraction", "0.25", "--no-plot", "--save", str(saved),
           "--run-dir", str(work / f"run-{name}"), work=work, log=f"train-{name}")
    finally:   # DeepSpeed's CPU all-reduce buffers of this port, should a rank have died before unlinking them
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
            leftover.unlink(missing_ok=True)
    return saved


def export(work: Path, trained: Path, out: Path, *extra: str) -> None:
    """``moe-plugin export-hf``: the trained checkpoint carries the imported model's tokenizer files."""
    sh("moe-plugin", "export-hf", str(trained), "--out", str(out), *extra, work=work, log=f"export-{out.name}")


def compare(work: Path, name: str, trained: Path, exported: Path, flags: list[str], moe: dict, original: Path) -> float:
    """transformers generates from the export and gives its logits; the plugin's evaluation of the
    trained checkpoint (the example's model, 1 rank) must give the same. Returns max |difference|."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    prompt = tokenizer("def main(argv):\n    ", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print(f"{name}: transformers generates {tokenizer.decode(generated[0])!r}", flush=True)
    text = (ROOT / "moe_plugin" / "__init__.py").read_text()
    tokens_BS = torch.tensor([tokenizer(text)["input_ids"][i * SEQ:(i + 1) * SEQ] for i in range(2)])
    with torch.no_grad():
        theirs = model(input_ids=tokens_BS, use_cache=False).logits.float()
        before = transformers.AutoModelForCausalLM.from_pretrained(str(original), dtype=torch.float32).eval()
        untrained = before(input_ids=tokens_BS, use_cache=False).logits.float()
    spec = work / f"eval-{name.replace('->', '-to-')}.json"
    spec.write_text(json.dumps({"ckpt": str(trained), "flags": flags, "moe": moe, "tokens": tokens_BS.tolist(),
                                "vocab": len(tokenizer),
                                "out": str(spec.with_suffix(".pt"))}))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    sh(sys.executable, str(Path(__file__).resolve()), "--evaluate", str(spec), work=work, log=spec.stem,
       env=env)
    ours = torch.load(spec.with_suffix(".pt"))
    difference = (ours - theirs).abs().max().item()
    relative = difference / theirs.abs().max().item()
    moved = ((theirs - untrained).abs().max() / untrained.abs().max()).item()
    print(f"{name}: max |logit difference| plugin vs transformers {difference:.2g} (relative {relative:.2g}); "
          f"training moved them by {moved:.3g} (relative)", flush=True)
    if relative > TOLERANCE:
        raise StepFailed(f"the logits differ: relative {relative:.3g} > {TOLERANCE}")
    if moved < 1e-3:
        raise StepFailed("the exported model gives the untrained model's logits: nothing was trained")
    return difference


def evaluate(spec_path: str) -> int:
    """(child process, 1 rank) The example's model built from the flags, the trained checkpoint's
    weights loaded; its fp32 logits of the spec's tokens saved."""
    import torch

    import moe_plugin

    spec = json.loads(Path(spec_path).read_text())
    loader = importlib.util.spec_from_file_location("pretrain_gpt_moe", EXAMPLE)
    example = importlib.util.module_from_spec(loader)
    sys.modules[loader.name] = example   # dataclasses look their module up there
    loader.loader.exec_module(example)
    args = example.parse_args([*spec["flags"], "--seq-length", str(SEQ)])
    tokens_BS = torch.tensor(spec["tokens"])
    ds = {**ds_config(spec["moe"], {}, 1), "train_batch_size": tokens_BS.shape[0],
          "train_micro_batch_size_per_gpu": tokens_BS.shape[0]}
    run = moe_plugin.initialize(ds, example.gpt_model_provider(args, spec.get("vocab", VOCAB)), args=args, seed=1,
                                print_summary=False)
    try:
        moe_plugin.load_checkpoint(run, spec["ckpt"], load_optimizer_states=False)   # any saved layout
        model = run.engine.module.eval()
        with torch.no_grad():
            logits = model(tokens_BS, torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS), None).float()
        torch.save(logits.clone(), spec["out"])
    finally:
        run.close()
    return 0


def workflow(work: Path, iters: int, corpus_bytes: int, vocab: int) -> str:
    steps: list[str] = []
    state: dict = {}
    step = stepper(steps)

    corpus, tok, data = work / "corpus.jsonl", work / "tokenizer", work / "data" / "stdlib"
    hf = {name: work / f"hf-{name}" for name in MODELS}
    step("corpus", lambda: sh("moe-plugin", "stdlib-jsonl", str(corpus), "--corpus-bytes", str(corpus_bytes),
                              work=work, log="corpus"))
    step("train-tokenizer", lambda: sh("moe-plugin", "train-tokenizer", "--input", str(corpus), "--out", str(tok),
                                       "--vocab-size", str(vocab), work=work, log="tokenizer"))
    step("tiny HF models", lambda: [build_hf_model(name, tok, path, seed) for seed, (name, path) in
                                    enumerate(hf.items())])
    step("preprocess", lambda: sh("moe-plugin", "preprocess", "--input", str(corpus), "--tokenizer", str(hf["mixtral"]),
                                  "--output-prefix", str(data), "--workers", "1", "--no-progress", work=work,
                                  log="preprocess"))
    # Mixtral: import, train, export, compare
    import_ds = work / "ds-import-mixtral.json"
    import_ds.write_text(json.dumps({"moe": {"num_experts": 8, "parallel": {"expert": 2}}}))

    def import_mixtral():
        printed = sh("moe-plugin", "import-hf", str(hf["mixtral"]), "--config", str(import_ds), "--out",
                     str(work / "ckpt-mixtral"), work=work, log="import-mixtral")
        state["mixtral"] = import_flags(printed)
        print("   flags: " + " ".join(state["mixtral"][0]), flush=True)

    step("import-hf mixtral", import_mixtral)
    step("train mixtral (2 ranks, ep2)", lambda: state.update(
        trained_mixtral=train(work, "mixtral", work / "ckpt-mixtral", *state["mixtral"], data, hf["mixtral"], iters)))
    step("export-hf mixtral", lambda: export(work, state["trained_mixtral"], work / "out-mixtral"))
    step("transformers vs plugin (mixtral)", lambda: state.update(mixtral_diff=compare(
        work, "mixtral", state["trained_mixtral"], work / "out-mixtral", *state["mixtral"], hf["mixtral"])))
    # dense Llama: import, upcycle, train, export as Mixtral, compare
    moe_ds = work / "ds-upcycle.json"
    moe_ds.write_text(json.dumps({"moe": {**UPCYCLE, "parallel": {"expert": 2}}}))

    def import_llama():
        printed = sh("moe-plugin", "import-hf", str(hf["llama"]), "--config", str(moe_ds), "--out",
                     str(work / "ckpt-llama"), work=work, log="import-llama")
        flags, _block = import_flags(printed)
        state["llama"] = ([f for f in flags if f != "--dense"], UPCYCLE)   # the upcycled model: MoE

    step("import-hf llama (dense)", import_llama)
    step("upcycle", lambda: sh("moe-plugin", "upcycle", str(work / "ckpt-llama"), "--config", str(moe_ds), "--out",
                               str(work / "ckpt-upcycled"), work=work, log="upcycle"))
    step("train upcycled llama (2 ranks, ep2)", lambda: state.update(
        trained_llama=train(work, "llama", work / "ckpt-upcycled", *state["llama"], data, hf["llama"], iters)))
    step("export-hf --arch mixtral", lambda: export(work, state["trained_llama"], work / "out-llama-mixtral",
                                                    "--arch", "mixtral"))
    step("transformers vs plugin (llama->mixtral)", lambda: state.update(llama_diff=compare(
        work, "llama->mixtral", state["trained_llama"], work / "out-llama-mixtral", *state["llama"], hf["llama"])))
    return (f"workflow: {len(steps)}/{len(steps)} steps ran; mixtral logits max|diff| {state['mixtral_diff']:.1e}, "
            f"llama->mixtral {state['llama_diff']:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="work directory (kept); default: a temporary one, removed")
    parser.add_argument("--train-iters", type=int, default=4, help="training steps of each model")
    parser.add_argument("--vocab-size", type=int, default=VOCAB, help="the tokenizer's and the models' vocabulary "
                        f"(default {VOCAB}: a multiple of 128, the example pads the vocabulary to one)")
    parser.add_argument("--corpus-bytes", type=int, default=512 * 1024, help="size cap of the stdlib corpus")
    parser.add_argument("--evaluate", default=None, help=argparse.SUPPRESS)   # the child of the comparison steps
    args = parser.parse_args(argv)
    if args.evaluate:
        return evaluate(args.evaluate)
    return run_in_work(args.work, "moe-hf-workflow-", "workflow",
                       lambda work: workflow(work, args.train_iters, args.corpus_bytes, args.vocab_size))


def stepper(steps: list[str]):
    """``step(name, action)``: runs ``action`` as the next numbered step, timed; its error names the step."""
    def step(name: str, action) -> None:
        print(f"\n== step {len(steps) + 1}: {name}", flush=True)
        started = time.perf_counter()
        try:
            action()
        except Exception as err:   # the step's own error, named
            raise StepFailed(f"step {len(steps) + 1} ({name}) failed: {err}") from err
        steps.append(name)
        print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)

    return step


def run_in_work(work_arg: str | None, prefix: str, label: str, body) -> int:
    """``body(work)`` in ``work_arg`` (kept) or a temporary directory (removed); its last line printed, or
    its ``StepFailed`` as ``LABEL: ...`` on stderr with status 1. SIGTERM ends it through the same cleanup."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the finally blocks below kill what runs, remove files
    work = Path(work_arg) if work_arg else Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        last = body(work.resolve())
    except StepFailed as err:
        print(f"\n{label}: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        if work_arg is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + last, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
