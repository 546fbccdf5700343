"""Hugging Face checkpoints in and out (``moe_plugin/interop``, ``moe-plugin import-hf`` / ``export-hf``).

Tiny random models of every architecture are built with transformers' own classes and saved with
``save_pretrained`` (``hf_tiny.py``: Mixtral; Qwen3-MoE with QK-norm, renormalised gates and heads
of 32 over a hidden size of 64; Qwen2-MoE with its sigmoid-gated shared expert, QKV bias and
unnormalised gates; a dense tied Llama). Each is imported with the "moe" block holding only
``num_experts`` (the rest filled in from config.json), and:

* HF -> plugin -> HF gives bit-identical tensors (export in shards of 100 KB, with their index),
  which transformers loads with no missing or unexpected key;
* the plugin model, built by the example from the flags the import printed (its own provider,
  ``moe_plugin.initialize``, ``load_checkpoint``), gives transformers' fp32 logits on the same tokens
  (max difference / max |logit| <= 1e-5) at 1 rank, tp2 x ep2 and pp2 x ep2 (the PipelineEngine's
  last stage); the dense Llama at 1 rank and tp2, and upcycled (4 experts top-2, dropless) under
  every layout: the dense model's logits;
* what the plugin cannot represent is refused before anything is written, naming the key and the
  model type; a "moe" block that disagrees is refused naming both keys; a load with other flags is
  refused naming the flag.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hf_tiny import EXPERTS, VOCAB, hf_logits, save_tiny_model, save_tiny_models
from test_example import _script

SEQ, BATCH = 16, 4
TOLERANCE = 1e-5
UPCYCLE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "activation": "swiglu"}
LAYOUTS = {"ep1": (1, {}), "tp2-ep2": (4, {"tensor": 2, "expert": 2}), "pp2-ep2": (4, {"pipeline": 2, "expert": 2})}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# -- inside the ranks ------------------------------------------------------------------------------
def _ds(moe: dict, parallel: dict, dp: int) -> dict:
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // dp, "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 0}, "moe": {**moe, "parallel": parallel}}


def _plugin_logits(case: dict, parallel: dict, world_size: int, tokens_BS: torch.Tensor):
    """The example's model of ``case`` (its flags), loaded from its checkpoint: this rank's full logits
    [B, S, V] (None where a pipeline stage has none; the rows of its data-parallel replica under pp)."""
    import torch.distributed as dist

    import moe_plugin

    example = _script()
    args = example.parse_args([*case["flags"], "--seq-length", str(SEQ)])
    tp, pp = parallel.get("tensor", 1), parallel.get("pipeline", 1)
    dp = world_size // (tp * pp)
    provider = example.gpt_pipeline_provider if pp > 1 else example.gpt_model_provider
    run = moe_plugin.initialize(_ds(case["moe"], parallel, dp), provider(args, VOCAB), args=args, seed=1,
                                print_summary=False)
    try:
        moe_plugin.load_checkpoint(run, case["ckpt"])
        positions_BS = torch.arange(SEQ).expand(BATCH, SEQ)
        if pp > 1:
            rows = slice(run.groups.rank_in("dp") * BATCH // dp, (run.groups.rank_in("dp") + 1) * BATCH // dp)
            batch = ((tokens_BS[rows].contiguous(), positions_BS[rows].contiguous()), tokens_BS[rows].contiguous())
            _loss, logits_SBV = run.engine.eval_batch(iter([batch]), return_logits=True)
            return None if logits_SBV is None else (rows.start, logits_SBV.transpose(0, 1).float().clone())
        model = run.engine.module
        model.eval()
        with torch.no_grad():
            logits_BSV = model(tokens_BS, positions_BS, None).float()
        if tp > 1:   # the output layer's vocabulary shards
            parts = [torch.empty_like(logits_BSV) for _ in range(tp)]
            dist.all_gather(parts, logits_BSV.contiguous(), group=run.groups.tp)
            logits_BSV = torch.cat(parts, dim=-1)
        return 0, logits_BSV.clone()
    finally:
        run.close()


def _child(rank: int, world_size: int, cases: dict, parallel: dict, tokens_BS: torch.Tensor) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    return {name: _plugin_logits(case, parallel, world_size, tokens_BS) for name, case in cases.items()}


# -- the models, in the parent ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{name: {"hf", "ckpt", "flags", "moe", "logits"}}, the tokens, the root."""
    from moe_plugin.checkpoint import upcycle_checkpoint
    from moe_plugin.interop import import_hf

    root = tmp_path_factory.mktemp("hf")
    tokens_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    cases = {}
    for name, path in save_tiny_models(root / "hf").items():
        done = import_hf(path, {"moe": {"num_experts": EXPERTS}}, root / f"ckpt-{name}", progress=lambda line: None)
        print(f"import-hf {name}: {done.seconds:.2f} s")
        cases[name] = {"hf": path, "ckpt": str(root / f"ckpt-{name}"), "flags": list(done.flags), "moe": done.moe_block,
                       "logits": hf_logits(path, tokens_BS)}
    dense = cases["llama"]
    upcycle_checkpoint(dense["ckpt"], {"moe": UPCYCLE}, root / "ckpt-llama-upcycled", progress=lambda line: None)
    cases["llama-upcycled"] = {**dense, "ckpt": str(root / "ckpt-llama-upcycled"), "moe": UPCYCLE,
                               "flags": [f for f in dense["flags"] if f != "--dense"]}
    return root, tokens_BS, cases


