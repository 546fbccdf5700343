"""Hugging Face checkpoints in and out (``moe_plugin/interop``, ``moe-plugin import-hf`` / ``export-hf``).

Tiny random models of every architecture are built with transformers' own classes and saved with
``save_pretrained`` (``hf_tiny.py``: Mixtral; Qwen3-MoE with QK-norm, renormalised gates and heads
of 32 over a hidden size of 64; Qwen2-MoE with its sigmoid-gated shared expert, QKV bias and
unnormalised gates; OLMoE with QK-norm over the whole projections and unnormalised gates; GLM-4.5 with
sigmoid scores, a non-zero correction bias, 2 of 4 groups, scaled gates, a dense first layer, an
ungated shared expert, QKV bias, QK-norm and half the head rotated; a Qwen3-MoE with YaRN (4 x an
original context of 8, so the tests' 16 tokens run past it); DeepSeek-V3 with multi-latent attention
(a low-rank query, YaRN with both mscales, DeepSeek routing), the same with rope_interleave false, and
a DeepSeek-V2-Lite-shaped model (full query projection, group_limited_greedy); a dense tied Llama; a
dense untied Qwen3 with QK-norm and heads of 32; a dense untied Mistral without sliding window; sliding
windows: a Mixtral with a window of 6, a dense Mistral with 5, a dense Qwen3 whose layer 1 has a window
of 4; a GPT-OSS with attention sinks, biases on q/k/v/o, the router and the experts, the clamped SwiGLU,
fused experts, a window of 4 on layer 0 and YaRN; and the same GPT-OSS in bf16 with MXFP4 experts). Each
is imported with the "moe" block holding only
``num_experts`` (the rest filled in from config.json), and:

* HF -> plugin -> HF gives bit-identical tensors (export in shards of 100 KB, with their index),
  which transformers loads with no missing or unexpected key;
* the plugin model, built by the example from the flags the import printed (its own provider,
  ``moe_plugin.initialize``, ``load_checkpoint``), gives transformers' fp32 logits on the same tokens
  (max difference / max |logit| <= 1e-5) at 1 rank, tp2 x ep2 and pp2 x ep2 (the PipelineEngine's
  last stage); the dense models at 1 rank and tp2, and upcycled (4 experts top-2, dropless) under
  every layout: the dense model's logits (the upcycled Qwen3 exported as Qwen3-MoE too);
* the imported Mixtral trained 2 steps by the example under dp2 x ep2 (ZeRO-1) and exported gives in
  transformers the plugin's logits of the saved checkpoint, with the import's tokenizer files, config
  keys and dtype; bf16 and sharded directories round-trip; the tokenizer files are carried over;
* what the plugin cannot represent is refused before anything is written, naming the key and the
  model type; a "moe" block that disagrees is refused naming both keys; a load with other flags is
  refused naming the flag; what an export's architecture cannot express is refused naming it.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from launcher import REPO
from hf_tiny import EXPERTS, MODELS, VOCAB, hf_logits, save_tiny_model, save_tiny_models
from example_runs import example_script
from ds_json import ds_config

SEQ, BATCH = 16, 4
TOLERANCE = 1e-5
DENSE = ("llama", "qwen3", "mistral")
UPCYCLE = {"num_experts": 4, "router": "topk", "top_k": 2, "drop_tokens": False, "activation": "swiglu"}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# -- inside the ranks ------------------------------------------------------------------------------
def _ds(moe: dict, parallel: dict, dp: int) -> dict:
    return ds_config(batch=BATCH, dp=dp, gas=1, clip=None, zero=0, moe=moe, parallel=parallel,
                     optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})


def _plugin_logits(case: dict, parallel: dict, world_size: int, tokens_BS: torch.Tensor, reads: dict = None):
    """The example's model of ``case`` (its flags), loaded from its checkpoint: this rank's full logits
    [B, S, V] (None where a pipeline stage has none; the rows of its data-parallel replica under pp).
    ``reads``: filled with {file name: bytes the load read from it} (the safetensors reads counted)."""
    import torch.distributed as dist

    import moe_plugin
    from moe_plugin.checkpoint.tensor_files import TensorFile, nbytes

    real = TensorFile._read

    def counted(self, name, begin, dtype, shape):
        key = os.path.basename(self.path)
        if reads is not None:
            reads[key] = reads.get(key, 0) + nbytes(dtype, shape)
        return real(self, name, begin, dtype, shape)

    example = example_script()
    args = example.parse_args([*case["flags"], "--seq-length", str(SEQ)])
    tp, pp = parallel.get("tensor", 1), parallel.get("pipeline", 1)
    dp = world_size // (tp * pp)
    provider = example.gpt_pipeline_provider if pp > 1 else example.gpt_model_provider
    run = moe_plugin.initialize(_ds(case["moe"], parallel, dp), provider(args, VOCAB), args=args, seed=1,
                                print_summary=False)
    try:
        TensorFile._read = counted
        try:
            moe_plugin.load_checkpoint(run, case["ckpt"], load_optimizer_states=False)   # weights: any saved layout
        finally:
            TensorFile._read = real
        positions_BS = torch.arange(SEQ).expand(BATCH, SEQ)
        if pp > 1:
            rows = slice(run.groups.rank_in("dp") * BATCH // dp, (run.groups.rank_in("dp") + 1) * BATCH // dp)
            batch = ((tokens_BS[rows].contiguous(), positions_BS[rows].contiguous()), tokens_BS[rows].contiguous())
            # compute_loss False: Megatron's vocab-parallel cross entropy works on the logits in place
            _logits, logits_SBV = run.engine.eval_batch(iter([batch]), return_logits=True, compute_loss=False)
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


def _child(rank: int, world_size: int, cases: dict, layouts: dict, tokens_BS: torch.Tensor) -> dict:
    """{layout: {case: _plugin_logits, or the CheckpointError's text for a case marked "refused"}}."""
    from moe_plugin import CheckpointError

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out: dict = {"reads": {}}
    for layout, parallel in layouts.items():
        out[layout] = {}
        for name, case in cases.items():
            if layout.startswith("pp") and "--dense" in case["flags"]:   # the example's --dense runs without pp
                continue
            if not case.get("refused"):
                reads = out["reads"].setdefault(layout, {}).setdefault(name, {})
                out[layout][name] = _plugin_logits(case, parallel, world_size, tokens_BS, reads)
                continue
            try:
                _plugin_logits(case, parallel, world_size, tokens_BS)
                out[layout][name] = "loaded"
            except CheckpointError as err:
                out[layout][name] = str(err)
    return out


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
    for name in DENSE:
        dense = cases[name]
        upcycle_checkpoint(dense["ckpt"], {"moe": UPCYCLE}, root / f"ckpt-{name}-upcycled", progress=lambda line: None)
        cases[f"{name}-upcycled"] = {**dense, "ckpt": str(root / f"ckpt-{name}-upcycled"), "moe": UPCYCLE,
                                     "flags": [f for f in dense["flags"] if f != "--dense"]}
    return root, tokens_BS, cases


def _check_logits(results: list, cases: dict, layout: str) -> None:
    for name in results[0][layout]:
        if cases[name].get("refused"):
            continue
        seen = 0
        for rank, result in enumerate(results):
            if result[layout][name] is None:
                continue
            first, logits_BSV = result[layout][name]
            expected = cases[name]["logits"][first:first + logits_BSV.shape[0]]
            difference = _relative(logits_BSV, expected)
            print(f"{layout} {name} rank {rank}: max |logit difference| / max |logit| = {difference:.3g}")
            assert difference <= TOLERANCE, f"{layout}, {name}, rank {rank}: {difference:.3g}"
            seen += logits_BSV.shape[0]
        assert seen >= BATCH, f"{layout}, {name}: logits of {seen} rows came back"


@pytest.mark.slow   # a spawned rank
def test_one_rank_gives_transformers_logits(imported, tmp_path):
    from dist import run_distributed

    _root, tokens_BS, cases = imported
    flags = cases["mixtral"]["flags"]   # the checkpoint's RoPE base, built with the default one instead
    other = flags[:flags.index("--rotary-base")] + flags[flags.index("--rotary-base") + 2:]
    cases = {**cases, "other-flags": {**cases["mixtral"], "flags": other, "refused": True}}
    results = run_distributed(_child, 1, tmp_path, cases, {"ep1": {}}, tokens_BS, timeout=300)
    _check_logits(results, cases, "ep1")
    assert "rotary_base is 1000000.0 in the checkpoint but 10000 in the model (the example's --rotary-base" in \
        results[0]["ep1"]["other-flags"], results[0]["ep1"]["other-flags"]


@pytest.mark.slow
def test_layouts_give_transformers_logits(imported, tmp_path):
    """tp2 x ep2 and pp2 x ep2 in one 4-rank spawn."""
    from dist import run_distributed

    _root, tokens_BS, cases = imported
    layouts = {"tp2-ep2": {"tensor": 2, "expert": 2}, "pp2-ep2": {"pipeline": 2, "expert": 2}}
    results = run_distributed(_child, 4, tmp_path, cases, layouts, tokens_BS, timeout=400)
    for layout in layouts:
        _check_logits(results, cases, layout)
    _check_reads(results, cases)


def _check_reads(results: list, cases: dict) -> None:
    """Under tp2 x ep2 (ranks 0, 1: EP rank 0; 2, 3: EP rank 1, each holding half the experts) each rank
    reads the files of its own experts only, and of the dense file about its half: the tensors cut
    along dim 0 as just its rows (the row-parallel ones and those every TP rank holds, whole)."""
    from moe_plugin.checkpoint.tensor_files import TensorFile

    for name, case in cases.items():
        if case.get("refused") or "--dense" in case["flags"]:
            continue
        with TensorFile(os.path.join(case["ckpt"], "step0", "model", "dense_pp_00_tp_00.safetensors")) as f:
            dense = sum(math.prod(f.spec(k)[1]) for k in f.names())
            split = sum(math.prod(f.spec(k)[1]) for k in f.names() if any(  # column-parallel and vocab-parallel
                part in k for part in ("linear_qkv.", "linear_fc1.", "word_embeddings.", "output_layer.")))
        for rank, result in enumerate(results):
            reads = result["reads"]["tp2-ep2"][name]
            experts = sorted(int(f[7:12]) for f in reads if f.startswith("expert_"))
            half = case["moe"]["num_experts"] // 2
            mine = list(range(half)) if rank < 2 else list(range(half, 2 * half))
            assert experts == mine, f"{name}, rank {rank}: read the files of experts {experts}, holds {mine}"
            read = reads["dense_pp_00_tp_00.safetensors"] / 4   # fp32 elements
            assert read <= dense - split / 2 + 0.01 * dense, \
                f"{name}, rank {rank}: read {read:.0f} of the dense file's {dense} elements ({split} split by TP)"


def test_round_trip_is_bit_identical_and_loads_in_transformers(imported, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from moe_plugin.interop import export_hf

    _root, tokens_BS, cases = imported
    for name in MODELS:   # every tiny model: each registered family and its variants
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
        carried = sorted(p.name for p in Path(cases[name]["hf"]).iterdir() if p.name.startswith(("tokenizer",
                                                                                                  "generation")))
        assert carried and all((out / f).read_bytes() == (Path(cases[name]["hf"]) / f).read_bytes() for f in carried)
        assert transformers.AutoTokenizer.from_pretrained(str(out))("w5 w7")["input_ids"] == [5, 7]
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        config, hf_config = (json.loads((d / "config.json").read_text()) for d in (out, Path(cases[name]["hf"])))
        skip = ("transformers_version", "head_dim", "num_nextn_predict_layers")   # no MTP layer exported: 0
        assert {k: config.get(k) for k in hf_config if k not in skip} == \
            {k: v for k, v in hf_config.items() if k not in skip}, name
        assert config.get("num_nextn_predict_layers", 0) == 0, name
        assert type(model).__name__ == transformers.AutoConfig.from_pretrained(cases[name]["hf"]).architectures[0]
    # an upcycled dense import keeps the tokenizer files and exports as the inferred MoE architecture
    for name, model_type in (("llama", "mixtral"), ("qwen3", "qwen3_moe"), ("mistral", "mixtral")):
        out = tmp_path / f"{name}-upcycled"
        done = export_hf(cases[f"{name}-upcycled"]["ckpt"], out, progress=lambda line: None)
        assert done["model_type"] == model_type and "tokenizer.json" in done["files"], (name, done)
        assert transformers.AutoTokenizer.from_pretrained(str(out))("w5 w7")["input_ids"] == [5, 7]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen3-upcycled"),
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert _relative(hf_logits(str(tmp_path / "qwen3-upcycled"), tokens_BS), cases["qwen3"]["logits"]) <= TOLERANCE
    # a bf16 model comes back in bf16, the same bits (the checkpoint holds it in fp32, exactly)
    from moe_plugin.interop import import_hf

    bf16 = save_tiny_model("qwen2_moe", str(tmp_path / "bf16"), dtype=torch.bfloat16)
    import_hf(bf16, {"moe": {"num_experts": EXPERTS}}, tmp_path / "bf16-ckpt", progress=lambda line: None)
    export_hf(tmp_path / "bf16-ckpt", tmp_path / "bf16-hf", progress=lambda line: None)
    again, original = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("bf16-hf", "bf16"))
    assert {t.dtype for t in again.values()} == {torch.bfloat16} and sorted(again) == sorted(original)
    assert all(torch.equal(again[k], original[k]) for k in original)
    # a sharded directory (the index) imports too: the same tensors again

    import_hf(tmp_path / "mixtral", {"moe": {"num_experts": EXPERTS}}, tmp_path / "again", progress=lambda line: None)
    export_hf(tmp_path / "again", tmp_path / "again-hf", progress=lambda line: None)
    again = load_file(str(tmp_path / "again-hf" / "model.safetensors"))
    original = load_file(str(Path(cases["mixtral"]["hf"]) / "model.safetensors"))
    assert sorted(again) == sorted(original) and all(torch.equal(again[k], original[k]) for k in original)


def test_sliding_windows_map_to_megatrons_window_and_change_the_model(imported):
    """Mistral's and Mixtral's window on every layer, Qwen3's on the layers ``layer_types`` names, as the
    example's ``--window-size W-1,0`` (and ``--window-attn-skip-freq``); at the tests' 16 tokens each window
    changes transformers' logits, so the layouts' logits checks above mean the window is applied."""
    import transformers

    _root, tokens_BS, cases = imported
    flags = {name: " ".join(cases[name]["flags"]) for name in ("mistral_window", "qwen3_window", "mixtral_window")}
    assert "--window-size 4,0" in flags["mistral_window"] and "--window-attn-skip-freq" not in flags["mistral_window"]
    assert "--window-size 3,0 --window-attn-skip-freq [0,1]" in flags["qwen3_window"]
    assert "--window-size 5,0" in flags["mixtral_window"]
    for name in flags:
        config = transformers.AutoConfig.from_pretrained(cases[name]["hf"])
        without = {"sliding_window": None}   # the same weights without the window
        if getattr(config, "layer_types", None):
            without.update(use_sliding_window=False, layer_types=["full_attention"] * config.num_hidden_layers)
        model = transformers.AutoModelForCausalLM.from_pretrained(cases[name]["hf"], dtype=torch.float32, **without)
        model.eval()
        with torch.no_grad():
            full = model(input_ids=tokens_BS, use_cache=False).logits.float()
        assert _relative(full, cases[name]["logits"]) > 1e-3, name


def test_gpt_oss_pieces_each_change_the_model(imported):
    """The tiny GPT-OSS exercises what its logits checks above stand for: in transformers, without its window
    (layer 0), its sinks, the clamp (limit 1 against 7), its expert biases or its router bias the logits
    move; the import maps them to the example's flags and the "moe" block."""
    import transformers

    _root, tokens_BS, cases = imported
    case = cases["gpt_oss"]
    flags = " ".join(case["flags"])
    assert "--softmax-type learnable --rope-scaling" in flags and "--window-size 3,0 --window-attn-skip-freq [1,0]" \
        in flags and "--disable-bias-linear" not in flags and "--kv-channels 24" in flags
    assert {k: case["moe"][k] for k in ("activation", "swiglu_limit", "expert_linear_bias", "router_logit_bias")} == \
        {"activation": "clamped_swiglu", "swiglu_limit": 1.0, "expert_linear_bias": True, "router_logit_bias": True}

    def logits(edit=None, **config) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(case["hf"], dtype=torch.float32, **config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if edit is not None and name.endswith(edit):
                    p.zero_()
            return model(input_ids=tokens_BS, use_cache=False).logits.float()

    changes = {"window": logits(sliding_window=64),   # wider than the tokens: no window
               "clamp": logits(swiglu_limit=7.0), "sinks": logits("sinks"),
               "expert biases": logits("proj_bias"), "router bias": logits("router.bias")}
    for what, other in changes.items():
        assert _relative(other, case["logits"]) > 1e-3, what


# -- refusals --------------------------------------------------------------------------------------
def _nothing_written(path: Path) -> bool:
    return not path.exists() or not any(p.is_file() and not p.name.startswith(".") for p in path.rglob("*"))


@pytest.mark.parametrize("name, overrides, key", [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters.rope_type"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ("deepseek_v3", {"rms_norm_eps": 1e-5}, "rms_norm_eps"),   # the latent norms' epsilon is fixed at 1e-6
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("qwen3_moe", {"kv_lora_rank": 16}, "kv_lora_rank"),
    ("llama", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("gpt_oss", {"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
    ("ernie4_5_moe", {"use_bias": True}, "use_bias"),   # biases on every linear and lm_head
    ("dots1", {"attention_bias": True}, "attention_bias"),   # q/k/v and o biases beside dense layers
    ("minimax_m2", {"partial_rotary_factor": 0.5, "rotary_dim": None, "n_group": 2}, "n_group"),
])
def test_what_the_plugin_cannot_represent_is_refused_naming_the_key(tmp_path, name, overrides, key):
    from moe_plugin.configs import ConfigError
    from moe_plugin.interop import import_hf

    hf = save_tiny_model(name, str(tmp_path / "hf"), **overrides)
    with pytest.raises(ConfigError, match=f"{key}.*model_type {name}"):
        import_hf(hf, {"moe": {"num_experts": EXPERTS}}, tmp_path / "ckpt", progress=lambda line: None)
    assert _nothing_written(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_multi_token_prediction_layers_are_left_out_naming_them(imported, tmp_path, name):
    """A GLM-4.5 (DeepSeek-V3) directory as the hub holds it: the multi-token-prediction layer's tensors
    (``model.layers.N`` past ``num_hidden_layers``, which transformers ignores) are left out with a
    line; the checkpoint is the one without them."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moe_plugin.checkpoint.export import CheckpointSource
    from moe_plugin.interop import import_hf

    _root, _tokens, cases = imported
    hf = tmp_path / "mtp"
    shutil.copytree(cases[name]["hf"], hf)
    tensors = load_file(str(hf / "model.safetensors"))
    tensors.update({"model.layers.2.eh_proj.weight": torch.ones(64, 128),
                    "model.layers.2.enorm.weight": torch.ones(64)})
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    lines = []
    import_hf(hf, {"moe": {"num_experts": EXPERTS}}, tmp_path / "ckpt", progress=lines.append)
    assert any("left out 2 tensors of layers [2], the multi-token-prediction layers" in line for line in lines), lines
    ours, theirs = CheckpointSource(tmp_path / "ckpt"), CheckpointSource(cases[name]["ckpt"])
    assert sorted(ours.specs()) == sorted(theirs.specs())
    assert all(torch.equal(ours.read(k), theirs.read(k)) for k in ours.specs())


def _fp8_blocks(weight: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in FP8 (e4m3) with one fp32 scale per block of rows x cols (the last ones partial),
    as DeepSeek-V3 and Qwen3-FP8 store theirs: the weight is the FP8 tensor times its block's scale."""
    R, C = weight.shape
    scale = torch.zeros(-(-R // rows), -(-C // cols))
    quantized = torch.zeros(R, C, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scale[i, j] = block.abs().max() / 448.0
            quantized[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def _imports_alike(quantized: Path, plain: Path, tmp_path: Path, said: str) -> None:
    """import-hf of the quantized directory says ``said`` and writes the checkpoint of the dequantized one
    (``tmp_path / "ckpt-<name of quantized>"``, tensor for tensor)."""
    from moe_plugin.checkpoint.export import CheckpointSource
    from moe_plugin.interop import import_hf

    lines = []
    import_hf(quantized, {"moe": {"num_experts": EXPERTS}}, tmp_path / f"ckpt-{quantized.name}", progress=lines.append)
    assert any(said in line for line in lines), lines
    import_hf(plain, {"moe": {"num_experts": EXPERTS}}, tmp_path / "ckpt-plain", progress=lambda line: None)
    ours, theirs = CheckpointSource(tmp_path / f"ckpt-{quantized.name}"), CheckpointSource(tmp_path / "ckpt-plain")
    assert sorted(ours.specs()) == sorted(theirs.specs())
    assert all(torch.equal(ours.read(k), theirs.read(k)) for k in ours.specs())


@pytest.mark.slow   # a spawned rank
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_fp8_block_weights_are_dequantized_at_import(imported, tmp_path, name):
    """A Qwen3-MoE (a DeepSeek-V3: its latent projections too) whose linear weights are FP8 in 16 x 24
    blocks with ``weight_scale_inv`` (the router
    and norms kept, as the hub's FP8 models keep them): import-hf dequantizes each block by its scale
    (the same checkpoint as importing the dequantized model, which the test computes block by block on
    its own), the example's model gives transformers' logits of that model, and export-hf writes it
    unquantized (no ``quantization_config``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dist import run_distributed
    from moe_plugin.interop import export_hf

    _root, tokens_BS, cases = imported
    case = cases[name]
    fp8, plain = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(case["hf"], fp8)
    shutil.copytree(case["hf"], plain)
    tensors, stored, dequantized = load_file(str(Path(case["hf"]) / "model.safetensors")), {}, {}
    for key, weight in tensors.items():
        if key.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            quantized, scale = _fp8_blocks(weight, 16, 24)
            stored[key], stored[key[:-len("weight")] + "weight_scale_inv"] = quantized, scale
            dequantized[key] = (quantized.float() * scale.repeat_interleave(16, 0)[:weight.shape[0]]
                                .repeat_interleave(24, 1)[:, :weight.shape[1]])
        else:
            stored[key] = dequantized[key] = weight
    save_file(stored, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 24]}
    (fp8 / "config.json").write_text(json.dumps(config))
    _imports_alike(fp8, plain, tmp_path, "FP8 weights in 16x24 blocks, dequantized to torch.float32")
    logits = hf_logits(str(plain), tokens_BS)
    assert _relative(logits, case["logits"]) > 1e-4   # FP8 changed the model: the check below means something
    quantized = {**case, "ckpt": str(tmp_path / "ckpt-fp8")}
    results = run_distributed(_child, 1, tmp_path, {"fp8": quantized}, {"ep1": {}}, tokens_BS, timeout=300)
    _check_logits(results, {"fp8": {"logits": logits}}, "ep1")
    done = export_hf(tmp_path / "ckpt-fp8", tmp_path / "out", progress=lambda line: None)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text()), done
    assert sorted(exported) == sorted(dequantized)
    assert all(torch.equal(exported[k], dequantized[k]) for k in dequantized)


FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4(weight_EXR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-OSS's MXFP4 of a fused expert weight [E, X, R] (blocks of 32 along X of each row of its transpose),
    written out here: (blocks [E, R, X/32, 16] uint8, two FP4 codes a byte, the low nibble first; scales
    [E, R, X/32] uint8, the block's power of two + 127; the dequantized weight [E, X, R])."""
    table = torch.tensor(FP4)
    rows = weight_EXR.float().transpose(1, 2)
    E, R, X = rows.shape
    blocks = rows.reshape(E, R, X // 32, 32)
    power = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = (blocks / torch.exp2(power).unsqueeze(-1)).unsqueeze(-1).sub(table).abs().argmin(-1).to(torch.uint8)
    values = table[codes.long()] * torch.exp2(power).unsqueeze(-1)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    weight = values.reshape(E, R, X).transpose(1, 2).to(weight_EXR.dtype).contiguous()
    return packed, (power + 127).to(torch.uint8), weight


@pytest.mark.slow   # a spawned rank
def test_mxfp4_experts_are_dequantized_at_import(imported, tmp_path):
    """A GPT-OSS (bf16, as the hub's) whose fused experts are MXFP4 blocks and scales beside
    ``quantization_config`` mxfp4, as the hub's checkpoints hold them: transformers (dequantizing) and the
    test's own dequantized copy agree, so the test speaks the format; import-hf gives the checkpoint of
    that copy, reading one expert's row of blocks at a time; the example's model gives its logits; export-hf
    writes bf16 fused experts, unquantized."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from dist import run_distributed
    from moe_plugin.interop import export_hf

    _root, tokens_BS, cases = imported
    source = save_tiny_model("gpt_oss", str(tmp_path / "bf16"), seed=3, dtype=torch.bfloat16)
    mx, plain = tmp_path / "mxfp4", tmp_path / "dequantized"
    shutil.copytree(source, mx)
    shutil.copytree(source, plain)
    stored, dequantized = {}, {}
    for key, tensor in load_file(str(Path(source) / "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[key + "_blocks"], stored[key + "_scales"], dequantized[key] = _mxfp4(tensor)
        else:
            stored[key] = dequantized[key] = tensor
    save_file(stored, str(mx / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mx / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(config))
    logits = hf_logits(str(plain), tokens_BS)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(mx), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=tokens_BS, use_cache=False).logits.float(), logits)
    _imports_alike(mx, plain, tmp_path, "4 MXFP4 expert weights, dequantized to torch.bfloat16")
    case = {"flags": cases["gpt_oss"]["flags"], "moe": cases["gpt_oss"]["moe"], "ckpt": str(tmp_path / "ckpt-mxfp4")}
    results = run_distributed(_child, 1, tmp_path, {"mxfp4": case}, {"ep1": {}}, tokens_BS, timeout=300)
    _check_logits(results, {"mxfp4": {"logits": logits}}, "ep1")
    export_hf(tmp_path / "ckpt-mxfp4", tmp_path / "out", progress=lambda line: None)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert sorted(exported) == sorted(dequantized)
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], dequantized[k]) for k in dequantized)


def test_unknown_model_type_and_left_over_tensor_are_refused(imported, tmp_path):
    from safetensors.torch import load_file, save_file

    from moe_plugin.checkpoint import CheckpointError
    from moe_plugin.configs import ConfigError
    from moe_plugin.interop import import_hf

    _root, _tokens, cases = imported
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((Path(cases["mixtral"]["hf"]) / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ConfigError, match="model_type: got 'gpt_neox'; the plugin imports mixtral"):
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
                              ("llama-upcycled", "qwen3_moe", "qk_layernorm: got False; Qwen3MoeForCausalLM"),
                              ("olmoe", "qwen3_moe", "qk_layernorm_scope: got 'projection'; Qwen3MoeForCausalLM"),
                              ("qwen3_moe", "olmoe", "qk_layernorm_scope: got 'head'; OlmoeForCausalLM"),
                              ("glm4_moe", "qwen2_moe", "qk_layernorm: got True; Qwen2MoeForCausalLM"),
                              ("glm4_moe", "mixtral", "qk_layernorm: got True; MixtralForCausalLM"),
                              ("qwen2_moe", "glm4_moe", "moe.score_function: got .*; Glm4MoeForCausalLM")):
        with pytest.raises(ConfigError, match=match):
            export_hf(cases[name]["ckpt"], tmp_path / "out", arch=arch, progress=lambda line: None)
        assert _nothing_written(tmp_path / "out")


# -- train the imported model with the example, export it ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "olmoe", "glm4_moe", "qwen3_moe_yarn", "deepseek_v3", "deepseek_v2",
                                  "gpt_oss"])
def test_trained_import_exports_to_what_the_plugin_evaluates(imported, tmp_path, name):
    """The imported Mixtral (and OLMoE) trained 2 steps by the example under dp 2 x ep 2, ZeRO-1 (``--load`` the
    import, ``--async-save``), exported: transformers' logits of the export are the plugin's of the
    saved checkpoint, and the export has the imported model's tokenizer files, config keys and dtype
    (the trained checkpoint carries the import's ``hf`` and ``architecture`` records and files)."""
    import transformers

    from dist import run_distributed
    from example_runs import MODEL_FLAGS, run_main

    from moe_plugin.interop import export_hf

    _root, tokens_BS, cases = imported
    case = cases[name]
    data = [f for f in MODEL_FLAGS[MODEL_FLAGS.index("--corpus-bytes"):]]
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**_ds(case["moe"], {"expert": 2}, 2), "train_micro_batch_size_per_gpu": 2,
                              "zero_optimization": {"stage": 1},   # the example's configs' stage
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}))
    argv = [*case["flags"], "--seq-length", str(SEQ), "--micro-batch-size", "2", "--train-iters", "2",
            "--eval-interval", "0", "--eval-iters", "1", "--log-interval", "1", *data, "--no-plot",
            "--deepspeed_config", str(ds), "--load", case["ckpt"], "--save", str(tmp_path / "trained"),
            "--run-dir", str(tmp_path / "run"), "--data-cache", str(tmp_path / "data"), "--async-save"]
    assert [r["status"] for r in run_distributed(run_main, 2, tmp_path, argv, timeout=300)] == [0, 0]
    imported_meta, trained_meta = (json.loads((Path(d) / "moe_plugin.json").read_text())
                                   for d in (Path(case["ckpt"]) / "step0", tmp_path / "trained" / "step2"))
    for key in ("hf", "architecture"):
        assert trained_meta[key] == imported_meta[key], key
    assert all(name in trained_meta["files"] for name in imported_meta["hf"]["tokenizer_files"])
    done = export_hf(tmp_path / "trained", tmp_path / "exported", progress=lambda line: None)
    print(f"export-hf of the trained checkpoint: {done['seconds']:.2f} s")
    exported, original = tmp_path / "exported", Path(case["hf"])
    carried = [Path(name).name for name in imported_meta["hf"]["tokenizer_files"]]
    assert "tokenizer.json" in carried
    assert all((exported / f).read_bytes() == (original / f).read_bytes() for f in carried)
    assert transformers.AutoTokenizer.from_pretrained(str(exported))("w5 w7")["input_ids"] == [5, 7]
    config, hf_config = (json.loads((d / "config.json").read_text()) for d in (exported, original))
    # GLM-4.5's and DeepSeek-V3's multi-token-prediction layers are not exported: the export says it has none
    free = ("transformers_version", "head_dim", "num_nextn_predict_layers")
    assert {k: config.get(k) for k in hf_config if k not in free} == \
        {k: v for k, v in hf_config.items() if k not in free}
    assert config.get("num_nextn_predict_layers") == (0 if name in ("glm4_moe", "deepseek_v3") else None)
    theirs = hf_logits(str(tmp_path / "exported"), tokens_BS)
    assert _relative(theirs, case["logits"]) > 1e-3   # it trained: not the imported model any more
    trained = {**case, "ckpt": str(tmp_path / "trained")}
    results = run_distributed(_child, 1, tmp_path, {"trained": trained}, {"ep1": {}}, tokens_BS, timeout=300)
    _check_logits(results, {"trained": {"logits": theirs}}, "ep1")


def test_commands_print_the_flags_and_the_completed_block(imported, tmp_path, capsys):
    from moe_plugin_tools.cli import main

    _root, _tokens, cases = imported
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 4, "moe": {"num_experts": 8, "parallel": {"expert": 2}}}))
    assert main(["import-hf", cases["qwen2_moe"]["hf"], "--config", str(ds), "--out", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "filled in from config.json: moe.top_k, moe.router, moe.normalize_gates" in out, out
    block = json.loads(out.split('"moe": ', 1)[1].splitlines()[0])
    assert block["shared_expert_ffn_hidden_size"] == 48 and block["shared_expert_gate"] is True
    assert block["normalize_gates"] is False and block["parallel"] == {"expert": 2}
    assert f"--load {tmp_path / 'ckpt'} " + " ".join(cases["qwen2_moe"]["flags"]) in out
    assert "--add-qkv-bias" in out and "--qk-layernorm" not in out
    written = json.loads((tmp_path / "ckpt" / "ds_config.json").read_text())   # the JSON to train with
    assert written == {"train_batch_size": 4, "moe": block}
    command = out.split("train it (from the repository's root; add --train-iters, --save ...):\n  ", 1)[1]
    assert command.splitlines()[0].startswith(f"deepspeed --num_gpus 2 examples/gpt_moe/pretrain_gpt_moe.py "
                                              f"--deepspeed_config {tmp_path / 'ckpt' / 'ds_config.json'} --load ")
    assert main(["export-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert "exported" in capsys.readouterr().out
    with pytest.raises(SystemExit) as caught:   # into a directory that is not empty
        main(["export-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")])
    assert caught.value.code == 2
    assert "exists and is not empty" in capsys.readouterr().err


@pytest.mark.slow   # through the deepspeed launcher
def test_the_printed_command_trains_the_import_as_printed(imported, tmp_path, capsys):
    """``moe-plugin import-hf`` given a JSON without the expert fields (the "moe" block holds num_experts and
    the layout only): the command it prints -- the written JSON, ``--load``, the model's flags, the ranks
    the layout needs -- trains the imported Mixtral through the ``deepspeed`` launcher (only the run's
    length and where its files go added), loading the import."""
    import shlex

    from launcher import assert_succeeded, deepspeed
    from moe_plugin_tools.cli import main

    _root, _tokens, cases = imported
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                              "moe": {"num_experts": EXPERTS, "parallel": {"expert": 2}}}))
    assert main(["import-hf", cases["mixtral"]["hf"], "--config", str(ds), "--out", str(tmp_path / "ckpt")]) == 0
    printed = capsys.readouterr().out.rsplit("\n  ", 1)[1].strip()
    argv = shlex.split(printed)
    assert argv[:3] == ["deepspeed", "--num_gpus", "2"] and "--swiglu" in argv and "PREFIX" not in argv, printed
    done = deepspeed(*argv[1:], "--train-iters", "2", "--eval-interval", "0", "--seq-length", "16", "--no-plot",
                     "--data-cache", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), timeout=300)
    assert_succeeded(done)
    assert f"loaded {tmp_path / 'ckpt' / 'step0'}" in done.output and "reached step 2" in done.output, done.tail()


def test_without_transformers_the_commands_say_which_extra(imported, tmp_path, monkeypatch, capsys):
    import sys

    from moe_plugin_tools.cli import main

    _root, _tokens, cases = imported
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers raises ImportError
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"moe": {"num_experts": EXPERTS}}))
    with pytest.raises(SystemExit) as caught:
        main(["import-hf", cases["mixtral"]["hf"], "--config", str(ds), "--out", str(tmp_path / "ckpt")])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: transformers: got not installed; the Hugging Face import and export need it: " \
                  "pip install 'moe_plugin[hf]'", err
    assert _nothing_written(tmp_path / "ckpt")


@pytest.mark.parametrize("change, match", [
    (lambda meta, state: meta["moe"].update(activation="gelu"), "moe.activation: got 'gelu'; MixtralForCausalLM"),
    (lambda meta, state: meta["moe"].update(router="gshard"), "moe.router: got 'gshard'"),
    (lambda meta, state: meta["model"].update(position_embedding_type="learned_absolute"),
     "position_embedding_type: got 'learned_absolute'"),
    (lambda meta, state: meta["model"]["transformer_config"].update(normalization="LayerNorm"),
     "normalization: got 'LayerNorm'"),
    (lambda meta, state: meta["model"]["transformer_config"].update(activation_func="torch.nn.functional:gelu"),
     "activation_func: got 'torch.nn.functional:gelu'"),
    (lambda meta, state: state["decoder.layers.1.mlp.router.expert_bias"].add_(0.5),
     "decoder.layers.1.mlp.router.expert_bias: got 'non-zero'"),
    (lambda meta, state: meta["model"].pop("rotary_base"), "rotary_base: got not recorded; the checkpoint does not record its RoPE base"),
])
def test_what_a_checkpoint_cannot_express_as_mixtral_is_named(imported, change, match):
    import copy

    from moe_plugin.checkpoint.export import StateSource, read_full_state
    from moe_plugin.configs import ConfigError
    from moe_plugin.interop.hf_export import architecture_from_checkpoint

    _root, _tokens, cases = imported
    state, _extras, meta, _path = read_full_state(cases["mixtral"]["ckpt"], progress=lambda line: None)
    meta = copy.deepcopy(meta)
    change(meta, state)
    with pytest.raises(ConfigError, match=match):
        architecture_from_checkpoint(meta, StateSource(state), "mixtral")


def test_every_registered_family_has_a_tiny_model_a_docs_row_and_a_help_entry():
    """The registry drives the tests (every family's tiny model is imported, checked against transformers'
    logits at 1 rank, tp2 x ep2 and pp2 x ep2, and round-tripped above), docs/huggingface.md's table
    (rendered from each family's ``sets``) and export-hf's --arch help."""
    from moe_plugin.interop.families import REGISTRY
    from moe_plugin_tools.cli import build_parser

    import transformers

    from moe_plugin_tools.family_docs import render_markdown

    table = (REPO / "docs" / "huggingface.md").read_text()
    assert table == render_markdown(table), "docs/huggingface.md is stale: python -m moe_plugin_tools.family_docs"
    help_text = build_parser().format_help() + _subcommand_help("export-hf")
    for family in REGISTRY:
        config_cls, model_cls, _fields = MODELS[family.model_type]
        assert (config_cls, model_cls) == (family.config_class, family.architecture), family.model_type
        assert getattr(transformers, family.config_class)().model_type == family.model_type
        assert family.sets and f"| `{family.model_type}` | `{family.architecture}`" in table, family.model_type
        assert family.model_type in help_text, family.model_type


def _subcommand_help(name: str) -> str:
    from moe_plugin_tools.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if getattr(a, "choices", None) and name in a.choices)
    return action.choices[name].format_help()