def _check_logits(results: list, cases: dict, names: list[str], layout: str) -> None:
    for name in names:
        seen = 0
        for rank, result in enumerate(results):
            if result[name] is None:
                continue
            first, logits_BSV = result[name]
            expected = cases[name]["logits"][first:first + logits_BSV.shape[0]]
            difference = _relative(logits_BSV, expected)
            print(f"{layout} {name} rank {rank}: max |logit difference| / max |logit| = {difference:.3g}")
            assert difference <= TOLERANCE, f"{layout}, {name}, rank {rank}: {difference:.3g}"
            seen += logits_BSV.shape[0]
        assert seen >= BATCH, f"{layout}, {name}: logits of {seen} rows came back"


def test_one_rank_gives_transformers_logits(imported, tmp_path):
    from dist import run_distributed

    _root, tokens_BS, cases = imported
    names = list(cases)
    world_size, parallel = LAYOUTS["ep1"]
    results = run_distributed(_child, world_size, tmp_path, {n: cases[n] for n in names}, parallel, tokens_BS,
                              timeout=300)
    _check_logits(results, cases, names, "ep1")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-ep2", "pp2-ep2"])
def test_layouts_give_transformers_logits(imported, tmp_path, layout):
    from dist import run_distributed

    _root, tokens_BS, cases = imported
    names = [n for n in cases if not (layout.startswith("pp") and n == "llama")]   # --dense runs without pp
    world_size, parallel = LAYOUTS[layout]
    results = run_distributed(_child, world_size, tmp_path, {n: cases[n] for n in names}, parallel, tokens_BS,
                              timeout=400)
    _check_logits(results, cases, names, layout)


def test_round_trip_is_bit_identical_and_loads_in_transformers(imported, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from moe_plugin.interop import export_hf

    _root, tokens_BS, cases = imported
    for name in ("mixtral", "qwen3_moe", "qwen2_moe", "llama"):
        out = tmp_path / name
        done = export_hf(cases[name]["ckpt"], out, max_shard_size="100KB", progress=lambda line: None)
        print(f"export-hf {name}: {done['seconds']:.2f} s, {len(done['files'])} files")
        assert (out / "model.safetensors.index.json").is_file()
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        original = load_file(str(Path(cases[name]["hf"]) / "model.safetensors"))
        exported = {}
        for shard in sorted(set(index.values())):
            assert (out / shard).stat().st_size < 100_000 + 70_000   # one tensor may pass the bound alone
            exported.update(load_file(str(out / shard)))
        assert sorted(exported) == sorted(original) == sorted(index), name
        for key, tensor in original.items():
            assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), (name, key)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        assert type(model).__name__ == transformers.AutoConfig.from_pretrained(cases[name]["hf"]).architectures[0]


# -- refusals --------------------------------------------------------------------------------------
def _nothing_written(path: Path) -> bool:
    return not path.exists() or not any(p.is_file() and not p.name.startswith(".") for p in path.rglob("*"))


@pytest.mark.parametrize("name, overrides, key", [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters.rope_type"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"attention_bias": True}, "attention_bias"),
])
def test_what_the_plugin_cannot_represent_is_refused_naming_the_key(tmp_path, name, overrides, key):
    from moe_plugin.configs import ConfigError
    from moe_plugin.interop import import_hf

    hf = save_tiny_model(name, str(tmp_path / "hf"), **overrides)
    with pytest.raises(ConfigError, match=f"{key}.*model_type {name}"):
        import_hf(hf, {"moe": {"num_experts": EXPERTS}}, tmp_path / "ckpt", progress=lambda line: None)
    assert _nothing_written(tmp_path / "ckpt")


def test_unknown_model_type_and_left_over_tensor_are_refused(imported, tmp_path):
    from safetensors.torch import load_file, save_file

    from moe_plugin.checkpoint import CheckpointError
    from moe_plugin.configs import ConfigError
    from moe_plugin.interop import import_hf

    _root, _tokens, cases = imported
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((Path(cases["mixtral"]["hf"]) / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    with pytest.raises(ConfigError, match="model_type: got 'deepseek_v3'; the plugin imports mixtral"):
        import_hf(hf, {"moe": {"num_experts": EXPERTS}}, tmp_path / "ckpt")
    (hf / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(Path(cases["mixtral"]["hf"]) / "model.safetensors"))
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, str(hf / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.o_proj.bias' has no place in the plugin's "
                                              "mixtral model"):
        import_hf(hf, {"moe": {"num_experts": EXPERTS}}, tmp_path / "ckpt")
    assert _nothing_written(tmp_path / "ckpt")


def test_a_moe_block_that_disagrees_is_refused_naming_both_keys(imported, tmp_path):
    from moe_plugin.configs import ConfigError
    from moe_plugin.interop import import_hf

    _root, _tokens, cases = imported
    for block, match in (({"num_experts": 4}, r"moe.num_experts: got 4; .*num_local_experts = 8"),
                         ({"num_experts": 8, "router": "topk", "top_k": 2, "normalize_gates": True},
                          r"moe.normalize_gates: got True; .*qwen2_moe\) has norm_topk_prob = false"),
                         ({"num_experts": 8, "drop_tokens": True}, r"moe.drop_tokens: .*drops no token")):
        name = "qwen2_moe" if "normalize_gates" in block else "mixtral"
        with pytest.raises(ConfigError, match=match):
            import_hf(cases[name]["hf"], {"moe": block}, tmp_path / "ckpt")
        assert _nothing_written(tmp_path / "ckpt")


def test_export_refuses_what_the_architecture_cannot_express(imported, tmp_path):
    from moe_plugin.configs import ConfigError
    from moe_plugin.interop import export_hf

    _root, _tokens, cases = imported
    for name, arch, match in (("qwen2_moe", "mixtral", "add_qkv_bias: got True; MixtralForCausalLM cannot express"),
                              ("qwen3_moe", "mixtral", "qk_layernorm: got True; MixtralForCausalLM"),
                              ("mixtral", "qwen2_moe", "moe.shared_expert_ffn_hidden_size: got 0; Qwen2MoeForCausal"),
                              ("llama-upcycled", "qwen3_moe", "qk_layernorm: got False; Qwen3MoeForCausalLM")):
        with pytest.raises(ConfigError, match=match):
            export_hf(cases[name]["ckpt"], tmp_path / "out", arch=arch, progress=lambda line: None)
        assert _nothing_written(tmp_path / "out")
